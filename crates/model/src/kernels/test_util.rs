//! Shared checks for the kernel tests: every instruction set against the scalar reference, a
//! row alone against the same row in a batch, and the result against an f64 dot product of the
//! dequantized weight (through candle, an independent reading of the block layout) and the
//! dequantized activations.

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;

use super::activations::{
    quantize_q8_0, quantize_q8_0_pair_bound, quantize_q8_k, Q8KBlock, Q8_0Block,
};
use half::f16;

use super::q8_0::Format;
use super::{dequantize_rows, matmul, prepare, q4_k, q5_0, q6_k, q8_0, Isa, WeightFormat};

/// xorshift64*: deterministic test data without a dependency.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 16
    }

    /// Uniform in [-1, 1).
    pub(crate) fn uniform(&mut self) -> f32 {
        (self.next() % 2_000_001) as f32 / 1_000_000.0 - 1.0
    }
}

/// Random GGUF blocks of `format` (small f16 scales, any bits elsewhere).
pub(crate) fn random_gguf(format: WeightFormat, blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let (bytes, scales): (usize, &[usize]) = match format {
        WeightFormat::Q8_0 | WeightFormat::Q8_0PairBound => (q8_0::BLOCK_BYTES, &[0]),
        WeightFormat::Q5_0 => (q5_0::Q5_0::GGUF_BLOCK_BYTES, &[0]),
        WeightFormat::Q4_0 => (q5_0::Q4_0::GGUF_BLOCK_BYTES, &[0]),
        WeightFormat::Q4K => (q4_k::Q4K::GGUF_BLOCK_BYTES, &[0, 2]),
        WeightFormat::Q5K => (q4_k::Q5K::GGUF_BLOCK_BYTES, &[0, 2]),
        WeightFormat::Q6K => (q6_k::BLOCK_BYTES, &[208]),
    };
    let mut w: Vec<u8> = (0..blocks * bytes).map(|_| rng.next() as u8).collect();
    for b in w.chunks_exact_mut(bytes) {
        for &at in scales {
            b[at..at + 2].copy_from_slice(&f16::from_f32(rng.uniform() * 0.01).to_le_bytes());
        }
    }
    w
}

/// The activations as the kernels see them, dequantized.
fn dequantized_activations(format: WeightFormat, x: &[f32]) -> Vec<f64> {
    match format {
        WeightFormat::Q8_0
        | WeightFormat::Q8_0PairBound
        | WeightFormat::Q5_0
        | WeightFormat::Q4_0 => {
            let mut q = vec![Q8_0Block::default(); x.len() / 32];
            if format == WeightFormat::Q8_0PairBound {
                quantize_q8_0_pair_bound(Isa::Scalar, x, &mut q);
            } else {
                quantize_q8_0(Isa::Scalar, x, &mut q);
            }
            q.iter()
                .flat_map(|b| b.qs.iter().map(move |&v| b.d as f64 * v as f64))
                .collect()
        }
        WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K => {
            let mut q = vec![Q8KBlock::default(); x.len() / 256];
            quantize_q8_k(x, &mut q);
            q.iter()
                .flat_map(|b| b.qs.iter().map(move |&v| b.d as f64 * v as f64))
                .collect()
        }
    }
}

fn dequantized_weight(format: WeightFormat, w: &[u8], in_dim: usize, out_dim: usize) -> Vec<f32> {
    let dtype = match format {
        WeightFormat::Q8_0 | WeightFormat::Q8_0PairBound => GgmlDType::Q8_0,
        WeightFormat::Q5_0 => GgmlDType::Q5_0,
        WeightFormat::Q4_0 => GgmlDType::Q4_0,
        WeightFormat::Q4K => GgmlDType::Q4K,
        WeightFormat::Q5K => GgmlDType::Q5K,
        WeightFormat::Q6K => GgmlDType::Q6K,
    };
    let storage = QStorage::from_data(Cow::Borrowed(w), &Device::Cpu, dtype).expect("storage");
    QTensor::new(storage, (out_dim, in_dim))
        .expect("tensor")
        .dequantize(&Device::Cpu)
        .expect("dequantize")
        .flatten_all()
        .expect("flatten")
        .to_vec1::<f32>()
        .expect("vec")
}

pub(crate) fn check_paths_agree(
    format: WeightFormat,
    w: &[u8],
    in_dim: usize,
    out_dim: usize,
    rng: &mut Rng,
) {
    let wf = dequantized_weight(format, w, in_dim, out_dim);
    let w = &prepare(format, w.to_vec(), out_dim)[..];
    // 16, 17 and 25 rows: batches that run on widened weights whatever the format (Q8_0's
    // AVX2 batches from 16 rows).
    for rows in (1..=9).chain([16, 17, 25]) {
        // Rows of different magnitudes, one of them all zero.
        let mut x: Vec<f32> = (0..rows * in_dim)
            .map(|i| rng.uniform() * (1 + i / in_dim) as f32)
            .collect();
        if rows > 2 {
            x[in_dim..2 * in_dim].fill(0.0);
        }
        let reference = matmul(format, Isa::Scalar, w, in_dim, out_dim, &x);
        for isa in Isa::available() {
            let y = matmul(format, isa, w, in_dim, out_dim, &x);
            assert_eq!(
                y, reference,
                "{format:?} {isa:?}: {rows} rows of {in_dim} x {out_dim}"
            );
            for (r, xr) in x.chunks_exact(in_dim).enumerate() {
                let alone = matmul(format, isa, w, in_dim, out_dim, xr);
                assert_eq!(
                    alone,
                    y[r * out_dim..(r + 1) * out_dim],
                    "{isa:?}: row {r} alone"
                );
            }
        }
        let xa = dequantized_activations(format, &x);
        for (r, xr) in xa.chunks_exact(in_dim).enumerate() {
            for (c, wr) in wf.chunks_exact(in_dim).enumerate() {
                let terms: Vec<f64> = wr.iter().zip(xr).map(|(&w, &x)| w as f64 * x).collect();
                let exact: f64 = terms.iter().sum();
                let scale: f64 = terms.iter().map(|t| t.abs()).sum();
                let got = reference[r * out_dim + c] as f64;
                // f32 accumulation over in_dim terms: well inside 1e-5 of their magnitude.
                assert!(
                    (got - exact).abs() <= 1e-5 * scale + 1e-6,
                    "{format:?} row {r} col {c}: {got} vs {exact}"
                );
            }
        }
    }
}

/// The values of GGUF blocks of `F` as GGUF Q8_0 blocks.
pub(crate) fn as_q8_0<F: Format>(w: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in w.chunks_exact(F::BLOCK_BYTES) {
        out.extend_from_slice(&b[..2]);
        out.extend((0..32).map(|i| F::gguf_quant(b, i) as u8));
    }
    out
}

/// A weight of `F` (`format`) gives, on every path, the bits its values give stored as Q8_0,
/// and dequantizes to the same values.
pub(crate) fn check_bits_as_q8_0<F: Format>(format: WeightFormat, rng: &mut Rng) {
    let (rows, nb) = (40, 4);
    let w = random_gguf(format, rows * nb, rng);
    let ours = prepare(format, w.clone(), rows);
    let q8 = prepare(WeightFormat::Q8_0, as_q8_0::<F>(&w), rows);
    let x: Vec<f32> = (0..6 * nb * 32).map(|_| rng.uniform()).collect();
    for isa in Isa::available() {
        assert_eq!(
            matmul(format, isa, &ours, nb * 32, rows, &x),
            matmul(WeightFormat::Q8_0, isa, &q8, nb * 32, rows, &x),
            "{format:?} {isa:?}"
        );
    }
    let picked = [39, 0, 17];
    let dims = (nb * 32, rows);
    assert_eq!(
        dequantize_rows(format, &ours, dims, &picked).expect("ours"),
        dequantize_rows(WeightFormat::Q8_0, &q8, dims, &picked).expect("q8_0")
    );
}

/// Rows of a prepared weight dequantize to candle's values for its GGUF blocks.
pub(crate) fn check_dequantized_as_candle(format: WeightFormat, rng: &mut Rng) {
    let (rows, nb) = (19, 2);
    let in_dim = nb * format.block_elems();
    let w = random_gguf(format, rows * nb, rng);
    let candle = dequantized_weight(format, &w, in_dim, rows);
    let picked = [18, 0, 7, 16, 7];
    let ours = dequantize_rows(format, &prepare(format, w, rows), (in_dim, rows), &picked)
        .expect("dequantize");
    for (i, &r) in picked.iter().enumerate() {
        assert_eq!(
            ours[i * in_dim..(i + 1) * in_dim],
            candle[r * in_dim..(r + 1) * in_dim],
            "{format:?} row {r}"
        );
    }
}

/// CPU time of every thread of this process so far (Linux; 0 elsewhere). On a shared machine the
/// CPU time a call takes, times the threads, is steadier than its wall time (the timing tests).
pub(crate) fn cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 * 1e-9
}
