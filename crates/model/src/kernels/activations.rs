//! Activation rows quantized as ggml does on x86: `quantize_row_q8_0` (AVX2 path: scale
//! `127 / amax`, round to nearest with ties to even, f16 block scale) and `quantize_row_q8_K_ref`
//! (scale `-127 / max`, `nearest_int`, f32 block scale, sums of 16).

use half::f16;

/// A Q8_0 activation block: 32 values, scale already rounded through f16 as ggml stores it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub(crate) struct Q8_0Block {
    pub(crate) d: f32,
    pub(crate) qs: [i8; 32],
    /// Σ qs, to take out the +128 that makes the weights unsigned for VNNI.
    pub(crate) sum: i32,
}

/// A Q8_K activation block: 256 values, f32 scale, the sum of every 16 values.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub(crate) struct Q8KBlock {
    pub(crate) d: f32,
    pub(crate) qs: [i8; 256],
    pub(crate) bsums: [i16; 16],
}

impl Default for Q8KBlock {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; 256],
            bsums: [0; 16],
        }
    }
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
        o.sum = o.qs.iter().map(|&q| q as i32).sum();
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even, through the float mantissa.
fn nearest_int(v: f32) -> i32 {
    let biased = v + 12_582_912.0;
    (biased.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

pub(crate) fn quantize_q8_k(x: &[f32], out: &mut [Q8KBlock]) {
    for (xb, o) in x.chunks_exact(256).zip(out.iter_mut()) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *o = Q8KBlock::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, q) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i16).sum();
        }
        o.d = 1.0 / iscale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(3.5), 4);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-126.6), -127);
        assert_eq!(nearest_int(0.49), 0);
    }

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

    #[test]
    fn q8_k_block_keeps_sums_and_sign_of_max() {
        let x: Vec<f32> = (0..256).map(|i| (i as f32 - 100.0) / 10.0).collect();
        let mut out = [Q8KBlock::default()];
        quantize_q8_k(&x, &mut out);
        let b = &out[0];
        // max |x| is 15.5 (i = 255): it maps to -127 * sign, d carries the sign back.
        assert_eq!(b.qs[255], -127);
        assert!(b.d < 0.0);
        for (j, s) in b.bsums.iter().enumerate() {
            let sum: i16 = b.qs[j * 16..j * 16 + 16].iter().map(|&v| v as i16).sum();
            assert_eq!(*s, sum);
        }
        for (i, &v) in x.iter().enumerate() {
            assert!((b.qs[i] as f32 * b.d - v).abs() <= b.d.abs() / 2.0 + 1e-6);
        }
    }
}
