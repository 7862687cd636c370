//! Adapters as PEFT files, as a llama.cpp LoRA GGUF and merged into the base GGUF: round trips,
//! the files' layout, and every kind of bad PEFT file refused naming its tensor.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use common::{run_alone, tiny_model, tokens, trained_adapter, trained_adapter_of};
use temper_model::tiny::write_tiny_gguf_f32;
use temper_model::{
    load_gguf, merge_into_gguf, Decoder, LoraAdapter, LoraConfig, MergedWeights, PeftFiles,
    MAX_IMPORT_RANK,
};

/// An adapter configuration with an LM-head pair (Tinker's `train_unembed`).
const WITH_HEAD: LoraConfig = LoraConfig {
    rank: 8,
    alpha: 16.0,
    unembed: true,
};

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "temper-adapter-files-{}-{name}",
        std::process::id()
    ))
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn llama() -> Decoder {
    load_gguf(&fixture("tiny-llama.gguf"))
        .expect("tiny llama")
        .model
}

fn peft_tensors(files: &PeftFiles) -> HashMap<String, Tensor> {
    candle_core::safetensors::load_buffer(&files.weights, &Device::Cpu).expect("safetensors")
}

fn with_tensors(files: &PeftFiles, edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> PeftFiles {
    let mut tensors = peft_tensors(files);
    edit(&mut tensors);
    PeftFiles {
        weights: safetensors::tensor::serialize(&tensors, None).expect("serialize"),
        config: files.config.clone(),
    }
}

fn with_config(files: &PeftFiles, edit: impl FnOnce(&mut serde_json::Value)) -> PeftFiles {
    let mut config: serde_json::Value = serde_json::from_slice(&files.config).expect("json");
    edit(&mut config);
    PeftFiles {
        weights: files.weights.clone(),
        config: serde_json::to_vec(&config).expect("json"),
    }
}

const Q_A: &str = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
const Q_B: &str = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";

#[test]
fn peft_files_round_trip_bit_for_bit() {
    for (model, permutes) in [(tiny_model("peft-gemma"), false), (llama(), true)] {
        let adapter = trained_adapter(&model, 4, 0.05);
        let files = adapter.to_peft(model.config(), "base").expect("to_peft");
        let config: serde_json::Value = serde_json::from_slice(&files.config).expect("json");
        assert_eq!(config["r"], 8);
        assert_eq!(config["lora_alpha"], 16.0);
        assert_eq!(config["peft_type"], "LORA");
        assert_eq!(config["base_model_name_or_path"], "base");
        assert_eq!(config["target_modules"].as_array().map(Vec::len), Some(7));
        let tensors = peft_tensors(&files);
        assert_eq!(tensors.len(), model.config().num_layers * 14);
        let (q, hidden) = (
            model.config().num_heads * model.config().head_dim,
            model.config().hidden_size,
        );
        assert_eq!(tensors[Q_A].dims(), [8, hidden]);
        assert_eq!(tensors[Q_B].dims(), [q, 8]);
        // Llama's q rows are in transformers' order in the file, not the GGUF's.
        let temper_q_b = &adapter.params()[1];
        let file_q_b = tensors[Q_B]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(&file_q_b[..] != *temper_q_b, permutes);

        let back = LoraAdapter::from_peft(&files, model.config(), 1).expect("from_peft");
        assert_eq!(back.config(), adapter.config());
        assert_eq!(back.params(), adapter.params());
        let vocab = model.config().vocab_size as u32;
        let toks: Vec<u32> = tokens(10, 2).iter().map(|t| t % vocab).collect();
        assert_eq!(
            run_alone(&model, &toks, Some(&back)).data,
            run_alone(&model, &toks, Some(&adapter)).data
        );

        // With an LM-head pair: PEFT's `lm_head` module, tied head or not.
        let adapter = trained_adapter_of(&model, WITH_HEAD, 4, 0.05);
        let files = adapter.to_peft(model.config(), "base").expect("to_peft");
        let config: serde_json::Value = serde_json::from_slice(&files.config).expect("json");
        let targets = config["target_modules"].as_array().unwrap();
        assert_eq!(targets.len(), 8);
        assert!(targets.contains(&"lm_head".into()));
        let tensors = peft_tensors(&files);
        let (vocab, hidden) = (model.config().vocab_size, model.config().hidden_size);
        assert_eq!(
            tensors["base_model.model.lm_head.lora_A.weight"].dims(),
            [8, hidden]
        );
        assert_eq!(
            tensors["base_model.model.lm_head.lora_B.weight"].dims(),
            [vocab, 8]
        );
        let back = LoraAdapter::from_peft(&files, model.config(), 1).expect("from_peft");
        assert_eq!(back.config(), WITH_HEAD);
        assert_eq!(back.params(), adapter.params());
        let only_a = with_tensors(&files, |t| {
            t.remove("base_model.model.lm_head.lora_B.weight");
        });
        let err = LoraAdapter::from_peft(&only_a, model.config(), 1).unwrap_err();
        assert_eq!(err.subject, "base_model.model.lm_head.lora_B.weight");
    }
}

#[test]
fn a_partial_peft_adapter_fills_the_rest_with_fresh_pairs() {
    let model = tiny_model("peft-partial");
    let adapter = trained_adapter(&model, 4, 0.05);
    let files = adapter.to_peft(model.config(), "base").expect("to_peft");
    // Only q and v of every layer (PEFT's default targets), in f16 and rsLoRA's scale.
    let partial = with_tensors(&files, |t| {
        t.retain(|name, _| name.contains("q_proj") || name.contains("v_proj"));
        for v in t.values_mut() {
            *v = v.to_dtype(candle_core::DType::F16).unwrap();
        }
    });
    let partial = with_config(&partial, |c| {
        c["target_modules"] = serde_json::json!(["q_proj", "v_proj"]);
        c["use_rslora"] = true.into();
        c["lora_alpha"] = 4.0.into();
    });
    let back = LoraAdapter::from_peft(&partial, model.config(), 9).expect("from_peft");
    // alpha / sqrt(r) = 4 / sqrt(8) is temper's alpha / r with alpha = 4 sqrt(8).
    assert!((back.scale() - 4.0 / 8f32.sqrt()).abs() < 1e-6);
    let fresh = LoraAdapter::new(model.config(), back.config(), 9);
    for (i, (got, (orig, fresh))) in back
        .params()
        .iter()
        .zip(adapter.params().iter().zip(fresh.params()))
        .enumerate()
    {
        // params: per layer, per target (q k v o gate up down), A then B.
        let target = (i / 2) % 7;
        if target == 0 || target == 2 {
            let f16: Vec<f32> = orig
                .iter()
                .map(|v| half::f16::from_f32(*v).to_f32())
                .collect();
            assert_eq!(*got, &f16[..]);
        } else {
            assert_eq!(*got, fresh, "param {i}");
        }
    }
}

#[test]
fn bad_peft_files_are_refused_naming_the_tensor() {
    let model = tiny_model("peft-bad");
    let adapter = trained_adapter(&model, 4, 0.05);
    let files = adapter.to_peft(model.config(), "base").expect("to_peft");
    let refused =
        |files: &PeftFiles| LoraAdapter::from_peft(files, model.config(), 1).expect_err("refused");

    let nan = with_tensors(&files, |t| {
        let mut v = t[Q_B].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[3] = f32::NAN;
        t.insert(
            Q_B.into(),
            Tensor::from_vec(v, t[Q_B].dims(), &Device::Cpu).unwrap(),
        );
    });
    let e = refused(&nan);
    assert_eq!(e.subject, Q_B);
    assert!(e.reason.contains("non-finite"), "{e}");

    let wrong_shape = with_tensors(&files, |t| {
        t.insert(
            Q_A.into(),
            Tensor::zeros((8, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
    });
    let e = refused(&wrong_shape);
    assert_eq!(e.subject, Q_A);
    assert!(
        e.reason.contains("[8, 32]") && e.reason.contains("[8, 64]"),
        "{e}"
    );

    let oversize = with_tensors(&files, |t| {
        t.insert(
            Q_B.into(),
            Tensor::zeros((64, 512), candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
    });
    assert_eq!(refused(&oversize).subject, Q_B);
    let over_rank = with_config(&files, |c| c["r"] = (MAX_IMPORT_RANK + 1).into());
    assert!(refused(&over_rank).subject.ends_with(": r"));

    let unknown = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight";
    let unknown_target = with_tensors(&files, |t| {
        t.insert(unknown.into(), t[Q_A].clone());
    });
    assert_eq!(refused(&unknown_target).subject, unknown);
    let unknown_module = with_config(&files, |c| {
        c["target_modules"] = serde_json::json!(["embed_tokens"])
    });
    assert!(refused(&unknown_module).subject.ends_with("target_modules"));

    let deep = "base_model.model.model.layers.4.mlp.up_proj.lora_A.weight";
    let too_deep = with_tensors(&files, |t| {
        t.insert(
            deep.into(),
            t["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"].clone(),
        );
    });
    assert_eq!(refused(&too_deep).subject, deep);

    let half_pair = with_tensors(&files, |t| {
        t.remove(Q_B);
    });
    assert_eq!(refused(&half_pair).subject, Q_B);

    let dora = with_config(&files, |c| c["use_dora"] = true.into());
    assert!(refused(&dora).subject.ends_with("use_dora"));
    let garbage = PeftFiles {
        weights: b"not safetensors".to_vec(),
        config: files.config.clone(),
    };
    assert_eq!(refused(&garbage).subject, "adapter_model.safetensors");
    let no_json = PeftFiles {
        weights: files.weights.clone(),
        config: b"{".to_vec(),
    };
    assert_eq!(refused(&no_json).subject, "adapter_config.json");
}

#[test]
fn the_gguf_adapter_has_llama_cpps_layout() {
    let model = tiny_model("gguf-adapter");
    let adapter = trained_adapter(&model, 4, 0.05);
    let bytes = adapter.to_gguf(model.config(), "x").expect("to_gguf");
    let mut reader = std::io::Cursor::new(&bytes);
    let content = gguf_file::Content::read(&mut reader).expect("gguf");
    let s = |k: &str| content.metadata[k].to_string().unwrap().clone();
    assert_eq!(s("general.type"), "adapter");
    assert_eq!(s("adapter.type"), "lora");
    assert_eq!(s("general.architecture"), "gemma3");
    assert_eq!(
        content.metadata["adapter.lora.alpha"].to_f32().unwrap(),
        16.0
    );
    assert_eq!(content.tensor_infos.len(), model.config().num_layers * 14);
    // candle's shapes are row-major: A [r, in] is ggml ne [in, r]; B [out, r] is ne [r, out].
    let a = &content.tensor_infos["blk.0.ffn_down.weight.lora_a"];
    let b = &content.tensor_infos["blk.0.ffn_down.weight.lora_b"];
    assert_eq!(a.shape.dims(), [8, 256]);
    assert_eq!(b.shape.dims(), [64, 8]);
    let b = content
        .tensor(&mut reader, "blk.0.ffn_down.weight.lora_b", &Device::Cpu)
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap();
    let down_b = &adapter.params()[13];
    assert_eq!(b.flatten_all().unwrap().to_vec1::<f32>().unwrap(), *down_b);

    // An LM-head pair is `output.weight`'s where the model has its own LM head; a tied one
    // (llama.cpp reads the embedding table) cannot be expressed: a clear error.
    let with_head = trained_adapter_of(&model, WITH_HEAD, 4, 0.05);
    let err = with_head.to_gguf(model.config(), "x").unwrap_err();
    assert!(err.to_string().contains("export it as PEFT"), "{err}");
    let untied = llama();
    let with_head = trained_adapter_of(&untied, WITH_HEAD, 4, 0.05);
    let bytes = with_head.to_gguf(untied.config(), "x").expect("to_gguf");
    let content = gguf_file::Content::read(&mut std::io::Cursor::new(&bytes)).expect("gguf");
    let hidden = untied.config().hidden_size;
    let vocab = untied.config().vocab_size;
    assert_eq!(
        content.tensor_infos["output.weight.lora_a"].shape.dims(),
        [8, hidden]
    );
    assert_eq!(
        content.tensor_infos["output.weight.lora_b"].shape.dims(),
        [vocab, 8]
    );
}

#[test]
fn a_merged_gguf_serves_as_base_plus_adapter() {
    // F32 weights: the merge adds in f32 what the adapter adds at run time (the sums' order
    // apart: about 1e-3 on these logits).
    let base = temp("merge-base.gguf");
    write_tiny_gguf_f32(&base, 7).expect("write");
    let model = load_gguf(&base).expect("load").model;
    let toks = tokens(12, 3);
    // The tiny model's LM head is its embedding: merged, the head gets a table of its own.
    let plain = trained_adapter(&model, 4, 0.3);
    let with_head = trained_adapter_of(&model, WITH_HEAD, 4, 0.3);
    let cases = [
        (&plain, MergedWeights::AsBase, 1e-2),
        (&plain, MergedWeights::F16, 5e-2),
        (&with_head, MergedWeights::AsBase, 1e-2),
    ];
    for (adapter, weights, bound) in cases {
        let want = run_alone(&model, &toks, Some(adapter));
        let out = temp("merged.gguf");
        merge_into_gguf(&base, adapter, &out, weights).expect("merge");
        let merged = load_gguf(&out).expect("load merged");
        let head = adapter.config().unembed;
        assert_eq!(merged.model.config().tied_embeddings, !head);
        let got = run_alone(&merged.model, &toks, None);
        let max = got
            .data
            .iter()
            .zip(&want.data)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max < bound, "{weights:?}: max |diff| {max}");
        let base_logits = run_alone(&model, &toks, None);
        let moved = base_logits
            .data
            .iter()
            .zip(&want.data)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            moved > 10.0 * bound,
            "the adapter moved logits by only {moved}"
        );
        // Everything else is the base's: metadata and the other tensors.
        let original = load_gguf(&base).expect("base").metadata;
        assert_eq!(merged.metadata.len(), original.len());
        let _ = std::fs::remove_file(&out);
    }
    // An adapter of another model is refused.
    let other = LoraAdapter::new(llama().config(), Default::default(), 1);
    assert!(merge_into_gguf(&base, &other, &temp("refused.gguf"), MergedWeights::AsBase).is_err());
    let _ = std::fs::remove_file(&base);
}

/// The tiny F32 fixtures of every family (converted by llama.cpp from transformers models that
/// scripts/make-tiny-families.py rebuilds): Llama, Mistral and SmolLM3 with the converter's q/k
/// row permutation, the others without.
const FAMILIES: [&str; 6] = ["llama", "mistral", "smollm3", "qwen2", "qwen3", "gemma3"];

/// Log-probabilities of each next token of `tokens` (all but the first).
fn next_token_logprobs(model: &Decoder, tokens: &[u32], adapter: Option<&LoraAdapter>) -> Vec<f64> {
    let logits = run_alone(model, tokens, adapter);
    (0..tokens.len() - 1)
        .map(|i| {
            let row = logits.row(i);
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            row[tokens[i + 1] as usize] as f64 - max - sum.ln()
        })
        .collect()
}

/// Writes, for each family into `$TEMPER_CHECK_DIR/FAMILY`, the PEFT export of an adapter that
/// changes the model (its LM head included) (`adapter_model.safetensors`, `adapter_config.json`) and temper's
/// logprobs of the fixture's tokens with and without it (`check.json`), which
/// scripts/test_adapter_export.py compares with PEFT's on the rebuilt transformers model.
#[test]
#[ignore = "writes the PEFT family check's inputs; run by scripts/adapter-export-tests.sh"]
fn write_peft_family_check_inputs() {
    let dir = PathBuf::from(std::env::var_os("TEMPER_CHECK_DIR").expect("TEMPER_CHECK_DIR"));
    for family in FAMILIES {
        let model = load_gguf(&fixture(&format!("tiny-{family}.gguf")))
            .expect("fixture")
            .model;
        let json: serde_json::Value = serde_json::from_slice(
            &std::fs::read(fixture(&format!("tiny-{family}.json"))).expect("fixture json"),
        )
        .expect("json");
        let tokens: Vec<u32> = json["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("token") as u32)
            .collect();
        // With an LM-head pair: PEFT's `lm_head` on tied and separate heads alike.
        let adapter = trained_adapter_of(&model, WITH_HEAD, 11, 0.1);
        let files = adapter
            .to_peft(model.config(), &format!("tiny-{family}"))
            .expect("to_peft");
        let out = dir.join(family);
        std::fs::create_dir_all(&out).expect("dir");
        std::fs::write(out.join("adapter_model.safetensors"), &files.weights).expect("write");
        std::fs::write(out.join("adapter_config.json"), &files.config).expect("write");
        let check = serde_json::json!({
            "tokens": tokens,
            "logprobs": next_token_logprobs(&model, &tokens, Some(&adapter)),
            "base_logprobs": next_token_logprobs(&model, &tokens, None),
        });
        std::fs::write(out.join("check.json"), check.to_string()).expect("write");
    }
}
