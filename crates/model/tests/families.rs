//! The Llama, Qwen2 and Qwen3 families on tiny random models that llama.cpp's converter wrote
//! from transformers models (`fixtures/README.md`, `scripts/make-tiny-families.py`): logits
//! against transformers' f32 forward, scoring equal to serving, and the backward against
//! finite differences.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{
    check_finite_differences, compare_with_serving, diffs, run_alone, scored_all, trained_adapter,
};
use temper_model::{load_gguf, Activation, Arch, Decoder, ModelError, PackedSequence, RopeLayout};

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

/// The fixture's token ids and transformers' logits for them, one row per position.
fn reference(family: &str) -> (Vec<u32>, Vec<Vec<f32>>) {
    let text = std::fs::read_to_string(fixture(&format!("tiny-{family}.json"))).expect("read");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let tokens = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect();
    let logits = v["logits"]
        .as_array()
        .expect("logits")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_f64().expect("logit") as f32)
                .collect()
        })
        .collect();
    (tokens, logits)
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
/// (relative 2^-11) move logits of a few units by about 1e-3. In f32: summation order only.
const SERVED: f32 = 1e-2;
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
}

/// The families of the tests below that take each in turn.
const FAMILIES: [&str; 3] = ["llama", "qwen2", "qwen3"];

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
    assert!(e.to_string().contains("llama, qwen2, qwen3, gemma3"), "{e}");
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
