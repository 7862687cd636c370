//! Activation rows quantized as ggml does on x86: `quantize_row_q8_0` (AVX2 path: scale
//! `127 / amax`, round to nearest with ties to even, f16 block scale).

use half::f16;

/// A Q8_0 activation block: 32 values, scale already rounded through f16 as ggml stores it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub(crate) struct Q8_0Block {
    pub(crate) d: f32,
    pub(crate) qs: [i8; 32],
}

pub(crate) fn quantize_q8_0(x: &[f32], out: &mut [Q8_0Block]) {
    for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        o.d = f16::from_f32(amax / 127.0).to_f32();
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            // Saturating like `_mm256_packs_epi32`; in range anyway (|v * id| <= 127).
            *q = (v * id).round_ties_even() as i8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_block_scale_and_ties() {
        // amax 127 → scale 1, values pass through with ties to even.
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.5;
        let mut out = [Q8_0Block::default()];
        quantize_q8_0(&x, &mut out);
        assert_eq!(out[0].d, 1.0);
        assert_eq!(&out[0].qs[..4], &[127, 2, -4, 0]);
    }
}
