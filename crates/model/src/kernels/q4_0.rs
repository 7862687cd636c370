//! Q4_0 weights (f16 scale, 32 four-bit values `w + 8` per block: 18 bytes where Q8_0 takes
//! 34), computed by the Q8_0-activation kernels of `q8_0` as Q5_0 is (see `q5_0`): each step's
//! nibbles are unpacked in registers into the bytes a Q8_0 weight stores, so the results are the
//! bits of the same values stored as Q8_0, and batches unpack each slice once into
//! `q8_0::FiveBitBytes` (`w + 16`, four-bit values being five-bit ones too).
//!
//! Group block (sixteen rows, 288 bytes): the sixteen f16 scales, then four nibble registers of
//! 64 bytes, register `k` holding in byte `4j + i` the low nibble of row `j`'s value `4k + i`
//! and the high nibble of its value `4(k + 4) + i` — the bytes of a GGUF block as they are
//! (its byte `n` holds values `n` and `n + 16`), four of each row side by side. Q5_0 keeps the
//! same nibbles and adds a register of fifth bits.

use super::q8_0::{widen_to_five_bit_bytes, FiveBitBytes, Format, WithQ8_0Acts};
use super::Isa;

/// GGUF block: f16 scale, 16 bytes of nibbles.
pub(crate) const BLOCK_BYTES: usize = 18;
/// Bytes of the sixteen f16 scales that open every group block.
const SCALES: usize = 32;

pub(crate) struct Q4_0;

/// Byte and bit shift of the low four bits of value `i` (of 32) of row `j` in a group block.
pub(super) fn nibble_place(j: usize, i: usize) -> (usize, usize) {
    let s = i / 4;
    (SCALES + 64 * (s & 3) + 4 * j + i % 4, 4 * (s >> 2))
}

impl Format for Q4_0 {
    const BLOCK_BYTES: usize = BLOCK_BYTES;
    // As Q5_0: a decode step waits for memory, not for the unpacking; a batch would unpack
    // once per tile of four rows.
    type Batched = WithQ8_0Acts<FiveBitBytes>;

    fn widens(_isa: Isa) -> bool {
        true
    }

    fn widen(isa: Isa, w: &[u8], _nb: usize, out: &mut Vec<u8>) {
        widen_to_five_bit_bytes::<Self>(isa, w, out);
    }

    fn gguf_quant(block: &[u8], i: usize) -> i8 {
        let nibbles = block[2 + i % 16];
        let q = if i < 16 { nibbles & 0x0f } else { nibbles >> 4 };
        q as i8 - 8
    }

    fn put_quant(gb: &mut [u8], j: usize, i: usize, q: i8) {
        let (at, shift) = nibble_place(j, i);
        gb[at] |= ((q + 8) as u8) << shift;
    }

    fn quant(gb: &[u8], j: usize, i: usize) -> i8 {
        let (at, shift) = nibble_place(j, i);
        (gb[at] >> shift & 0x0f) as i8 - 8
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn signed_step(p: *const u8, s: usize, h: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the caller's guarantees, passed on.
        let low = unsafe { x86::nibbles_avx2(p, s, h) };
        _mm256_sub_epi8(low, _mm256_set1_epi8(8))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned_steps(p: *const u8) -> [std::arch::x86_64::__m512i; 8] {
        use std::arch::x86_64::*;
        // SAFETY: the caller's guarantees, passed on.
        let low = unsafe { x86::nibbles_avx512(p) };
        // w + 128 = low + 120.
        low.map(|n| _mm512_add_epi8(n, _mm512_set1_epi8(120)))
    }
}

/// The nibble registers' unpacking, shared with Q5_0.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::SCALES;

    /// Step `s` of half `h` (rows `8h..8h + 8`) of the group block at `p`: four values' low
    /// four bits of each row, one a byte.
    ///
    /// # Safety
    /// `p` points to a whole group block; the CPU has AVX2.
    #[inline(always)]
    pub(in super::super) unsafe fn nibbles_avx2(p: *const u8, s: usize, h: usize) -> __m256i {
        // SAFETY: the nibble register of step `s`, half `h`, lies inside the group block.
        let nibbles =
            unsafe { _mm256_loadu_si256(p.add(SCALES + 64 * (s & 3) + 32 * h) as *const __m256i) };
        let nibbles = if s < 4 {
            nibbles
        } else {
            _mm256_srli_epi16::<4>(nibbles)
        };
        _mm256_and_si256(nibbles, _mm256_set1_epi8(0x0f))
    }

    /// The group block's eight steps, every row's four values' low four bits, one a byte.
    ///
    /// # Safety
    /// `p` points to a whole group block; the CPU has AVX-512 (F, BW).
    #[inline(always)]
    pub(in super::super) unsafe fn nibbles_avx512(p: *const u8) -> [__m512i; 8] {
        // SAFETY: four nibble registers follow the scales.
        let nibbles: [__m512i; 4] = std::array::from_fn(|k| unsafe {
            _mm512_loadu_si512(p.add(SCALES + 64 * k) as *const __m512i)
        });
        let mask = _mm512_set1_epi8(0x0f);
        std::array::from_fn(|s| {
            let n = if s < 4 {
                nibbles[s]
            } else {
                _mm512_srli_epi16::<4>(nibbles[s - 4])
            };
            _mm512_and_si512(n, mask)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{
        check_bits_as_q8_0, check_dequantized_as_candle, check_paths_agree, random_gguf, Rng,
    };
    use super::super::WeightFormat;
    use super::*;

    #[test]
    fn simd_paths_equal_scalar_reference_bit_for_bit() {
        let mut rng = Rng::new(7);
        for (rows, nb) in [(1, 1), (5, 3), (16, 20), (37, 2)] {
            let w = random_gguf(WeightFormat::Q4_0, rows * nb, &mut rng);
            check_paths_agree(WeightFormat::Q4_0, &w, nb * 32, rows, &mut rng);
        }
    }

    #[test]
    fn gives_the_bits_of_its_values_as_q8_0() {
        check_bits_as_q8_0::<Q4_0>(WeightFormat::Q4_0, &mut Rng::new(8));
    }

    #[test]
    fn reads_gguf_blocks_as_candle_does() {
        check_dequantized_as_candle(WeightFormat::Q4_0, &mut Rng::new(9));
    }
}
