//! Q5_0 and Q4_0 weights (f16 scale, 32 five-bit values `w + 16` or four-bit values `w + 8` per
//! block: 22 or 18 bytes where Q8_0 takes 34), computed by the Q8_0-activation kernels of
//! `q8_0`: each step's quants are unpacked in registers into the bytes a Q8_0 weight stores, so
//! the integer sums, and the results, are the bits of the same values stored as Q8_0 — with a
//! third (a half) less memory to read, which is what a decode step waits for. Batches unpack
//! each slice once into one byte per value (`q8_0::FiveBitBytes`, four-bit values being
//! five-bit ones too), which AVX2 multiplies without ggml's sign trick.
//!
//! Group block (sixteen rows, 352 or 288 bytes): the sixteen f16 scales; four nibble registers
//! of 64 bytes, register `k` holding in byte `4j + i` the low four bits of row `j`'s value
//! `4k + i` (low nibble) and of its value `4(k + 4) + i` (high nibble) — a GGUF block's nibble
//! bytes as they are, four of each row side by side; then, for Q5_0, 64 bytes whose byte
//! `4j + i` holds in bit `s` the fifth bit of row `j`'s value `4s + i`. Step `s` is thus one
//! register's nibbles (and one bit of every byte of the last).

use super::q8_0::{widen_to_five_bit_bytes, FiveBitBytes, Format, WithQ8_0Acts};
use super::Isa;

/// Bytes of the sixteen f16 scales that open every group block.
const SCALES: usize = 32;
/// Where Q5_0's fifth bits start in a group block.
const HIGH_BITS: usize = SCALES + 4 * 64;

/// Q5_0 (`FIFTH_BIT`) or Q4_0 weights.
pub(crate) struct Nibbles<const FIFTH_BIT: bool>;
pub(crate) type Q5_0 = Nibbles<true>;
pub(crate) type Q4_0 = Nibbles<false>;

impl<const FIFTH_BIT: bool> Nibbles<FIFTH_BIT> {
    /// GGUF block: f16 scale, (Q5_0) u32 of fifth bits, 16 bytes of nibbles.
    pub(crate) const GGUF_BLOCK_BYTES: usize = if FIFTH_BIT { 22 } else { 18 };
    /// Where a GGUF block's nibbles start.
    const GGUF_QS: usize = Self::GGUF_BLOCK_BYTES - 16;
    /// What the stored values are above the quants.
    const OFFSET: i8 = if FIFTH_BIT { 16 } else { 8 };
}

/// Byte and bit shift of value `i`'s low four bits (row `j`), and its fifth bit's byte and bit.
fn place(j: usize, i: usize) -> (usize, usize, usize, usize) {
    let (s, lane) = (i / 4, i % 4);
    (
        SCALES + 64 * (s & 3) + 4 * j + lane,
        4 * (s >> 2),
        HIGH_BITS + 4 * j + lane,
        s,
    )
}

impl<const FIFTH_BIT: bool> Format for Nibbles<FIFTH_BIT> {
    const BLOCK_BYTES: usize = Self::GGUF_BLOCK_BYTES;
    // Unpacking costs a decode step (one activation row) nothing, as it waits for memory; a
    // batch would unpack once per tile of four rows.
    type Batched = WithQ8_0Acts<FiveBitBytes>;

    fn widens(_isa: Isa) -> bool {
        true
    }

    const STEPS_STORED: bool = false;

    fn widen(isa: Isa, w: &[u8], _nb: usize, out: &mut Vec<u8>) {
        widen_to_five_bit_bytes::<Self>(isa, w, out);
    }

    fn gguf_quant(block: &[u8], i: usize) -> i8 {
        let nibbles = block[Self::GGUF_QS + i % 16];
        let mut u = if i < 16 { nibbles & 0x0f } else { nibbles >> 4 };
        if FIFTH_BIT {
            let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
            u |= (((qh >> i) & 1) << 4) as u8;
        }
        u as i8 - Self::OFFSET
    }

    fn put_quant(gb: &mut [u8], j: usize, i: usize, q: i8) {
        let u = (q + Self::OFFSET) as u8;
        let (at, shift, high_at, bit) = place(j, i);
        gb[at] |= (u & 0x0f) << shift;
        if FIFTH_BIT {
            gb[high_at] |= (u >> 4 & 1) << bit;
        }
    }

    fn quant(gb: &[u8], j: usize, i: usize) -> i8 {
        let (at, shift, high_at, bit) = place(j, i);
        let mut u = gb[at] >> shift & 0x0f;
        if FIFTH_BIT {
            u |= (gb[high_at] >> bit & 1) << 4;
        }
        u as i8 - Self::OFFSET
    }

    /// `w + 16` is the five-bit value as stored (`w + 8` + 8 for Q4_0): no sign trick on AVX2.
    const AVX2_UNSIGNED_OFFSET: i32 = 16;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn avx2_unsigned_step(p: *const u8, s: usize, h: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the nibble register of step `s`, half `h`, lies inside the group block.
        let nibbles =
            unsafe { _mm256_loadu_si256(p.add(SCALES + 64 * (s & 3) + 32 * h) as *const __m256i) };
        let nibbles = if s < 4 {
            nibbles
        } else {
            _mm256_srli_epi16::<4>(nibbles)
        };
        let low = _mm256_and_si256(nibbles, _mm256_set1_epi8(0x0f));
        if !FIFTH_BIT {
            return _mm256_add_epi8(low, _mm256_set1_epi8(8));
        }
        // SAFETY: the fifth bits, half `h`, lie inside the group block.
        let high = unsafe { _mm256_loadu_si256(p.add(HIGH_BITS + 32 * h) as *const __m256i) };
        // Bit `s` of every byte to bit 4 (a 16-bit shift by at most four moves no other byte's
        // bit there), as the value's 16.
        let fifth = if s < 4 {
            _mm256_sll_epi16(high, _mm_cvtsi32_si128(4 - s as i32))
        } else {
            _mm256_srl_epi16(high, _mm_cvtsi32_si128(s as i32 - 4))
        };
        _mm256_or_si256(low, _mm256_and_si256(fifth, _mm256_set1_epi8(0x10)))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned_steps(p: *const u8) -> [std::arch::x86_64::__m512i; 8] {
        use std::arch::x86_64::*;
        // SAFETY: four nibble registers follow the scales.
        let nibbles: [__m512i; 4] = std::array::from_fn(|k| unsafe {
            _mm512_loadu_si512(p.add(SCALES + 64 * k) as *const __m512i)
        });
        let mask = _mm512_set1_epi8(0x0f);
        let low = |s: usize| {
            let n = if s < 4 {
                nibbles[s]
            } else {
                _mm512_srli_epi16::<4>(nibbles[s - 4])
            };
            _mm512_and_si512(n, mask)
        };
        if !FIFTH_BIT {
            // w + 128 = low + 120.
            return std::array::from_fn(|s| _mm512_add_epi8(low(s), _mm512_set1_epi8(120)));
        }
        // SAFETY: the fifth bits follow the nibbles.
        let high = unsafe { _mm512_loadu_si512(p.add(HIGH_BITS) as *const __m512i) };
        // w + 128 = low + 16·fifth + 112.
        let (without, with) = (_mm512_set1_epi8(112), _mm512_set1_epi8(-128));
        std::array::from_fn(|s| {
            let fifth = _mm512_test_epi8_mask(high, _mm512_set1_epi8((1u8 << s) as i8));
            _mm512_add_epi8(low(s), _mm512_mask_blend_epi8(fifth, without, with))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{
        as_q8_0, check_bits_as_q8_0, check_dequantized_as_candle, check_paths_agree, random_gguf,
        Rng,
    };
    use super::super::{matmul, prepare, Isa, WeightFormat};
    use super::*;

    #[test]
    fn simd_paths_equal_scalar_reference_bit_for_bit() {
        let mut rng = Rng::new(4);
        for format in [WeightFormat::Q5_0, WeightFormat::Q4_0] {
            for (rows, nb) in [(1, 1), (5, 3), (16, 20), (37, 2)] {
                let w = random_gguf(format, rows * nb, &mut rng);
                check_paths_agree(format, &w, nb * 32, rows, &mut rng);
            }
        }
    }

    /// The largest products a batch adds in i16 (every quant 15 or -16, every activation
    /// ±127) stay exact.
    #[test]
    fn extreme_values_stay_exact_in_batches() {
        let (rows, nb) = (16, 2);
        for (fill, sign) in [(0xffu8, 1.0f32), (0xff, -1.0), (0x00, 1.0), (0x00, -1.0)] {
            let mut w = Vec::new();
            for _ in 0..rows * nb {
                w.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
                w.extend_from_slice(&[fill; 20]);
            }
            let q5 = prepare(WeightFormat::Q5_0, w.clone(), rows);
            let q8 = prepare(WeightFormat::Q8_0, as_q8_0::<Q5_0>(&w), rows);
            let x = vec![sign; 17 * nb * 32];
            for isa in Isa::available() {
                assert_eq!(
                    matmul(WeightFormat::Q5_0, isa, &q5, nb * 32, rows, &x),
                    matmul(WeightFormat::Q8_0, isa, &q8, nb * 32, rows, &x),
                    "{isa:?} {fill:#x} {sign}"
                );
            }
        }
    }

    #[test]
    fn gives_the_bits_of_its_values_as_q8_0() {
        check_bits_as_q8_0::<Q5_0>(WeightFormat::Q5_0, &mut Rng::new(5));
        check_bits_as_q8_0::<Q4_0>(WeightFormat::Q4_0, &mut Rng::new(8));
    }

    #[test]
    fn reads_gguf_blocks_as_candle_does() {
        check_dequantized_as_candle(WeightFormat::Q5_0, &mut Rng::new(6));
        check_dequantized_as_candle(WeightFormat::Q4_0, &mut Rng::new(9));
    }
}
