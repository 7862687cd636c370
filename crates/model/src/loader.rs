use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, SeekFrom};
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::Device;

use crate::linear::{GgufWeight, Linear};
use crate::lora::LoraTarget;
use crate::model::{Attention, Decoder, Embedding, Layer, Mlp, RmsNorm};
use crate::{LoadedModel, ModelConfig, ModelError};

/// Loads a GGUF of one of the supported architectures ([`crate::Arch`]), configured from its
/// metadata (quantized weights stay quantized; norms and biases become f32).
pub fn load_gguf(path: &Path) -> Result<LoadedModel, ModelError> {
    let io_err = |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut reader = BufReader::new(File::open(path).map_err(io_err)?);
    let content = read_content(&mut reader)?;
    let mut weights = Weights {
        content: &content,
        reader: &mut reader,
        used: HashSet::new(),
    };

    let (vocab_size, hidden) = weights.info("token_embd.weight")?.shape.dims2()?;
    let mut cfg = ModelConfig::from_metadata(&content.metadata, vocab_size)?;
    if hidden != cfg.hidden_size {
        return Err(shape_err(
            "token_embd.weight",
            &[vocab_size, cfg.hidden_size],
            &[vocab_size, hidden],
        ));
    }
    let (hd, q_dim, kv_dim, ffn) = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    );

    // Grown as the layers load, not sized by the block count: a corrupt count must end at the
    // first missing tensor, not ask for an allocation of its size.
    let mut layers = Vec::new();
    for i in 0..cfg.num_layers {
        let p = format!("blk.{i}");
        let (bias, qk_norm, post, head) = (cfg.qkv_bias, cfg.qk_norm, cfg.post_norms, cfg.head_dim);
        layers.push(Layer {
            attn: Attention {
                norm: RmsNorm(weights.vector(&format!("{p}.attn_norm.weight"), hd)?),
                q: weights.linear(&format!("{p}.attn_q.weight"), q_dim, hd)?,
                k: weights.linear(&format!("{p}.attn_k.weight"), kv_dim, hd)?,
                v: weights.linear(&format!("{p}.attn_v.weight"), kv_dim, hd)?,
                q_bias: weights.vector_if(bias, &format!("{p}.attn_q.bias"), q_dim)?,
                k_bias: weights.vector_if(bias, &format!("{p}.attn_k.bias"), kv_dim)?,
                v_bias: weights.vector_if(bias, &format!("{p}.attn_v.bias"), kv_dim)?,
                q_norm: weights.norm_if(qk_norm, &format!("{p}.attn_q_norm.weight"), head)?,
                k_norm: weights.norm_if(qk_norm, &format!("{p}.attn_k_norm.weight"), head)?,
                o: weights.linear(&format!("{p}.attn_output.weight"), hd, q_dim)?,
                post_norm: weights.norm_if(post, &format!("{p}.post_attention_norm.weight"), hd)?,
            },
            mlp: Mlp {
                norm: RmsNorm(weights.vector(&format!("{p}.ffn_norm.weight"), hd)?),
                gate: weights.linear(&format!("{p}.ffn_gate.weight"), ffn, hd)?,
                up: weights.linear(&format!("{p}.ffn_up.weight"), ffn, hd)?,
                down: weights.linear(&format!("{p}.ffn_down.weight"), hd, ffn)?,
                activation: cfg.activation,
                post_norm: weights.norm_if(post, &format!("{p}.post_ffw_norm.weight"), hd)?,
            },
        });
    }
    let final_norm = RmsNorm(weights.vector("output_norm.weight", hd)?);
    // Llama 3's frequency smoothing: one divisor per rotated pair, shared by every layer.
    let has_factors = content.tensor_infos.contains_key("rope_freqs.weight");
    cfg.rope_freq_factors =
        weights.vector_if(has_factors, "rope_freqs.weight", cfg.head_dim / 2)?;
    // Tied to the embedding when the file has no `output.weight` (Gemma, small Llamas and Qwens).
    cfg.tied_embeddings = !content.tensor_infos.contains_key("output.weight");
    let (lm_head, embed) = if !cfg.tied_embeddings {
        (
            weights.linear("output.weight", vocab_size, hd)?,
            Embedding::Table(weights.qtensor("token_embd.weight")?),
        )
    } else {
        (
            weights.linear("token_embd.weight", vocab_size, hd)?,
            Embedding::Tied,
        )
    };
    // A tensor this layout does not read would change the model's numbers if it were skipped.
    if let Some(name) = content
        .tensor_infos
        .keys()
        .find(|n| !weights.used.contains(n.as_str()))
    {
        return Err(ModelError::UnexpectedTensor {
            name: name.clone(),
            arch: cfg.arch.name(),
        });
    }
    let lm_head = lm_head.with_pair_bound_activations();
    let on_kernels = lm_head.on_kernels()
        && layers
            .iter()
            .all(|l| LoraTarget::ALL.iter().all(|&t| l.linear(t).on_kernels()));

    let model = Decoder {
        cfg,
        embed,
        lm_head,
        layers,
        final_norm,
        smooth: false,
        on_kernels,
    };
    Ok(LoadedModel {
        model,
        metadata: content.metadata,
    })
}

/// candle's header reader panics on some corrupt files (a `general.alignment` of 0 divides by
/// zero): that is a bad file like any other, not a crash of the server starting on it.
pub(crate) fn read_content(reader: &mut BufReader<File>) -> Result<gguf_file::Content, ModelError> {
    std::panic::catch_unwind(AssertUnwindSafe(|| gguf_file::Content::read(reader)))
        .unwrap_or_else(|payload| {
            let reason = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(candle_core::Error::Msg(format!(
                "the GGUF header is corrupt ({reason})"
            )))
        })
        .map_err(ModelError::from)
}

struct Weights<'a, R> {
    content: &'a gguf_file::Content,
    reader: &'a mut R,
    /// The tensors read so far.
    used: HashSet<&'a str>,
}

impl<'a, R: std::io::Read + std::io::Seek> Weights<'a, R> {
    fn info(&self, name: &str) -> Result<&'a gguf_file::TensorInfo, ModelError> {
        self.content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    /// The tensor `name`, marked read.
    fn take(&mut self, name: &str) -> Result<&'a gguf_file::TensorInfo, ModelError> {
        let content = self.content;
        let (key, info) = content
            .tensor_infos
            .get_key_value(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        self.used.insert(key.as_str());
        Ok(info)
    }

    fn qtensor(&mut self, name: &str) -> Result<Arc<QTensor>, ModelError> {
        self.take(name)?;
        Ok(Arc::new(self.content.tensor(
            self.reader,
            name,
            &Device::Cpu,
        )?))
    }

    /// A matrix's bytes as stored, read straight into the buffer the kernels' layout is made
    /// in (candle's reader holds a second copy while it builds its tensor).
    fn linear(&mut self, name: &str, out_dim: usize, in_dim: usize) -> Result<Linear, ModelError> {
        let info = self.take(name)?;
        check_shape(name, info.shape.dims(), &[out_dim, in_dim])?;
        let dtype = info.ggml_dtype;
        let elems = out_dim * in_dim;
        if !elems.is_multiple_of(dtype.block_size()) {
            return Err(candle_core::Error::Msg(format!(
                "{name}: {elems} values are not whole {dtype:?} blocks"
            ))
            .into());
        }
        let len = elems / dtype.block_size() * dtype.type_size();
        let start = self.content.tensor_data_offset.saturating_add(info.offset);
        let file_len = self
            .reader
            .seek(SeekFrom::End(0))
            .map_err(candle_core::Error::from)?;
        if start.saturating_add(len as u64) > file_len {
            return Err(candle_core::Error::Msg(format!(
                "{name}: {len} bytes at offset {start} run past the end of the file ({file_len})"
            ))
            .into());
        }
        self.reader
            .seek(SeekFrom::Start(start))
            .map_err(candle_core::Error::from)?;
        let mut bytes = vec![0u8; len];
        self.reader
            .read_exact(&mut bytes)
            .map_err(candle_core::Error::from)?;
        Linear::new(GgufWeight {
            dtype,
            out_dim,
            in_dim,
            bytes,
        })
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.qtensor(name)?;
        check_shape(name, t.shape().dims(), &[len])?;
        Ok(t.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
    }

    /// A vector the layout has only when `present`.
    fn vector_if(
        &mut self,
        present: bool,
        name: &str,
        len: usize,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        present.then(|| self.vector(name, len)).transpose()
    }

    /// An RMSNorm the layout has only when `present`.
    fn norm_if(
        &mut self,
        present: bool,
        name: &str,
        len: usize,
    ) -> Result<Option<RmsNorm>, ModelError> {
        Ok(self.vector_if(present, name, len)?.map(RmsNorm))
    }
}

fn check_shape(name: &str, got: &[usize], expected: &[usize]) -> Result<(), ModelError> {
    if got == expected {
        Ok(())
    } else {
        Err(shape_err(name, expected, got))
    }
}

fn shape_err(name: &str, expected: &[usize], got: &[usize]) -> ModelError {
    ModelError::TensorShape {
        name: name.to_string(),
        expected: expected.to_vec(),
        got: got.to_vec(),
    }
}
