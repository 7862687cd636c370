//! temper's LoRA adapters in the files other tools load, and back:
//!
//! - PEFT ([`LoraAdapter::to_peft`], [`LoraAdapter::from_peft`]): `adapter_model.safetensors`
//!   with transformers' module names (`base_model.model.model.layers.{i}.self_attn.q_proj.
//!   lora_A.weight`, `lora_A` `[r, in]`, `lora_B` `[out, r]`, scale `lora_alpha / r`) and
//!   `adapter_config.json`;
//! - a llama.cpp LoRA adapter GGUF ([`LoraAdapter::to_gguf`]): `general.type = adapter`,
//!   `adapter.type = lora`, `adapter.lora.alpha`, tensors `blk.{i}.attn_q.weight.lora_a`
//!   (ggml `ne = [in, r]`) and `.lora_b` (`ne = [r, out]`), F32, as `convert_lora_to_gguf.py`
//!   writes them (llama.cpp scales by `alpha / r`, `r` being `lora_b`'s `ne[0]`);
//! - the base GGUF with the adapter merged into its weights ([`merge_into_gguf`]).
//!
//! temper's adapter lives in the GGUF's row order. llama.cpp's converter permutes the rows of
//! Llama's (and SmolLM3's) q and k projections for ggml's interleaved RoPE
//! ([`RopeLayout::Interleaved`]), so the PEFT files of those models carry `lora_B` of q and k
//! with the rows put back in transformers' order; the GGUF adapter and the merge need nothing.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, BufWriter, Cursor};
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use safetensors::{Dtype, SafeTensors};
use serde_json::json;

use crate::lora::{LoraPair, LoraTarget};
use crate::{LoraAdapter, LoraConfig, ModelConfig, ModelError, RopeLayout};

/// The PEFT adapter's weights file.
pub const PEFT_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The PEFT adapter's configuration file.
pub const PEFT_CONFIG_FILE: &str = "adapter_config.json";
/// The highest rank an imported adapter may have.
pub const MAX_IMPORT_RANK: usize = 256;

const PEFT_PREFIX: &str = "base_model.model.model.layers.";
/// PEFT's module name of the LM head (`target_modules`, tensor names).
const PEFT_HEAD_MODULE: &str = "lm_head";

/// The files of an exported adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterFormat {
    /// `adapter_model.safetensors` and `adapter_config.json`, for `PeftModel.from_pretrained`
    /// (and vLLM, and llama.cpp's `convert_lora_to_gguf.py`).
    Peft,
    /// One llama.cpp LoRA adapter file, for `llama-server --lora`.
    Gguf,
}

impl std::str::FromStr for AdapterFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "peft" => Ok(AdapterFormat::Peft),
            "gguf" => Ok(AdapterFormat::Gguf),
            _ => Err(format!(
                "unknown adapter format {s:?} (expected peft or gguf)"
            )),
        }
    }
}

/// An adapter exported in one of the [`AdapterFormat`]s.
#[derive(Debug, Clone)]
pub enum ExportedAdapter {
    Peft(PeftFiles),
    /// The llama.cpp LoRA adapter file's bytes.
    Gguf(Vec<u8>),
}

/// A PEFT adapter's two files, as bytes.
#[derive(Debug, Clone)]
pub struct PeftFiles {
    /// `adapter_model.safetensors`.
    pub weights: Vec<u8>,
    /// `adapter_config.json`.
    pub config: Vec<u8>,
}

/// Why an imported adapter is refused. `subject` names what is wrong: a tensor of the
/// safetensors file, a field of `adapter_config.json`, or one of the two files.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{subject}: {reason}")]
pub struct AdapterFileError {
    pub subject: String,
    pub reason: String,
}

fn file_err(subject: impl Into<String>, reason: impl Into<String>) -> AdapterFileError {
    AdapterFileError {
        subject: subject.into(),
        reason: reason.into(),
    }
}

impl LoraTarget {
    /// The projection's module in a transformers decoder layer (`self_attn.q_proj`, ...): what
    /// PEFT's tensor names and `target_modules` name.
    pub fn hf_module(self) -> &'static str {
        match self {
            LoraTarget::Q => "self_attn.q_proj",
            LoraTarget::K => "self_attn.k_proj",
            LoraTarget::V => "self_attn.v_proj",
            LoraTarget::O => "self_attn.o_proj",
            LoraTarget::Gate => "mlp.gate_proj",
            LoraTarget::Up => "mlp.up_proj",
            LoraTarget::Down => "mlp.down_proj",
        }
    }

    /// `q_proj`, ...: PEFT's `target_modules` entry.
    fn hf_short_name(self) -> &'static str {
        let module = self.hf_module();
        &module[module.find('.').map_or(0, |i| i + 1)..]
    }
}

fn peft_name(layer: usize, target: LoraTarget, matrix: char) -> String {
    format!(
        "{PEFT_PREFIX}{layer}.{}.lora_{matrix}.weight",
        target.hf_module()
    )
}

fn peft_head_name(matrix: char) -> String {
    format!("base_model.model.{PEFT_HEAD_MODULE}.lora_{matrix}.weight")
}

/// `'A' | 'B'` of a PEFT tensor name of the LM head's pair.
fn parse_peft_head_name(name: &str) -> Option<char> {
    ['A', 'B'].into_iter().find(|&m| name == peft_head_name(m))
}

/// `(layer, target, 'A' | 'B')` of a PEFT tensor name.
fn parse_peft_name(name: &str) -> Option<(usize, LoraTarget, char)> {
    let rest = name.strip_prefix(PEFT_PREFIX)?;
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok().filter(|_| !layer.starts_with('+'))?;
    let (module, matrix) = rest.strip_suffix(".weight")?.rsplit_once(".lora_")?;
    let matrix = match matrix {
        "A" => 'A',
        "B" => 'B',
        _ => return None,
    };
    let target = LoraTarget::ALL
        .into_iter()
        .find(|t| t.hf_module() == module)?;
    Some((layer, target, matrix))
}

/// Whether the q/k rows of `target` are permuted between transformers and the GGUF.
fn permuted(model: &ModelConfig, target: LoraTarget) -> Option<usize> {
    let interleaved = model.rope_layout == RopeLayout::Interleaved;
    matches!(target, LoraTarget::Q | LoraTarget::K)
        .then_some(model.head_dim)
        .filter(|_| interleaved)
}

/// transformers' row of GGUF row `row`: llama.cpp's converter (`LlamaModel.permute`) moves
/// transformers' row `h·d + s·d/2 + j` of a head `h` (of size `d`) to `h·d + 2j + s`.
fn hf_row(row: usize, head_dim: usize) -> usize {
    let (head, within) = (row / head_dim, row % head_dim);
    head * head_dim + (within % 2) * (head_dim / 2) + within / 2
}

/// `b` (`[out, rank]`, GGUF rows) in transformers' row order, or back (`to_hf` false).
fn reorder_rows(b: &[f32], rank: usize, head_dim: usize, to_hf: bool) -> Vec<f32> {
    let mut out = vec![0f32; b.len()];
    for (row, src) in b.chunks_exact(rank).enumerate() {
        let other = hf_row(row, head_dim);
        if to_hf {
            out[other * rank..(other + 1) * rank].copy_from_slice(src);
        } else {
            out[row * rank..(row + 1) * rank].copy_from_slice(&b[other * rank..(other + 1) * rank]);
        }
    }
    out
}

fn f32_tensor(data: &[f32], rows: usize, cols: usize) -> Result<Tensor, ModelError> {
    Ok(Tensor::from_slice(data, (rows, cols), &Device::Cpu)?)
}

/// The values of a safetensors tensor as f32 (from F32, F16 or BF16, little-endian).
fn tensor_values(
    name: &str,
    view: &safetensors::tensor::TensorView<'_>,
) -> Result<Vec<f32>, AdapterFileError> {
    let data = view.data();
    let values: Vec<f32> = match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(file_err(
                name,
                format!("has dtype {other:?}; expected F32, F16 or BF16"),
            ))
        }
    };
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(file_err(
            name,
            format!("holds a non-finite value ({}) at index {i}", values[i]),
        ));
    }
    Ok(values)
}

/// The LoRA hyper-parameters of `adapter_config.json`: `(rank, alpha)` as temper scales them
/// (`alpha / rank`), after refusing what temper's adapter cannot express.
fn read_peft_config(bytes: &[u8]) -> Result<(usize, f32), AdapterFileError> {
    let config: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| file_err(PEFT_CONFIG_FILE, format!("is not JSON: {e}")))?;
    let config = config
        .as_object()
        .ok_or_else(|| file_err(PEFT_CONFIG_FILE, "must be a JSON object"))?;
    let field = |key: &str| config.get(key).filter(|v| !v.is_null());
    let refuse =
        |key: &str, reason: &str| Err(file_err(format!("{PEFT_CONFIG_FILE}: {key}"), reason));
    if let Some(kind) = field("peft_type") {
        if kind.as_str() != Some("LORA") {
            return refuse("peft_type", "must be \"LORA\"");
        }
    }
    let rank = match field("r").and_then(|r| r.as_u64()) {
        Some(r) if r >= 1 && r as usize <= MAX_IMPORT_RANK => r as usize,
        Some(r) => {
            return refuse(
                "r",
                &format!("{r} is not a rank from 1 to {MAX_IMPORT_RANK}"),
            )
        }
        None => return refuse("r", "must be a positive integer"),
    };
    // PEFT's default alpha is 8.
    let alpha = match field("lora_alpha") {
        None => 8.0,
        Some(a) => match a.as_f64() {
            Some(a) if a.is_finite() && a > 0.0 && a < f32::MAX as f64 => a as f32,
            _ => return refuse("lora_alpha", "must be a positive number"),
        },
    };
    // rsLoRA scales by alpha / sqrt(r): the same scale as alpha·sqrt(r) / r.
    let alpha = if field("use_rslora").and_then(|v| v.as_bool()) == Some(true) {
        alpha * (rank as f32).sqrt()
    } else {
        alpha
    };
    if field("use_dora").and_then(|v| v.as_bool()) == Some(true) {
        return refuse("use_dora", "DoRA adapters are not supported");
    }
    if field("fan_in_fan_out").and_then(|v| v.as_bool()) == Some(true) {
        return refuse("fan_in_fan_out", "must be false (no Conv1D layers here)");
    }
    if let Some(bias) = field("bias") {
        if bias.as_str() != Some("none") {
            return refuse(
                "bias",
                "must be \"none\" (temper's adapters have no biases)",
            );
        }
    }
    for key in ["modules_to_save", "rank_pattern", "alpha_pattern"] {
        let empty = match field(key) {
            None => true,
            Some(serde_json::Value::Array(a)) => a.is_empty(),
            Some(serde_json::Value::Object(o)) => o.is_empty(),
            Some(_) => false,
        };
        if !empty {
            return refuse(key, "must be empty: every LoRA pair has the rank `r`");
        }
    }
    if let Some(serde_json::Value::Array(targets)) = field("target_modules") {
        for t in targets {
            let known = t.as_str().is_some_and(|name| {
                name == PEFT_HEAD_MODULE
                    || LoraTarget::ALL
                        .iter()
                        .any(|k| k.hf_short_name() == name || k.hf_module() == name)
            });
            if !known {
                return refuse(
                    "target_modules",
                    &format!(
                        "{t} is not a target temper trains (q_proj, k_proj, v_proj, o_proj, \
                         gate_proj, up_proj, down_proj, lm_head)"
                    ),
                );
            }
        }
    }
    Ok((rank, alpha))
}

impl LoraAdapter {
    /// The adapter in `format` for the base GGUF of `model`, named `base_model` (PEFT's
    /// `base_model_name_or_path`, the GGUF adapter's `general.name`).
    pub fn export(
        &self,
        model: &ModelConfig,
        base_model: &str,
        format: AdapterFormat,
    ) -> Result<ExportedAdapter, ModelError> {
        Ok(match format {
            AdapterFormat::Peft => ExportedAdapter::Peft(self.to_peft(model, base_model)?),
            AdapterFormat::Gguf => ExportedAdapter::Gguf(self.to_gguf(model, base_model)?),
        })
    }

    /// The adapter as PEFT's two files for the transformers model of `model` (the base GGUF),
    /// naming `base_model` as `base_model_name_or_path`.
    pub fn to_peft(&self, model: &ModelConfig, base_model: &str) -> Result<PeftFiles, ModelError> {
        if !self.fits(model) {
            return Err(ModelError::AdapterMismatch { index: 0 });
        }
        let rank = self.config().rank;
        let mut tensors = HashMap::new();
        for layer in 0..model.num_layers {
            for target in LoraTarget::ALL {
                let p = self.pair(layer, target);
                let b = match permuted(model, target) {
                    Some(head_dim) => reorder_rows(&p.b, rank, head_dim, true),
                    None => p.b.clone(),
                };
                tensors.insert(
                    peft_name(layer, target, 'A'),
                    f32_tensor(&p.a, rank, p.in_dim)?,
                );
                tensors.insert(
                    peft_name(layer, target, 'B'),
                    f32_tensor(&b, p.out_dim, rank)?,
                );
            }
        }
        let mut targets: Vec<&str> = LoraTarget::ALL.map(LoraTarget::hf_short_name).to_vec();
        if let Some(p) = self.head() {
            tensors.insert(peft_head_name('A'), f32_tensor(&p.a, rank, p.in_dim)?);
            tensors.insert(peft_head_name('B'), f32_tensor(&p.b, p.out_dim, rank)?);
            targets.push(PEFT_HEAD_MODULE);
        }
        let metadata = Some(HashMap::from([("format".to_owned(), "pt".to_owned())]));
        let weights = safetensors::tensor::serialize(&tensors, metadata)
            .map_err(|e| ModelError::Candle(candle_core::Error::from(e)))?;
        let config = json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": rank,
            "lora_alpha": self.config().alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": false,
            "use_dora": false,
            "inference_mode": true,
            "target_modules": targets,
            "modules_to_save": null,
            "layers_to_transform": null,
            "rank_pattern": {},
            "alpha_pattern": {},
        });
        let config = serde_json::to_vec_pretty(&config).map_err(|e| ModelError::Adapter {
            path: PEFT_CONFIG_FILE.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(PeftFiles { weights, config })
    }

    /// Reads a PEFT LoRA adapter for `model` (the transformers model of the base GGUF),
    /// checking every tensor: a known target (q/k/v/o/gate/up/down of a layer the model has),
    /// its A and B both present, the shape of the model's projection with the config's rank
    /// (at most [`MAX_IMPORT_RANK`]), finite values. Projections the file does not adapt get
    /// the pair of a fresh adapter of `seed` (B = 0: no change, but trainable).
    pub fn from_peft(
        files: &PeftFiles,
        model: &ModelConfig,
        seed: u64,
    ) -> Result<LoraAdapter, AdapterFileError> {
        let (rank, alpha) = read_peft_config(&files.config)?;
        let tensors = SafeTensors::deserialize(&files.weights)
            .map_err(|e| file_err(PEFT_WEIGHTS_FILE, format!("is not a safetensors file: {e}")))?;
        let mut names: Vec<&str> = tensors.names();
        names.sort();
        if names.is_empty() {
            return Err(file_err(PEFT_WEIGHTS_FILE, "holds no tensor"));
        }
        // By layer and target, so that the first incomplete pair is the one named.
        let mut found: BTreeMap<(usize, usize), (LoraTarget, HalfPairs)> = BTreeMap::new();
        let mut head: HalfPairs = [None, None];
        for &name in &names {
            if let Some(matrix) = parse_peft_head_name(name) {
                let (vocab, hidden) = (model.vocab_size, model.hidden_size);
                let expected = if matrix == 'A' {
                    [rank, hidden]
                } else {
                    [vocab, rank]
                };
                let view = tensors
                    .tensor(name)
                    .map_err(|e| file_err(name, e.to_string()))?;
                if view.shape() != expected {
                    return Err(file_err(
                        name,
                        format!(
                            "has shape {:?}; expected {expected:?} (rank r = {rank} of \
                             {PEFT_CONFIG_FILE}, the base model's LM head [{vocab}, {hidden}])",
                            view.shape()
                        ),
                    ));
                }
                head[usize::from(matrix == 'B')] = Some(tensor_values(name, &view)?);
                continue;
            }
            let Some((layer, target, matrix)) = parse_peft_name(name) else {
                return Err(file_err(
                    name,
                    "is not a LoRA tensor of a target temper adapts (expected \
                     base_model.model.model.layers.N.{self_attn.q_proj,self_attn.k_proj,\
                     self_attn.v_proj,self_attn.o_proj,mlp.gate_proj,mlp.up_proj,mlp.down_proj}\
                     .lora_{A,B}.weight, or base_model.model.lm_head.lora_{A,B}.weight)",
                ));
            };
            if layer >= model.num_layers {
                return Err(file_err(
                    name,
                    format!(
                        "is for layer {layer}; the base model has {} layers",
                        model.num_layers
                    ),
                ));
            }
            let view = tensors
                .tensor(name)
                .map_err(|e| file_err(name, e.to_string()))?;
            let (out_dim, in_dim) = target.dims(model);
            let expected = if matrix == 'A' {
                [rank, in_dim]
            } else {
                [out_dim, rank]
            };
            if view.shape() != expected {
                return Err(file_err(
                    name,
                    format!(
                        "has shape {:?}; expected {expected:?} (rank r = {rank} of \
                         {PEFT_CONFIG_FILE}, the base model's projection [{out_dim}, {in_dim}])",
                        view.shape()
                    ),
                ));
            }
            let values = tensor_values(name, &view)?;
            found
                .entry((layer, target.index()))
                .or_insert((target, [None, None]))
                .1[usize::from(matrix == 'B')] = Some(values);
        }
        let config = LoraConfig {
            rank,
            alpha,
            unembed: false,
        };
        let mut adapter = LoraAdapter::new(model, config, seed);
        match head {
            [Some(a), Some(b)] => {
                adapter.set_head(LoraPair::new(a, b, model.hidden_size, model.vocab_size))
            }
            [None, None] => {}
            [a, _] => {
                let missing = if a.is_none() { 'A' } else { 'B' };
                return Err(file_err(
                    peft_head_name(missing),
                    "is missing: each adapted projection needs both lora_A and lora_B",
                ));
            }
        }
        for ((layer, _), (target, pair)) in found {
            let [Some(a), Some(b)] = pair else {
                let missing = if pair[0].is_none() { 'A' } else { 'B' };
                return Err(file_err(
                    peft_name(layer, target, missing),
                    "is missing: each adapted projection needs both lora_A and lora_B",
                ));
            };
            let b = match permuted(model, target) {
                Some(head_dim) => reorder_rows(&b, rank, head_dim, false),
                None => b,
            };
            let (out_dim, in_dim) = target.dims(model);
            adapter.set_pair(layer, target, LoraPair::new(a, b, in_dim, out_dim));
        }
        Ok(adapter)
    }

    /// The adapter as a llama.cpp LoRA adapter GGUF for a base of `model`'s architecture.
    pub fn to_gguf(&self, model: &ModelConfig, name: &str) -> Result<Vec<u8>, ModelError> {
        if !self.fits(model) {
            return Err(ModelError::AdapterMismatch { index: 0 });
        }
        let rank = self.config().rank;
        let mut tensors = Vec::new();
        for layer in 0..model.num_layers {
            for target in LoraTarget::ALL {
                let p = self.pair(layer, target);
                let base = format!("blk.{layer}.{}.weight", target.name());
                let a = QTensor::quantize(&f32_tensor(&p.a, rank, p.in_dim)?, GgmlDType::F32)?;
                let b = QTensor::quantize(&f32_tensor(&p.b, p.out_dim, rank)?, GgmlDType::F32)?;
                tensors.push((format!("{base}.lora_a"), a));
                tensors.push((format!("{base}.lora_b"), b));
            }
        }
        if let Some(p) = self.head() {
            // llama.cpp finds an adapter's tensors by the base's names; a tied LM head has
            // none of its own (it reads `token_embd.weight`).
            if model.tied_embeddings {
                return Err(ModelError::Adapter {
                    path: name.to_owned(),
                    reason: "the adapter adapts the LM head of a model whose LM head is its \
                             embedding table, which a llama.cpp adapter cannot express: export \
                             it as PEFT, or merged into the base GGUF"
                        .to_owned(),
                });
            }
            let a = QTensor::quantize(&f32_tensor(&p.a, rank, p.in_dim)?, GgmlDType::F32)?;
            let b = QTensor::quantize(&f32_tensor(&p.b, p.out_dim, rank)?, GgmlDType::F32)?;
            tensors.push(("output.weight.lora_a".to_owned(), a));
            tensors.push(("output.weight.lora_b".to_owned(), b));
        }
        let metadata = [
            (
                "general.architecture",
                Value::String(model.arch.name().to_owned()),
            ),
            ("general.type", Value::String("adapter".to_owned())),
            ("general.name", Value::String(name.to_owned())),
            ("adapter.type", Value::String("lora".to_owned())),
            ("adapter.lora.alpha", Value::F32(self.config().alpha)),
        ];
        let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut out = Cursor::new(Vec::new());
        gguf_file::write(&mut out, &metadata, &tensors)?;
        Ok(out.into_inner())
    }
}

/// A projection's A and B as read so far.
type HalfPairs = [Option<Vec<f32>>; 2];

/// How [`merge_into_gguf`] stores the projections it changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergedWeights {
    /// Quantized again to each tensor's type in the base (Q8_0, Q4_K, ...).
    AsBase,
    /// F16 (no second quantization: the merge's own rounding only).
    F16,
}

/// Writes `out`: the GGUF `base` with `adapter`'s `scale · B·A` added to each adapted
/// projection (dequantized, added in f32, stored as `weights` says); every other tensor and all
/// metadata as they are. Written beside `out`, then renamed over it.
pub fn merge_into_gguf(
    base: &Path,
    adapter: &LoraAdapter,
    out: &Path,
    weights: MergedWeights,
) -> Result<(), ModelError> {
    let io_err = |path: &Path| {
        let path = path.display().to_string();
        move |source| ModelError::Io { path, source }
    };
    let mut reader = BufReader::new(File::open(base).map_err(io_err(base))?);
    let content = crate::loader::read_content(&mut reader)?;
    let vocab = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".to_owned()))?
        .shape
        .dims2()?
        .0;
    let model = ModelConfig::from_metadata(&content.metadata, vocab)?;
    if !adapter.fits(&model) {
        return Err(ModelError::Adapter {
            path: base.display().to_string(),
            reason: "the adapter was made for a model of another shape".to_owned(),
        });
    }
    let scale = adapter.scale();
    let rank = adapter.config().rank;
    let mut infos: Vec<(&String, &gguf_file::TensorInfo)> = content.tensor_infos.iter().collect();
    // The base's tensor order.
    infos.sort_by_key(|(_, info)| info.offset);
    let merge = |tensor: &QTensor, p: &LoraPair| -> Result<QTensor, ModelError> {
        let delta = f32_tensor(&p.b, p.out_dim, rank)?
            .matmul(&f32_tensor(&p.a, rank, p.in_dim)?)?
            .affine(scale as f64, 0.0)?;
        let merged = (tensor.dequantize(&Device::Cpu)? + delta)?;
        let dtype = match weights {
            MergedWeights::AsBase => tensor.dtype(),
            MergedWeights::F16 => GgmlDType::F16,
        };
        Ok(QTensor::quantize(&merged, dtype)?)
    };
    let tied = !content.tensor_infos.contains_key("output.weight");
    let mut tensors = Vec::with_capacity(infos.len() + 1);
    for (name, info) in infos {
        let tensor = info.read(&mut reader, content.tensor_data_offset, &Device::Cpu)?;
        let adapted = LoraTarget::ALL.into_iter().find_map(|target| {
            let layer = name
                .strip_prefix("blk.")?
                .strip_suffix(&format!(".{}.weight", target.name()))?
                .parse::<usize>()
                .ok()?;
            (layer < model.num_layers).then_some((layer, target))
        });
        let head = adapter.head();
        let tensor = match (adapted, name.as_str(), head) {
            (Some((layer, target)), _, _) => merge(&tensor, adapter.pair(layer, target))?,
            (None, "output.weight", Some(head)) => merge(&tensor, head)?,
            // A tied LM head gets a table of its own (the embedding stays the base's), as a
            // file with `output.weight` has it.
            (None, "token_embd.weight", Some(head)) if tied => {
                tensors.push(("output.weight", merge(&tensor, head)?));
                tensor
            }
            _ => tensor,
        };
        tensors.push((name.as_str(), tensor));
    }
    // candle's writer aligns the data to 32 bytes, whatever the base said.
    let alignment = Value::U32(32);
    let mut metadata: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| match k.as_str() {
            "general.alignment" => (k.as_str(), &alignment),
            _ => (k.as_str(), v),
        })
        .collect();
    metadata.sort_by_key(|(k, _)| *k);
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    let mut tmp = out.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    let written = (|| -> Result<(), ModelError> {
        let mut w = BufWriter::new(File::create(&tmp).map_err(io_err(&tmp))?);
        gguf_file::write(&mut w, &metadata, &tensors)?;
        w.into_inner()
            .map_err(|e| io_err(&tmp)(e.into_error()))?
            .sync_all()
            .map_err(io_err(&tmp))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, out).map_err(io_err(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_order_is_llama_cpps_permutation() {
        // permute(w, n_head): reshape(n_head, 2, d/2) -> swapaxes(1, 2): GGUF row h·d + 2j + s
        // holds transformers' row h·d + s·d/2 + j.
        let d = 8;
        let gguf: Vec<usize> = (0..16).map(|r| hf_row(r, d)).collect();
        assert_eq!(gguf, [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]);
        let b: Vec<f32> = (0..32).map(|v| v as f32).collect();
        let hf = reorder_rows(&b, 2, d, true);
        assert_eq!(&hf[8..10], &b[2..4]); // transformers' row 4 is GGUF row 1
        assert_eq!(reorder_rows(&hf, 2, d, false), b);
    }

    #[test]
    fn peft_names_round_trip() {
        for t in LoraTarget::ALL {
            for m in ['A', 'B'] {
                assert_eq!(parse_peft_name(&peft_name(17, t, m)), Some((17, t, m)));
            }
        }
        assert_eq!(
            parse_peft_name(
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
            ),
            None
        );
        assert_eq!(
            parse_peft_name("base_model.model.lm_head.lora_A.weight"),
            None
        );
        assert_eq!(
            parse_peft_name("base_model.model.model.layers.+1.mlp.up_proj.lora_B.weight"),
            None
        );
    }
}
