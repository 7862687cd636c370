use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use rayon::prelude::*;

use crate::kernels::{self, Isa, Q8_0Block, Threads, WeightFormat};
use crate::ModelError;

/// `y = x · Wᵀ` over a quantized weight `[out, in]`. The one place matmuls happen, so the kernel
/// behind it can be replaced without touching the model.
#[derive(Debug)]
pub(crate) struct Linear {
    weight: Weight,
    in_dim: usize,
    out_dim: usize,
    /// The frozen weight as the input gradient reads it, made before the first training step
    /// ([`Linear::keep_input_grad`]; training only).
    input_grad: OnceLock<InputGradWeight>,
    /// The weight in the layout batches run on (`kernels::widened`; none where its format
    /// reads the stored bytes), made for training ([`Linear::keep_widened`]): its batches then
    /// skip widening each slice.
    widened: OnceLock<Option<Vec<u8>>>,
}

/// Rows of W per transposed span (see `InputGradWeight::TransposedQ8_0`): whole Q8_0 blocks,
/// 2 KB of each transposed row; every layer's weight is one span.
pub(crate) const INPUT_GRAD_SPAN: usize = 2048;

/// A gradient of a [`Linear`]'s output as [`Linear::backward_input_non_negative`] multiplies it:
/// each row in Q8_0 blocks, laid out by the transposed weight's spans (a span's rows one after
/// another), so each span's product reads its activation rows whole. Kept by a caller that
/// makes many (fresh pages cost).
#[derive(Default)]
pub(crate) struct GradBlocks {
    rows: usize,
    out_dim: usize,
    blocks: Vec<Q8_0Block>,
}

impl GradBlocks {
    /// Made for `rows` rows of `out_dim` values (whole blocks), every row's runs to write in
    /// parallel.
    pub(crate) fn rows_mut(&mut self, rows: usize, out_dim: usize) -> Vec<GradRow<'_>> {
        assert!(out_dim.is_multiple_of(32), "whole blocks of 32");
        (self.rows, self.out_dim) = (rows, out_dim);
        self.blocks
            .resize(rows * out_dim / 32, Q8_0Block::default());
        let mut by_row: Vec<GradRow<'_>> =
            (0..rows).map(|_| GradRow { spans: Vec::new() }).collect();
        let mut rest = &mut self.blocks[..rows * out_dim / 32];
        for k0 in (0..out_dim).step_by(INPUT_GRAD_SPAN) {
            let span_blocks = (out_dim - k0).min(INPUT_GRAD_SPAN) / 32;
            let (span, tail) = std::mem::take(&mut rest).split_at_mut(rows * span_blocks);
            rest = tail;
            for (row, run) in by_row.iter_mut().zip(span.chunks_exact_mut(span_blocks)) {
                row.spans.push(run);
            }
        }
        by_row
    }

    /// Span `i`'s activation rows.
    fn span(&self, i: usize) -> &[Q8_0Block] {
        let k0 = i * INPUT_GRAD_SPAN;
        let span_blocks = (self.out_dim - k0).min(INPUT_GRAD_SPAN) / 32;
        let at = k0 / 32 * self.rows;
        &self.blocks[at..at + self.rows * span_blocks]
    }
}

/// One row of [`GradBlocks`]: its run of blocks in each span.
pub(crate) struct GradRow<'a> {
    spans: Vec<&'a mut [Q8_0Block]>,
}

impl GradRow<'_> {
    /// Quantizes `values`, the row's values from `at` on (whole blocks, within one span:
    /// `at` and the length multiples of 32 that do not cross a multiple of
    /// [`INPUT_GRAD_SPAN`]), as `kernels::quantize_gradient` does.
    pub(crate) fn write(&mut self, at: usize, values: &[f32]) {
        let (span, first) = (at / INPUT_GRAD_SPAN, at % INPUT_GRAD_SPAN / 32);
        assert!(at.is_multiple_of(32) && values.len().is_multiple_of(32));
        kernels::quantize_gradient(
            Isa::detect(),
            values,
            &mut self.spans[span][first..first + values.len() / 32],
        );
    }
}

/// What `dx = dy · W` multiplies by.
#[derive(Debug)]
enum InputGradWeight {
    /// Wᵀ `[in, out]` requantized to Q8_0 down each column (`kernels::transposed_q8_0`), for
    /// our kernels: int8 dot products, a quarter of an f32 copy's bytes. One matrix per
    /// `INPUT_GRAD_SPAN` rows of W: the kernels keep a slice of weight rows in L1 while every
    /// activation tile passes over it, which the LM head's 262,144-wide transposed rows (278 KB
    /// each) would not fit; in spans it is read from memory once per call, not once per tile.
    TransposedQ8_0(Vec<Vec<u8>>),
    /// W `[out, in]` in f32, for the weights our kernels do not cover (the tiny f32 models of the
    /// gradient tests among them: their backward stays exact).
    Dense(Tensor),
}

/// The one copy of a weight kept.
#[derive(Debug)]
enum Weight {
    /// As our kernels read it (`kernels::prepare`), for the types they cover.
    Kernel { format: WeightFormat, data: Vec<u8> },
    /// Any other type, through candle.
    Candle(QMatMul),
}

/// A weight as a GGUF file stores it: its type, its shape `[out, in]` and its bytes.
pub(crate) struct GgufWeight {
    pub dtype: GgmlDType,
    pub out_dim: usize,
    pub in_dim: usize,
    pub bytes: Vec<u8>,
}

impl Linear {
    /// Takes the bytes over: the kernels' layout is made in their memory where it can be, so
    /// a large weight is never held twice.
    pub(crate) fn new(weight: GgufWeight) -> Result<Self, ModelError> {
        let GgufWeight {
            dtype,
            out_dim,
            in_dim,
            bytes,
        } = weight;
        let format = match dtype {
            GgmlDType::Q8_0 => Some(WeightFormat::Q8_0),
            GgmlDType::Q5_0 => Some(WeightFormat::Q5_0),
            GgmlDType::Q4_0 => Some(WeightFormat::Q4_0),
            GgmlDType::Q4K => Some(WeightFormat::Q4K),
            GgmlDType::Q5K => Some(WeightFormat::Q5K),
            GgmlDType::Q6K => Some(WeightFormat::Q6K),
            _ => None,
        };
        let weight = match format.filter(|f| in_dim.is_multiple_of(f.block_elems())) {
            Some(format) => Weight::Kernel {
                format,
                data: kernels::prepare(format, bytes, out_dim),
            },
            None => {
                let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
                let tensor = QTensor::new(storage, (out_dim, in_dim))?;
                Weight::Candle(QMatMul::from_arc(Arc::new(tensor))?)
            }
        };
        Ok(Self {
            weight,
            in_dim,
            out_dim,
            input_grad: OnceLock::new(),
            widened: OnceLock::new(),
        })
    }

    /// Keeps the weight in the layout its batches run on (where its format widens), so that
    /// no product widens it again: training's forward runs batches of hundreds of rows, the
    /// LM head's in chunks of 32, each of which widened all of a Q6_K head. The products are
    /// the same bits. Its bytes count in [`Linear::training_copy_bytes`].
    pub(crate) fn keep_widened(&self) {
        self.widened.get_or_init(|| match &self.weight {
            Weight::Kernel { format, data } => {
                kernels::widened(*format, Isa::detect(), data, self.in_dim)
            }
            Weight::Candle(_) => None,
        });
    }

    /// Makes the weight [`Linear::backward_input`] reads now rather than on the first backward.
    pub(crate) fn keep_input_grad(&self) -> Result<(), ModelError> {
        self.input_grad_weight().map(|_| ())
    }

    /// The prepared weight with its widened copy where one is kept.
    fn prepared<'a>(&'a self, data: &'a [u8]) -> kernels::Prepared<'a> {
        (data, self.widened.get().and_then(Option::as_deref))
    }

    /// This linear with its activations quantized pair-bound where its weight is Q8_0 (see
    /// `kernels::WeightFormat::Q8_0PairBound`): AVX2 batches then multiply the stored bytes
    /// directly (the 32-client AVX2 LM head ~10% faster). For the LM head: its rms-normed input
    /// has a few large values per block, so the bound costs little (the logits' rms error
    /// against f32 activations 0.046 instead of 0.040 on the default model); the layers' Q8_0
    /// inputs keep every bit (bounding them too moved the golden logits' mean difference from
    /// 0.24 to 0.30).
    pub(crate) fn with_pair_bound_activations(mut self) -> Self {
        if let Weight::Kernel { format, .. } = &mut self.weight {
            if *format == WeightFormat::Q8_0 {
                *format = WeightFormat::Q8_0PairBound;
            }
        }
        self
    }

    pub(crate) fn out_dim(&self) -> usize {
        self.out_dim
    }

    pub(crate) fn in_dim(&self) -> usize {
        self.in_dim
    }

    /// `dx = dy · W` for rows of `dy` (`[rows, out]`); W stays frozen.
    pub(crate) fn backward_input(&self, dy: &[f32]) -> Result<Vec<f32>, ModelError> {
        let rows = dy.len() / self.out_dim;
        match self.input_grad_weight()? {
            InputGradWeight::TransposedQ8_0(spans) => {
                // f32 block scales hold a row of small gradients (a loss averaged over many
                // tokens, near-uniform logits: 1e-9 and less) at full precision.
                let mut blocks = GradBlocks::default();
                blocks
                    .rows_mut(rows, self.out_dim)
                    .into_par_iter()
                    .zip(dy.par_chunks_exact(self.out_dim))
                    .for_each(|(mut out, row)| {
                        for (k0, run) in (0..)
                            .step_by(INPUT_GRAD_SPAN)
                            .zip(row.chunks(INPUT_GRAD_SPAN))
                        {
                            out.write(k0, run);
                        }
                    });
                Ok(self.span_products(spans, &blocks, false))
            }
            InputGradWeight::Dense(w) => {
                let dy = Tensor::from_slice(dy, (rows, self.out_dim), &Device::Cpu)?;
                Ok(dy.matmul(w)?.flatten_all()?.to_vec1::<f32>()?)
            }
        }
    }

    /// Whether the input gradient multiplies Q8_0 blocks ([`Linear::backward_input_non_negative`]):
    /// a weight on our kernels with whole blocks of output rows.
    pub(crate) fn has_quantized_input_grad(&self) -> bool {
        matches!(self.weight, Weight::Kernel { .. }) && self.out_dim.is_multiple_of(32)
    }

    /// [`Linear::backward_input`] of a gradient with no negative value (the LM head's softmax
    /// numerators) that its caller quantized (`dy`, `out_dim` values a row); only where
    /// [`Linear::has_quantized_input_grad`]. Such a gradient takes a kernel with fewer
    /// multiplies on AVX2 (`kernels::matmul_q8_0_blocks`), the same bits.
    pub(crate) fn backward_input_non_negative(
        &self,
        dy: &GradBlocks,
    ) -> Result<Vec<f32>, ModelError> {
        match self.input_grad_weight()? {
            InputGradWeight::TransposedQ8_0(spans) if dy.out_dim == self.out_dim => {
                Ok(self.span_products(spans, dy, true))
            }
            _ => Err(ModelError::Packing(
                "a quantized gradient for a weight without a quantized input gradient".into(),
            )),
        }
    }

    /// `dy · W` over the transposed spans, the spans' products summed in span order (`dy`
    /// with no negative value where `non_negative`).
    fn span_products(&self, spans: &[Vec<u8>], dy: &GradBlocks, non_negative: bool) -> Vec<f32> {
        // Many spans (the LM head's 128) in parallel, each product on its task's thread: one
        // parallel region per call, where a region per span cost more than a span of 2,048
        // rows computes. Few spans, each product on the pool.
        let isa = Isa::detect();
        let span_product = |i: usize, threads: Threads| {
            let k0 = i * INPUT_GRAD_SPAN;
            let dims = ((k0 + INPUT_GRAD_SPAN).min(self.out_dim) - k0, self.in_dim);
            kernels::matmul_q8_0_blocks(isa, &spans[i], dims, dy.span(i), threads, non_negative)
        };
        let parts: Vec<Vec<f32>> = if spans.len() >= 4 * rayon::current_num_threads() {
            (0..spans.len())
                .into_par_iter()
                .map(|i| span_product(i, Threads::Caller))
                .collect()
        } else {
            (0..spans.len())
                .map(|i| span_product(i, Threads::Pool))
                .collect()
        };
        crate::ops::sum_in_order(parts)
    }

    fn input_grad_weight(&self) -> Result<&InputGradWeight, ModelError> {
        if let Some(w) = self.input_grad.get() {
            return Ok(w);
        }
        let w = match &self.weight {
            Weight::Kernel { format, data } if self.has_quantized_input_grad() => {
                let spans = (0..self.out_dim)
                    .step_by(INPUT_GRAD_SPAN)
                    .map(|k0| {
                        let span = k0..(k0 + INPUT_GRAD_SPAN).min(self.out_dim);
                        kernels::transposed_q8_0(*format, data, (self.in_dim, self.out_dim), span)
                    })
                    .collect::<Result<_, _>>()?;
                InputGradWeight::TransposedQ8_0(spans)
            }
            Weight::Kernel { .. } => {
                let all: Vec<usize> = (0..self.out_dim).collect();
                let w = self.rows(&all)?;
                InputGradWeight::Dense(Tensor::from_vec(
                    w,
                    (self.out_dim, self.in_dim),
                    &Device::Cpu,
                )?)
            }
            Weight::Candle(QMatMul::QTensor(q)) => {
                InputGradWeight::Dense(q.dequantize(&Device::Cpu)?)
            }
            Weight::Candle(QMatMul::Tensor(t)) => InputGradWeight::Dense(t.clone()),
            Weight::Candle(QMatMul::TensorF16(t)) => {
                InputGradWeight::Dense(t.to_dtype(candle_core::DType::F32)?)
            }
        };
        // Two threads racing here build the same weight; either copy is kept.
        Ok(self.input_grad.get_or_init(|| w))
    }

    /// Rows of the weight in f32 (an embedding lookup when the LM head is tied to it), the
    /// values candle's dequantization gives.
    pub(crate) fn rows(&self, rows: &[usize]) -> Result<Vec<f32>, ModelError> {
        match &self.weight {
            Weight::Kernel { format, data } => Ok(kernels::dequantize_rows(
                *format,
                data,
                (self.in_dim, self.out_dim),
                rows,
            )?),
            Weight::Candle(inner) => {
                let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                let ids = Tensor::from_vec(ids, rows.len(), &Device::Cpu)?;
                let table = match inner {
                    QMatMul::QTensor(q) => {
                        return Ok(q.embedding(&ids)?.flatten_all()?.to_vec1()?)
                    }
                    QMatMul::Tensor(t) => t.clone(),
                    QMatMul::TensorF16(t) => t.to_dtype(candle_core::DType::F32)?,
                };
                Ok(table.embedding(&ids)?.flatten_all()?.to_vec1()?)
            }
        }
    }

    /// On our kernels (not candle's products).
    pub(crate) fn on_kernels(&self) -> bool {
        matches!(self.weight, Weight::Kernel { .. })
    }

    /// Bytes of the weight as the forward reads it (one decode step reads them all).
    pub(crate) fn weight_bytes(&self) -> usize {
        match &self.weight {
            Weight::Kernel { data, .. } => data.len(),
            Weight::Candle(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        }
    }

    /// Bytes of the weight kept for training: its input gradient's copy (0 until the first
    /// backward) and its widened copy ([`Linear::keep_widened`]).
    pub(crate) fn training_copy_bytes(&self) -> usize {
        let widened = self
            .widened
            .get()
            .and_then(Option::as_ref)
            .map_or(0, Vec::len);
        widened
            + match self.input_grad.get() {
                None => 0,
                Some(InputGradWeight::TransposedQ8_0(spans)) => spans.iter().map(Vec::len).sum(),
                Some(InputGradWeight::Dense(_)) => self.in_dim * self.out_dim * 4,
            }
    }

    /// [`Linear::forward`] in consecutive parts of `counts[i]` rows (summing to the rows of
    /// `x`), each written in place by the kernels (no copy out of one product).
    pub(crate) fn forward_split(
        &self,
        x: &[f32],
        counts: &[usize],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        match &self.weight {
            Weight::Kernel { format, data } => Ok(kernels::matmul_split(
                *format,
                Isa::detect(),
                self.prepared(data),
                (self.in_dim, self.out_dim),
                x,
                counts,
                Threads::Pool,
            )),
            Weight::Candle(_) => {
                let y = self.forward(x)?;
                let mut at = 0;
                Ok(counts
                    .iter()
                    .map(|&n| {
                        at += n * self.out_dim;
                        y[at - n * self.out_dim..at].to_vec()
                    })
                    .collect())
            }
        }
    }

    /// [`Linear::forward`] into `out` (the product's rows, row-major): a caller that keeps one
    /// buffer for many products (see `kernels::matmul_into`).
    pub(crate) fn forward_into(&self, x: &[f32], out: &mut [f32]) -> Result<(), ModelError> {
        match &self.weight {
            Weight::Kernel { format, data } => {
                let dims = (self.in_dim, self.out_dim);
                kernels::matmul_into(*format, Isa::detect(), self.prepared(data), dims, x, out);
            }
            Weight::Candle(_) => out.copy_from_slice(&self.forward(x)?),
        }
        Ok(())
    }

    /// `x` holds `x.len() / in_dim` rows; returns the rows of the product, row-major. A row's
    /// result depends on that row alone.
    pub(crate) fn forward(&self, x: &[f32]) -> Result<Vec<f32>, ModelError> {
        match &self.weight {
            Weight::Kernel { format, data } => {
                let (w, dims) = (self.prepared(data), (self.in_dim, self.out_dim));
                Ok(kernels::matmul_on(
                    *format,
                    Isa::detect(),
                    w,
                    dims,
                    x,
                    Threads::Pool,
                ))
            }
            Weight::Candle(inner) => {
                let rows = x.len() / self.in_dim;
                let xt = Tensor::from_slice(x, (rows, self.in_dim), &Device::Cpu)?;
                Ok(inner.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GGUF types our kernels cover.
    const KERNEL_DTYPES: [GgmlDType; 6] = [
        GgmlDType::Q8_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4_0,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    /// `w` quantized to `dtype` by candle, and a linear over those GGUF bytes.
    fn quantized_linear(w: &Tensor, dtype: GgmlDType) -> (QTensor, Linear) {
        let (out_dim, in_dim) = w.dims2().expect("matrix");
        let q = QTensor::quantize(w, dtype).expect("quantize");
        let linear = Linear::new(GgufWeight {
            dtype,
            out_dim,
            in_dim,
            bytes: q.data().expect("bytes").into_owned(),
        })
        .expect("linear");
        (q, linear)
    }

    /// Per row of `width`, `got` against `want`: asserts a cosine above 0.9999 and a relative
    /// error below 1%.
    fn assert_rows_follow(dtype: GgmlDType, got: &[f32], want: &[f32], width: usize) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.chunks(width).zip(want.chunks(width)) {
            let dot: f64 = g.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum();
            let norm = |v: &[f32]| v.iter().map(|&a| a as f64 * a as f64).sum::<f64>().sqrt();
            let err: f64 = g
                .iter()
                .zip(w)
                .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            let (cos, rel) = (dot / (norm(g) * norm(w)), err / norm(w));
            eprintln!("{dtype:?}: cosine {cos:.6}, relative error {rel:.2e}");
            assert!(
                cos > 0.9999 && rel < 1e-2,
                "{dtype:?}: cosine {cos}, relative error {rel}"
            );
        }
    }

    /// Our kernels' `x · Wᵀ` against candle's dequantize-then-matmul in f32, for each format
    /// they cover: only the activations' 8-bit rounding parts them.
    #[test]
    fn forward_follows_candles_dequantized_product() {
        let (out_dim, in_dim, rows) = (80, 512, 3);
        // Hashed values in [-1, 1), not periodic: products that do not cancel out.
        let hashed = |n: usize, seed: u64| -> Vec<f32> {
            (0..n as u64)
                .map(|i| {
                    let h = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                    h as f32 / (1 << 23) as f32 - 1.0
                })
                .collect()
        };
        let values: Vec<f32> = hashed(out_dim * in_dim, 1)
            .iter()
            .map(|v| v / 20.0)
            .collect();
        let w = Tensor::from_vec(values, (out_dim, in_dim), &Device::Cpu).expect("tensor");
        let x = hashed(rows * in_dim, 2);
        for dtype in KERNEL_DTYPES {
            let (q, linear) = quantized_linear(&w, dtype);
            assert!(matches!(linear.weight, Weight::Kernel { .. }), "{dtype:?}");
            let want = Tensor::from_slice(&x, (rows, in_dim), &Device::Cpu)
                .and_then(|x| x.matmul(&q.dequantize(&Device::Cpu)?.t()?))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .expect("f32 product");
            let got = linear.forward(&x).expect("forward");
            assert_rows_follow(dtype, &got, &want, out_dim);
        }
    }

    /// The int8 input gradient against `dy · W` in f32 over the same (dequantized) weight, for
    /// each format our kernels cover: only the two 8-bit roundings (W down its columns, dy per
    /// block) part them, a fraction of a percent.
    #[test]
    fn quantized_input_gradient_follows_the_f32_product() {
        // 4,160 rows of W: two whole spans and a partial one.
        let (out_dim, in_dim, rows) = (2 * INPUT_GRAD_SPAN + 64, 256, 5);
        let values: Vec<f32> = (0..out_dim * in_dim)
            .map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 5000.0)
            .collect();
        let w = Tensor::from_vec(values, (out_dim, in_dim), &Device::Cpu).expect("tensor");
        let dy: Vec<f32> = (0..rows * out_dim)
            .map(|i| ((i * 104_729 % 997) as f32 - 498.0) / 300.0)
            .collect();
        for dtype in KERNEL_DTYPES {
            let (_, linear) = quantized_linear(&w, dtype);
            let dense = Tensor::from_vec(
                linear
                    .rows(&(0..out_dim).collect::<Vec<_>>())
                    .expect("rows"),
                (out_dim, in_dim),
                &Device::Cpu,
            )
            .expect("dense");
            let want = Tensor::from_slice(&dy, (rows, out_dim), &Device::Cpu)
                .and_then(|dy| dy.matmul(&dense))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .expect("f32 product");
            let got = linear.backward_input(&dy).expect("backward");
            assert!(matches!(
                linear.input_grad.get(),
                Some(InputGradWeight::TransposedQ8_0(_))
            ));
            assert_rows_follow(dtype, &got, &want, in_dim);

            // Gradients far below f16's range (a loss averaged over many tokens of a
            // near-uniform model reaches 1e-11): the same product, to the bit, scaled by the
            // same power of two, where f16 block scales would have flushed them to zero.
            for tiny in [2f32.powi(-40), 2f32.powi(-90)] {
                let small: Vec<f32> = dy.iter().map(|v| v * tiny).collect();
                let got_small = linear.backward_input(&small).expect("backward");
                let want_small: Vec<f32> = got.iter().map(|v| v * tiny).collect();
                assert_eq!(got_small, want_small, "{dtype:?} at {tiny:e}");
            }
            // And a row of zeros stays zeros (no scale to take from it).
            let mut zero_row = dy.clone();
            zero_row[..out_dim].fill(0.0);
            let got_zero = linear.backward_input(&zero_row).expect("backward");
            assert!(got_zero[..in_dim].iter().all(|&v| v == 0.0));
            assert_eq!(got_zero[in_dim..], got[in_dim..]);

            // A gradient with no negative value quantized by its caller (as the LM head's
            // softmax does, a chunk of 1,024 values at a time) gives the bits of
            // `backward_input`'s kernel.
            let positive: Vec<f32> = dy.iter().map(|v| v.abs()).collect();
            let mut blocks = GradBlocks::default();
            for (mut out, row) in blocks
                .rows_mut(rows, out_dim)
                .into_iter()
                .zip(positive.chunks(out_dim))
            {
                for (i, chunk) in row.chunks(1024).enumerate() {
                    out.write(i * 1024, chunk);
                }
            }
            let got_blocks = linear
                .backward_input_non_negative(&blocks)
                .expect("backward");
            let want_blocks = linear.backward_input(&positive).expect("backward");
            assert_eq!(got_blocks, want_blocks, "{dtype:?}");
        }
    }

    /// `dx = dy · W` as a step's backward runs it (the gradient quantized, then the transposed
    /// spans' products) at Qwen3-0.6B's Q4_K layer shapes, beside the forward of the same rows,
    /// the best of many calls: `cargo test --release -p temper-model --lib -- --ignored
    /// --nocapture input_grad_throughput` (`INPUT_GRAD_ROWS`, default 480: a 16x30 step). The
    /// second figure is the throughput the threads' CPU time gives, as if each had a core.
    #[test]
    #[ignore]
    fn input_grad_throughput() {
        use crate::kernels::test_util::{cpu_seconds, Rng};
        let rows: usize =
            std::env::var("INPUT_GRAD_ROWS").map_or(480, |v| v.parse().expect("rows"));
        let mut rng = Rng::new(5);
        for (out_dim, in_dim) in [(2048, 1024), (1024, 2048), (3072, 1024), (1024, 3072)] {
            let values: Vec<f32> = (0..out_dim * in_dim)
                .map(|_| rng.uniform() * 0.05)
                .collect();
            let w = Tensor::from_vec(values, (out_dim, in_dim), &Device::Cpu).expect("weight");
            let (_, linear) = quantized_linear(&w, GgmlDType::Q4K);
            let dy: Vec<f32> = (0..rows * out_dim).map(|_| rng.uniform()).collect();
            let x: Vec<f32> = (0..rows * in_dim).map(|_| rng.uniform()).collect();
            let time = |f: &dyn Fn()| {
                let (mut best, mut best_cpu) = (f64::INFINITY, f64::INFINITY);
                for _ in 0..10 {
                    let (t, cpu) = (std::time::Instant::now(), cpu_seconds());
                    f();
                    best = best.min(t.elapsed().as_secs_f64());
                    best_cpu = best_cpu.min(cpu_seconds() - cpu);
                }
                let macs = (rows * in_dim * out_dim) as f64;
                let threads = rayon::current_num_threads() as f64;
                let gmacs = (macs / best / 1e9, macs / best_cpu / 1e9 * threads);
                format!(
                    "{:.2} ms, {:.1} GMAC/s (from CPU time, {:.1})",
                    best * 1e3,
                    gmacs.0,
                    gmacs.1
                )
            };
            let grad = time(&|| {
                std::hint::black_box(linear.backward_input(&dy).expect("backward"));
            });
            let forward = time(&|| {
                std::hint::black_box(linear.forward(&x).expect("forward"));
            });
            println!(
                "Q4_K {rows} x [{out_dim}, {in_dim}]: input gradient {grad}; forward {forward}"
            );
        }
    }
}
