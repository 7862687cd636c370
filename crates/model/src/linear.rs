use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use crate::ModelError;

/// `y = x · Wᵀ` over a quantized weight `[out, in]`. The one place matmuls happen, so the kernel
/// behind it can be replaced without touching the model.
#[derive(Debug)]
pub(crate) struct Linear {
    inner: QMatMul,
    in_dim: usize,
    out_dim: usize,
}

impl Linear {
    pub(crate) fn new(weight: Arc<QTensor>) -> Result<Self, ModelError> {
        let (out_dim, in_dim) = weight.shape().dims2()?;
        Ok(Self {
            inner: QMatMul::from_arc(weight)?,
            in_dim,
            out_dim,
        })
    }

    pub(crate) fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// `x` holds `x.len() / in_dim` rows; returns the rows of the product, row-major.
    pub(crate) fn forward(&self, x: &[f32]) -> Result<Vec<f32>, ModelError> {
        let rows = x.len() / self.in_dim;
        let xt = Tensor::from_slice(x, (rows, self.in_dim), &Device::Cpu)?;
        let y = self.inner.forward(&xt)?;
        Ok(y.flatten_all()?.to_vec1::<f32>()?)
    }
}
