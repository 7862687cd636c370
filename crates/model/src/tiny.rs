//! A tiny random Gemma-3-shaped model with a small SentencePiece vocabulary, written as GGUF so
//! tests (here and in other crates) exercise the real loader and tokenizer-from-metadata paths.
//!
//! Shape: width 64, 4 layers (layers 1 and 3 global: `sliding_window_pattern` 2), 2 query heads,
//! 1 KV head, head dim 32, FFN 256, sliding window 8, context 2048. Quantization covers Q8_0
//! (embedding, v, o), Q5_0 (q, k, gate, up), Q4_K / Q6_K (ffn_down, alternating) and F32 norms.

use std::collections::HashSet;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::{LoadedModel, ModelError};

const HIDDEN: usize = 64;
const LAYERS: usize = 4;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 32;
const FFN: usize = 256;
const WINDOW: usize = 8;
const PATTERN: usize = 2;
const CONTEXT: usize = 2048;

const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

const WORDS: &[&str] = &[
    "the", "a", "an", "is", "of", "and", "to", "in", "it", "that", "you", "he", "she", "we",
    "they", "was", "for", "on", "are", "with", "as", "I", "his", "her", "be", "at", "by", "this",
    "have", "from", "or", "one", "had", "not", "but", "what", "all", "were", "when", "there",
    "can", "Hello", "hello", "world", "The", "cat", "dog", "sat", "mat", "model", "user", "yes",
    "no", "good", "day", "time", "how", "Paris", "France", "capital", "answer", "question",
];

/// Writes the tiny model to `path`. The same `seed` always gives the same file.
pub fn write_tiny_gguf(path: &Path, seed: u64) -> Result<(), ModelError> {
    write(path, seed, false)
}

/// The tiny model of `seed` through the real writer and loader (a temporary file, removed
/// again).
pub fn load_tiny(seed: u64) -> Result<LoadedModel, ModelError> {
    static FILES: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "temper-tiny-{}-{}.gguf",
        std::process::id(),
        FILES.fetch_add(1, Ordering::Relaxed)
    ));
    write_tiny_gguf(&path, seed)?;
    let loaded = crate::load_gguf(&path);
    let _ = std::fs::remove_file(&path);
    loaded
}

/// The same model with every weight stored as F32 (exact f32 matmuls, no activation
/// quantization): a smooth function of the adapter, for finite-difference gradient checks.
pub fn write_tiny_gguf_f32(path: &Path, seed: u64) -> Result<(), ModelError> {
    write(path, seed, true)
}

fn write(path: &Path, seed: u64, all_f32: bool) -> Result<(), ModelError> {
    let dtype = |d: GgmlDType| if all_f32 { GgmlDType::F32 } else { d };
    let (pieces, scores, types) = vocab();
    let vocab_size = pieces.len();
    let mut rng = SplitMix64(seed ^ 0x9e37_79b9_7f4a_7c15);

    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    // A small embedding (rms 0.4 after the sqrt(64) scale) keeps the residual stream from being
    // dominated by the current token, which would make greedy decoding repeat it; the final norm
    // around 6 gives the tied LM head logits with a spread of a few units.
    tensors.push((
        "token_embd.weight".into(),
        random(
            &mut rng,
            &[vocab_size, HIDDEN],
            0.05,
            dtype(GgmlDType::Q8_0),
        )?,
    ));
    tensors.push(("output_norm.weight".into(), norm(&mut rng, HIDDEN, 6.0)?));
    let q_dim = HEADS * HEAD_DIM;
    let kv_dim = KV_HEADS * HEAD_DIM;
    for i in 0..LAYERS {
        let p = format!("blk.{i}");
        let down_type = if i % 2 == 0 {
            GgmlDType::Q4K
        } else {
            GgmlDType::Q6K
        };
        let linears = [
            ("attn_q", q_dim, HIDDEN, GgmlDType::Q5_0),
            ("attn_k", kv_dim, HIDDEN, GgmlDType::Q5_0),
            ("attn_v", kv_dim, HIDDEN, GgmlDType::Q8_0),
            ("attn_output", HIDDEN, q_dim, GgmlDType::Q8_0),
            ("ffn_gate", FFN, HIDDEN, GgmlDType::Q5_0),
            ("ffn_up", FFN, HIDDEN, GgmlDType::Q5_0),
            ("ffn_down", HIDDEN, FFN, down_type),
        ];
        for (name, out_dim, in_dim, wtype) in linears {
            // Uniform with std 1/sqrt(in): keeps each projection's output at the input's scale.
            let std = 1.0 / (in_dim as f32).sqrt();
            let t = random(&mut rng, &[out_dim, in_dim], std, dtype(wtype))?;
            tensors.push((format!("{p}.{name}.weight"), t));
        }
        for (name, len) in [
            ("attn_norm", HIDDEN),
            ("attn_q_norm", HEAD_DIM),
            ("attn_k_norm", HEAD_DIM),
            ("post_attention_norm", HIDDEN),
            ("ffn_norm", HIDDEN),
            ("post_ffw_norm", HIDDEN),
        ] {
            tensors.push((format!("{p}.{name}.weight"), norm(&mut rng, len, 1.0)?));
        }
    }

    let u32v = |v: usize| Value::U32(v as u32);
    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("gemma3".into())),
        ("general.name", Value::String("temper tiny gemma3".into())),
        ("gemma3.context_length", u32v(CONTEXT)),
        ("gemma3.embedding_length", u32v(HIDDEN)),
        ("gemma3.block_count", u32v(LAYERS)),
        ("gemma3.feed_forward_length", u32v(FFN)),
        ("gemma3.attention.head_count", u32v(HEADS)),
        ("gemma3.attention.head_count_kv", u32v(KV_HEADS)),
        ("gemma3.attention.key_length", u32v(HEAD_DIM)),
        ("gemma3.attention.value_length", u32v(HEAD_DIM)),
        ("gemma3.rope.freq_base", Value::F32(1_000_000.0)),
        ("gemma3.attention.sliding_window", u32v(WINDOW)),
        ("gemma3.attention.sliding_window_pattern", u32v(PATTERN)),
        ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.pre", Value::String("default".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(pieces.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.scores",
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(2)),
        ("tokenizer.ggml.eos_token_id", Value::U32(1)),
        ("tokenizer.ggml.unknown_token_id", Value::U32(3)),
        ("tokenizer.ggml.padding_token_id", Value::U32(0)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        ("tokenizer.ggml.add_eos_token", Value::Bool(false)),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
    ];

    let io_err = |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut w = BufWriter::new(File::create(path).map_err(io_err)?);
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut w, &md, &ts)?;
    std::io::Write::flush(&mut w).map_err(io_err)?;
    Ok(())
}

/// Pieces, scores and token types, laid out like Gemma's: specials first, then `\n`, the 256
/// byte pieces, `▁`, single characters, then words reachable by SentencePiece-BPE merges
/// (every word's `▁`-prefixed prefixes are pieces, so `▁` + `t` -> `▁t` -> `▁th` -> `▁the`).
fn vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut pieces = Vec::new();
    let mut scores = Vec::new();
    let mut types = Vec::new();
    let mut push = |piece: String, score: f32, ty: i32| {
        pieces.push(piece);
        scores.push(score);
        types.push(ty);
    };
    for (piece, ty) in [
        ("<pad>", CONTROL),
        ("<eos>", CONTROL),
        ("<bos>", CONTROL),
        ("<unk>", UNKNOWN),
        ("<mask>", CONTROL),
        ("<start_of_turn>", CONTROL),
        ("<end_of_turn>", CONTROL),
    ] {
        push(piece.to_string(), -1000.0, ty);
    }
    push("\n".to_string(), 0.0, USER_DEFINED);
    push("\n\n".to_string(), 0.0, USER_DEFINED);
    for b in 0..=255u8 {
        push(format!("<0x{b:02X}>"), 0.0, BYTE);
    }

    let mut normal: Vec<String> = vec!["▁".to_string()];
    let chars = ('a'..='z')
        .chain('A'..='Z')
        .chain('0'..='9')
        .chain(".,!?'-:;\"()".chars());
    normal.extend(chars.map(String::from));
    let mut seen: HashSet<String> = normal.iter().cloned().collect();
    for word in WORDS {
        let piece = format!("▁{word}");
        let ends = piece.char_indices().map(|(i, c)| i + c.len_utf8()).skip(1);
        for end in ends {
            let prefix = piece[..end].to_string();
            if seen.insert(prefix.clone()) {
                normal.push(prefix);
            }
        }
    }
    // Later (longer) pieces score higher, so merges build words rather than stall on fragments.
    for (i, piece) in normal.into_iter().enumerate() {
        push(piece, i as f32 - 1000.0, NORMAL);
    }
    (pieces, scores, types)
}

fn random(
    rng: &mut SplitMix64,
    shape: &[usize],
    std: f32,
    dtype: GgmlDType,
) -> Result<QTensor, ModelError> {
    let n: usize = shape.iter().product();
    // Uniform on [-a, a] has std a / sqrt(3).
    let a = std * 3f32.sqrt();
    let data: Vec<f32> = (0..n).map(|_| a * rng.uniform()).collect();
    let t = Tensor::from_vec(data, shape, &Device::Cpu)?;
    Ok(QTensor::quantize(&t, dtype)?)
}

/// Norm weights around `center` (GGUF stores Gemma's `1 + w`).
fn norm(rng: &mut SplitMix64, len: usize, center: f32) -> Result<QTensor, ModelError> {
    let data: Vec<f32> = (0..len)
        .map(|_| center * (1.0 + 0.2 * rng.uniform()))
        .collect();
    let t = Tensor::from_vec(data, len, &Device::Cpu)?;
    Ok(QTensor::quantize(&t, GgmlDType::F32)?)
}

pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform on [-1, 1).
    pub(crate) fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}
