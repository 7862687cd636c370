//! The Llama, Qwen2, Qwen3, Gemma 3, Mistral and SmolLM3 families on tiny random models that llama.cpp's
//! converter wrote from transformers models (`fixtures/README.md`,
//! `scripts/make-tiny-families.py`): logits against transformers' f32 forward, scoring equal to
//! serving, and the backward against finite differences. Each family also as F16 and Q8_0 (the
//! converter's) and, one layer 256 wide, as Q4_K_M, Q5_K_M and Q4_0 (llama-quantize's): logits
//! against transformers' on the original and on the dequantized weights, greedy tokens against
//! the dequantized model's, and a sequence's logits alone equal to batched and to after a
//! prefix-cache hit.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{
    alone_and_batched, argmax, check_finite_differences, check_finite_differences_with_step,
    compare_with_serving, diffs, greedy, prefix_hit_rows, run_alone, scored_all, trained_adapter,
};
use temper_model::{
    load_gguf, Activation, Arch, Decoder, LoraConfig, ModelError, PackedSequence, RopeLayout,
    BLOCK_TOKENS,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn model(family: &str) -> Decoder {
    load_gguf(&fixture(&format!("tiny-{family}.gguf")))
        .expect("load")
        .model
}

const FAMILIES: [&str; 6] = ["llama", "qwen2", "qwen3", "gemma3", "mistral", "smollm3"];

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("floats")
        .iter()
        .map(|x| x.as_f64().expect("float") as f32)
        .collect()
}

fn rows(v: &serde_json::Value) -> Vec<Vec<f32>> {
    v.as_array().expect("rows").iter().map(floats).collect()
}

fn json(stem: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(&format!("{stem}.json"))).expect("read");
    serde_json::from_str(&text).expect("json")
}

/// The fixture's token ids and transformers' logits for them, one row per position.
fn reference(family: &str) -> (Vec<u32>, Vec<Vec<f32>>) {
    let v = json(&format!("tiny-{family}"));
    (ids(&v["tokens"]), rows(&v["logits"]))
}

/// The serving forward's logits (keys and values through the f16 cache) against
/// transformers'; then the scoring forward in f32 (`set_smooth`) against transformers'
/// log-softmax, which leaves only f32 rounding. Returns the two max |diff|s.
fn compare_with_transformers(family: &str) -> (f32, f32) {
    let mut model = model(family);
    let (tokens, want) = reference(family);
    let got = run_alone(&model, &tokens, None);
    let want_flat: Vec<f32> = want.concat();
    let (served, _) = diffs(&got.data, &want_flat);

    model.set_smooth(true);
    let mut scored = vec![true; tokens.len()];
    scored[0] = false;
    let scores = model
        .score(
            &PackedSequence {
                tokens: &tokens,
                segment_lens: &[tokens.len()],
                scored: &scored,
            },
            None,
        )
        .expect("score");
    let want_lp: Vec<f32> = (1..tokens.len())
        .map(|t| {
            let row = &want[t - 1];
            (row[tokens[t] as usize] as f64 - temper_model::softmax::log_sum_exp(row)) as f32
        })
        .collect();
    let (exact, _) = diffs(&scores.logprobs, &want_lp);
    let spread = diffs(&want_flat, &vec![0.0; want_flat.len()]).1;
    eprintln!("{family}: served logits max |diff| {served:e}, f32 logprobs {exact:e} (mean |logit| {spread:.2})");
    (served, exact)
}

/// Bounds on the differences from transformers. Served: the keys and values rounded to f16
/// (relative 2^-11) move logits of a few units by a few 1e-3 (measured max 3.5e-3 to 7.7e-3;
/// SmolLM3's four layers 1.4e-2). Transformers itself with its keys (after RoPE) and values
/// rounded to f16 in its eager attention moves by the same amounts to within 1e-4 (checked on
/// Llama, Qwen2, Qwen3, Mistral and SmolLM3: 6.19e-3 and 1.38e-2 for Llama and SmolLM3, as
/// here): the cache's rounding alone. In f32: summation order only.
const SERVED: f32 = 2.5e-2;
const EXACT: f32 = 1e-4;

fn check_against_transformers(family: &str) {
    let (served, exact) = compare_with_transformers(family);
    assert!(served < SERVED, "{family}: served logits off by {served}");
    assert!(exact < EXACT, "{family}: f32 logprobs off by {exact}");
}

#[test]
fn llama_matches_transformers() {
    check_against_transformers("llama");
}

#[test]
fn qwen2_matches_transformers() {
    check_against_transformers("qwen2");
}

#[test]
fn qwen3_matches_transformers() {
    check_against_transformers("qwen3");
}

#[test]
fn gemma3_matches_transformers() {
    check_against_transformers("gemma3");
}

#[test]
fn mistral_matches_transformers() {
    check_against_transformers("mistral");
}

#[test]
fn smollm3_matches_transformers() {
    check_against_transformers("smollm3");
}

#[test]
fn config_comes_from_each_familys_metadata() {
    let llama = model("llama");
    let cfg = llama.config();
    assert_eq!(cfg.arch, Arch::Llama);
    assert_eq!(cfg.rope_layout, RopeLayout::Interleaved);
    assert_eq!(cfg.activation, Activation::Silu);
    assert_eq!((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), (4, 2, 16));
    assert_eq!(cfg.rope_freq_factors.as_ref().map(Vec::len), Some(8));
    assert!(!cfg.qk_norm && !cfg.qkv_bias && !cfg.post_norms && !cfg.scale_embeddings);
    assert!((0..cfg.num_layers).all(|l| cfg.is_global(l)));

    let qwen2 = model("qwen2");
    let cfg = qwen2.config();
    assert_eq!(cfg.arch, Arch::Qwen2);
    assert_eq!(cfg.rope_layout, RopeLayout::HalfSplit);
    assert!(cfg.qkv_bias && !cfg.qk_norm);
    assert_eq!(cfg.rope_freq_scale, 0.5);

    let qwen3 = model("qwen3");
    let cfg = qwen3.config();
    assert_eq!(cfg.arch, Arch::Qwen3);
    assert_eq!((cfg.hidden_size, cfg.num_heads, cfg.head_dim), (64, 4, 32));
    assert!(cfg.qk_norm && !cfg.qkv_bias && !cfg.post_norms);
    // YaRN from 64 positions, base 10k, head 32: the ramp spans pairs 0 to 5.
    let yarn = cfg.rope_yarn.expect("yarn");
    assert_eq!((yarn.low, yarn.high, cfg.rope_freq_scale), (0.0, 5.0, 0.25));
    assert!((yarn.mscale - (1.0 + 0.1 * 4f32.ln())).abs() < 1e-6);
    assert!(llama.config().rope_yarn.is_none() && qwen2.config().rope_yarn.is_none());

    // Six layers of which the last is global (the converter writes no pattern: Gemma 3's 6),
    // window 8; the local layers' base 10k unscaled, the global one's 1M scaled by 1/8.
    let gemma = model("gemma3");
    let cfg = gemma.config();
    assert_eq!(cfg.arch, Arch::Gemma3);
    assert_eq!((cfg.sliding_window, cfg.global_every), (8, 6));
    let global: Vec<bool> = (0..cfg.num_layers).map(|l| cfg.is_global(l)).collect();
    assert_eq!(global, [false, false, false, false, false, true]);
    assert_eq!(
        (
            cfg.rope_base_local,
            cfg.rope_base_global,
            cfg.rope_freq_scale
        ),
        (10_000.0, 1_000_000.0, 0.125)
    );
    assert_eq!(cfg.activation, Activation::Gelu);
    assert!(cfg.qk_norm && cfg.post_norms && cfg.scale_embeddings && !cfg.qkv_bias);

    // Mistral is the llama architecture: no sliding window in the file (the converter writes
    // none for `llama`), base 1M, no scaling, 4 query heads per key/value head.
    let mistral = model("mistral");
    let cfg = mistral.config();
    assert_eq!(
        (cfg.arch, cfg.rope_layout),
        (Arch::Llama, RopeLayout::Interleaved)
    );
    assert_eq!((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), (4, 1, 16));
    assert_eq!(
        (cfg.rope_base_global, cfg.rope_freq_scale),
        (1_000_000.0, 1.0)
    );
    assert!(cfg.rope_freq_factors.is_none() && cfg.rope_yarn.is_none());
    assert!((0..cfg.num_layers).all(|l| cfg.is_global(l)));

    // SmolLM3: Llama's layout (the converter permutes q/k), every fourth layer without RoPE (no
    // key in the file: llama.cpp's 4), so the last of the four; base 5M, a tied head.
    let smollm3 = model("smollm3");
    let cfg = smollm3.config();
    assert_eq!(
        (cfg.arch, cfg.rope_layout, cfg.no_rope_every),
        (Arch::Smollm3, RopeLayout::Interleaved, Some(4))
    );
    let rope: Vec<bool> = (0..cfg.num_layers).map(|l| cfg.uses_rope(l)).collect();
    assert_eq!(rope, [true, true, true, false]);
    assert_eq!(
        (cfg.rope_base_global, cfg.rope_freq_scale),
        (5_000_000.0, 1.0)
    );
    assert_eq!(cfg.activation, Activation::Silu);
    assert!(!cfg.qk_norm && !cfg.qkv_bias && !cfg.post_norms && !cfg.scale_embeddings);
    assert!((0..cfg.num_layers).all(|l| cfg.is_global(l)));
    for other in [&llama, &qwen2, &qwen3, &gemma, &mistral] {
        let cfg = other.config();
        assert!(cfg.no_rope_every.is_none() && (0..cfg.num_layers).all(|l| cfg.uses_rope(l)));
    }
}

/// SmolLM3's layer without RoPE matters: the same file read as `llama` (RoPE on every layer,
/// the only difference) gives other logits, far from transformers'.
#[test]
fn smollm3_without_its_no_rope_layer_differs() {
    let path = rewritten(
        "smollm3",
        "as-llama",
        |md| {
            let renamed: Vec<(String, Value)> = md
                .iter()
                .filter_map(|(k, v)| {
                    let rest = k.strip_prefix("smollm3.")?;
                    Some((format!("llama.{rest}"), v.clone()))
                })
                .collect();
            md.retain(|k, _| !k.starts_with("smollm3."));
            md.extend(renamed);
            md.insert("general.architecture".into(), Value::String("llama".into()));
        },
        false,
        &[],
    );
    let as_llama = load_gguf(&path).expect("load").model;
    let _ = std::fs::remove_file(&path);
    let (tokens, want) = reference("smollm3");
    let got = run_alone(&as_llama, &tokens, None);
    let (max, mean) = diffs(&got.data, &want.concat());
    eprintln!("smollm3 read as llama: logits max |diff| {max}, mean {mean}");
    assert!(mean > 0.1, "smollm3 as llama: mean |diff| only {mean}");
}

/// Two segments packed, with and without an adapter: the logprobs the trainer computes (its
/// training forward's, which are `score`'s) are the serving forward's bits. On Q8_0 copies of
/// the fixtures: the F32 matrices go through candle's f32 product, whose bits depend on how
/// many rows it multiplies (the LM head's differ between a served sequence and the scored
/// rows), where our kernels' rows never do; on the F32 fixtures themselves the two differ by
/// that rounding alone (measured at most 2.9e-6, mean 1.4e-7).
#[test]
fn scoring_equals_serving_in_every_family() {
    for family in FAMILIES {
        let path = rewritten(family, "q8", |_| {}, true, &[]);
        let q8 = load_gguf(&path).expect("load").model;
        let _ = std::fs::remove_file(&path);
        let adapter = trained_adapter(&q8, 4, 0.05);
        let (tokens, _) = reference(family);
        let segs = [tokens[..17].to_vec(), tokens[5..].to_vec()];
        for a in [None, Some(&adapter)] {
            let (max, _) = compare_with_serving(&q8, &segs, a);
            assert_eq!(max, 0.0, "{family}, adapter {}", a.is_some());
        }
        let (toks, lens) = (segs.concat(), [17, segs[1].len()]);
        let scored = scored_all(&lens);
        let packed = PackedSequence {
            tokens: &toks,
            segment_lens: &lens,
            scored: &scored,
        };
        let (trained, _) = q8.train_forward(&packed, &adapter).expect("forward");
        let scores = q8.score(&packed, Some(&adapter)).expect("score");
        assert_eq!(trained, scores, "{family}: the training forward's logprobs");

        let f32 = model(family);
        for a in [None, Some(&trained_adapter(&f32, 4, 0.05))] {
            let (max, mean) = compare_with_serving(&f32, &segs, a);
            assert!(
                max < 2e-5 && mean < 1e-6,
                "{family} in F32, adapter {}: max |diff| {max}, mean {mean}",
                a.is_some()
            );
        }
    }
}

#[test]
fn llama_backward_matches_finite_differences() {
    check_finite_differences(model("llama"), &[13, 11], 0, 3);
}

#[test]
fn qwen2_backward_matches_finite_differences() {
    check_finite_differences(model("qwen2"), &[13, 11], 0, 3);
}

#[test]
fn qwen3_backward_matches_finite_differences() {
    check_finite_differences(model("qwen3"), &[13, 11], 0, 3);
}

/// With a pair on an LM head of its own (`output.weight`, not the embedding).
#[test]
fn llama_backward_with_an_lm_head_pair_matches_finite_differences() {
    let model = model("llama");
    assert!(!model.config().tied_embeddings);
    let config = LoraConfig {
        unembed: true,
        ..LoraConfig::default()
    };
    check_finite_differences_with_step(model, config, &[13, 11], 0, 3, 1e-2);
}

/// Past the sliding window (8) in both segments. Six layers leave about twice the two-layer
/// models' f32 noise in the differences: with steps 5e-3, 1e-2 and 2e-2 the worst entry is 2.65,
/// 1.29 and 0.60 of its bound (noise, falling as 1/step, not a wrong gradient), so 2e-2.
#[test]
fn gemma3_backward_matches_finite_differences() {
    let config = LoraConfig::default();
    check_finite_differences_with_step(model("gemma3"), config, &[13, 11], 0, 3, 2e-2);
}

#[test]
fn mistral_backward_matches_finite_differences() {
    check_finite_differences(model("mistral"), &[13, 11], 0, 3);
}

#[test]
fn smollm3_backward_matches_finite_differences() {
    check_finite_differences(model("smollm3"), &[13, 11], 0, 3);
}

/// The `family` fixture rewritten through candle's writer: its metadata changed by `edit`,
/// its matrices requantized to Q8_0 with `q8`, `extra` zero vectors of 64 added.
fn rewritten(
    family: &str,
    name: &str,
    edit: impl Fn(&mut HashMap<String, Value>),
    q8: bool,
    extra: &[&str],
) -> PathBuf {
    let file = fixture(&format!("tiny-{family}.gguf"));
    let mut reader = std::io::BufReader::new(std::fs::File::open(file).expect("open"));
    let mut content = gguf_file::Content::read(&mut reader).expect("read");
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for n in content.tensor_infos.keys() {
        let mut t = content
            .tensor(&mut reader, n, &Device::Cpu)
            .expect("tensor");
        if q8 && t.shape().dims().len() == 2 {
            let w = t.dequantize(&Device::Cpu).expect("dequantize");
            t = QTensor::quantize(&w, GgmlDType::Q8_0).expect("q8_0");
        }
        tensors.push((n.clone(), t));
    }
    for &n in extra {
        let t = Tensor::zeros(64, candle_core::DType::F32, &Device::Cpu).expect("zeros");
        tensors.push((
            n.to_string(),
            QTensor::quantize(&t, GgmlDType::F32).expect("f32"),
        ));
    }
    edit(&mut content.metadata);
    let path = std::env::temp_dir().join(format!(
        "temper-families-{}-{family}-{name}.gguf",
        std::process::id()
    ));
    let metadata: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = std::fs::File::create(&path).expect("create");
    gguf_file::write(&mut out, &metadata, &tensors).expect("write");
    path
}

/// The load's error of the Llama fixture rewritten as [`rewritten`] does.
fn load_error_of_edited(
    name: &str,
    edit: impl Fn(&mut HashMap<String, Value>),
    extra: &[&str],
) -> ModelError {
    let path = rewritten("llama", name, edit, false, extra);
    let result = load_gguf(&path);
    let _ = std::fs::remove_file(&path);
    match result {
        Ok(_) => panic!("{name}: loaded"),
        Err(e) => e,
    }
}

#[test]
fn an_unknown_architecture_is_refused_with_the_supported_ones() {
    let e = load_error_of_edited(
        "arch",
        |md| {
            md.insert("general.architecture".into(), Value::String("phi3".into()));
        },
        &[],
    );
    assert!(
        matches!(&e, ModelError::Architecture(a) if a == "phi3"),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("llama, qwen2, qwen3, gemma3, smollm3"),
        "{e}"
    );
}

#[test]
fn an_unread_tensor_or_an_unsupported_rope_scaling_is_refused() {
    let e = load_error_of_edited("bias", |_| {}, &["blk.0.attn_output.bias"]);
    assert!(
        matches!(&e, ModelError::UnexpectedTensor { name, arch: "llama" } if name == "blk.0.attn_output.bias"),
        "{e}"
    );
    let e = load_error_of_edited(
        "longrope",
        |md| {
            md.insert(
                "llama.rope.scaling.type".into(),
                Value::String("longrope".into()),
            );
        },
        &[],
    );
    assert!(
        matches!(&e, ModelError::Metadata { key, .. } if key == "llama.rope.scaling.type"),
        "{e}"
    );
}

/// A converted or quantized copy of a family's tiny model and transformers' references for it.
struct Variant {
    family: &'static str,
    ty: &'static str,
    model: Decoder,
    tokens: Vec<u32>,
    /// Transformers' f32 logits on the original weights.
    original: Vec<Vec<f32>>,
    /// Transformers' f32 logits on the weights dequantized by gguf-py.
    dequantized: Vec<Vec<f32>>,
    prompt: Vec<u32>,
    /// Transformers' greedy tokens after `prompt` on the dequantized weights, and the gap
    /// between the two largest logits at each step.
    greedy: Vec<u32>,
    gaps: Vec<f32>,
}

/// The small models' F16 and Q8_0 (`tiny-{family}-{ty}.gguf`) and the wide models' llama-quantize
/// types (`tiny-{family}-wide-{ty}.gguf`).
const SMALL_TYPES: [&str; 2] = ["f16", "q8_0"];
const WIDE_TYPES: [&str; 3] = ["q4_k_m", "q5_k_m", "q4_0"];

fn variant(family: &'static str, ty: &'static str) -> Variant {
    let stem = if SMALL_TYPES.contains(&ty) {
        format!("tiny-{family}")
    } else {
        format!("tiny-{family}-wide")
    };
    let v = json(&stem);
    let r = &v["variants"][ty];
    Variant {
        family,
        ty,
        model: load_gguf(&fixture(&format!("{stem}-{ty}.gguf")))
            .expect("load")
            .model,
        tokens: ids(&v["tokens"]),
        original: rows(&v["logits"]),
        dequantized: rows(&r["logits"]),
        prompt: ids(&r["prompt"]),
        greedy: ids(&r["greedy"]),
        gaps: floats(&r["gaps"]),
    }
}

/// Bounds on the served logits' differences from transformers', per type, from the measured
/// ones (`cargo test --test families -- --nocapture` prints them) with a margin: (max, mean)
/// |diff| from the original weights' logits (mostly the quantization's own error: the
/// dequantized model's logits are nearly as far off), and from the dequantized weights' (what
/// the kernels add: activations quantized to 8 bits per block as llama.cpp's, keys and values
/// in f16). The logits spread about 4: a wrong scale, block or sub-block layout moves them by
/// as much, far past every mean bound. `clear`: a top-2 gap in transformers' dequantized logits
/// wide enough that the argmax cannot move, twice the max bound from them.
struct Bounds {
    original: (f32, f64),
    dequantized: (f32, f64),
    clear: f32,
}

fn bounds(ty: &str) -> Bounds {
    // Measured (max, mean), worst of the six families: vs original / vs dequantized.
    let (original, dequantized) = match ty {
        // 0.022, 0.0037 / 0.0079, 0.0014 (0.022 and 0.0037: SmolLM3's four layers)
        "f16" => ((0.03, 0.006), (0.02, 0.003)),
        // 0.64, 0.11 / 0.38, 0.071 (0.64, 0.11 and 0.071: SmolLM3)
        "q8_0" => ((1.0, 0.15), (0.6, 0.1)),
        // 1.94, 0.36 / 0.47, 0.076 (0.47: SmolLM3)
        "q5_k_m" => ((3.0, 0.55), (0.6, 0.12)),
        // 3.79, 0.63 / 0.40, 0.079
        "q4_k_m" => ((6.0, 1.0), (0.6, 0.12)),
        // 4.75, 0.90 / 0.30, 0.056
        "q4_0" => ((7.0, 1.4), (0.5, 0.1)),
        _ => unreachable!("{ty}"),
    };
    Bounds {
        original,
        dequantized,
        clear: 2.0 * dequantized.0,
    }
}

/// Whether the two largest of `row` are more than `gap` apart.
fn clear_argmax(row: &[f32], gap: f32) -> bool {
    let mut sorted = row.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    sorted[0] - sorted[1] > gap
}

/// The served logits against transformers' on the original and the dequantized weights; the
/// argmax at every position of the fixture's ids and of transformers' greedy continuation
/// (teacher-forced) where the dequantized model's is clear; and our own greedy continuation
/// equal to transformers' up to its first step that is not.
fn check_variant(v: &Variant) {
    let (family, ty) = (v.family, v.ty);
    let b = bounds(ty);
    let got = run_alone(&v.model, &v.tokens, None);
    let (max_o, mean_o) = diffs(&got.data, &v.original.concat());
    let (max_d, mean_d) = diffs(&got.data, &v.dequantized.concat());
    eprintln!(
        "{family} {ty}: logits vs original max {max_o:.4} mean {mean_o:.4}; \
         vs dequantized max {max_d:.4} mean {mean_d:.5}"
    );
    assert!(
        max_o < b.original.0 && mean_o < b.original.1,
        "{family} {ty}: off the original model's logits by max {max_o}, mean {mean_o}"
    );
    assert!(
        max_d < b.dequantized.0 && mean_d < b.dequantized.1,
        "{family} {ty}: off the dequantized model's logits by max {max_d}, mean {mean_d}"
    );

    let mut clear = 0;
    for (t, want) in v.dequantized.iter().enumerate() {
        if clear_argmax(want, b.clear) {
            clear += 1;
            assert_eq!(
                argmax(got.row(t)),
                argmax(want),
                "{family} {ty}: argmax at position {t}"
            );
        }
    }
    let forced: Vec<u32> = [&v.prompt[..], &v.greedy[..]].concat();
    let rows = run_alone(&v.model, &forced, None);
    let mut clear_steps = 0;
    for (i, (&want, &gap)) in v.greedy.iter().zip(&v.gaps).enumerate() {
        if gap > b.clear {
            clear_steps += 1;
            let ours = argmax(rows.row(v.prompt.len() - 1 + i));
            assert_eq!(ours, want, "{family} {ty}: greedy step {i}");
        }
    }
    let free = v
        .gaps
        .iter()
        .position(|&g| g <= b.clear)
        .unwrap_or(v.gaps.len());
    let ours = greedy(&v.model, &v.prompt, v.greedy.len());
    assert_eq!(
        ours[..free],
        v.greedy[..free],
        "{family} {ty}: greedy tokens"
    );
    eprintln!(
        "{family} {ty}: argmax equal at {clear} clear positions of {}, at {clear_steps} clear \
         greedy steps of {}; greedy alone equal for its first {free}",
        v.tokens.len(),
        v.greedy.len()
    );
    assert!(
        clear + clear_steps >= 16,
        "{family} {ty}: too few clear positions"
    );
}

fn check_type(ty: &'static str) {
    for family in FAMILIES {
        check_variant(&variant(family, ty));
    }
}

#[test]
fn f16_matches_transformers_in_every_family() {
    check_type("f16");
}

#[test]
fn q8_0_matches_transformers_in_every_family() {
    check_type("q8_0");
}

#[test]
fn q4_k_m_matches_transformers_in_every_family() {
    check_type("q4_k_m");
}

#[test]
fn q5_k_m_matches_transformers_in_every_family() {
    check_type("q5_k_m");
}

#[test]
fn q4_0_matches_transformers_in_every_family() {
    check_type("q4_0");
}

/// Every family and type: a sequence's logits alone equal to the same sequence batched after
/// another (its prompt's rows and a decode step), and a second request after a prefix-cache hit
/// (one block, 16 positions, past Gemma 3's window) equal to the same request computed whole.
/// Bit for bit where our kernels do every product. The F32 and F16 files go through candle's,
/// whose sums depend on how many rows they multiply; a last-bit difference in a key or value
/// that crosses an f16 rounding boundary in the cache moves it by a step of 2^-11 relative
/// (up to 6e-4 measured, Mistral's F32 prefix hit: one key/value head), hence 5e-3.
#[test]
fn batched_and_prefix_cached_logits_equal_alone_in_every_family_and_type() {
    for family in FAMILIES {
        let (tokens, _) = reference(family);
        let other: Vec<u32> = tokens.iter().rev().map(|t| (t + 5) % 128).collect();
        let mut second = tokens[..BLOCK_TOKENS + 3].to_vec();
        second.extend(&other[..6]);
        for ty in ["f32"].into_iter().chain(SMALL_TYPES).chain(WIDE_TYPES) {
            let model = match ty {
                "f32" => model(family),
                _ => variant(family, ty).model,
            };
            let exact = !matches!(ty, "f32" | "f16");
            let [prompt, step] = alone_and_batched(&model, &tokens, &other[..13], (7, 9));
            let (hit, cached, fresh) = prefix_hit_rows(&model, &tokens, &second);
            assert_eq!(hit, BLOCK_TOKENS);
            for (what, (a, b)) in [
                ("prompt batched", prompt),
                ("step batched", step),
                ("prefix hit", (cached, fresh)),
            ] {
                let (max, _) = diffs(&a, &b);
                if exact {
                    assert!(a == b, "{family} {ty} {what}: max |diff| {max}");
                } else {
                    eprintln!("{family} {ty} {what}: max |diff| {max:e}");
                    assert!(max < 5e-3, "{family} {ty} {what}: max |diff| {max}");
                }
            }
        }
    }
}
