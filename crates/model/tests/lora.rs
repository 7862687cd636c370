//! LoRA adapters in the serving forward: per-row adapters in one batch, save/load.

mod common;

use common::{run_alone, tiny_model, tokens, trained_adapter, trained_adapter_of};
use temper_model::{Logits, LoraAdapter, LoraConfig, ModelError, SeqInput};

#[test]
fn fresh_adapter_is_the_base_model_and_trained_one_is_not() {
    let model = tiny_model("lora-fresh");
    let toks = tokens(12, 1);
    let base = run_alone(&model, &toks, None);
    let fresh = LoraAdapter::new(model.config(), LoraConfig::default(), 3);
    assert_eq!(run_alone(&model, &toks, Some(&fresh)).data, base.data);

    let trained = trained_adapter(&model, 3, 0.05);
    let changed = run_alone(&model, &toks, Some(&trained));
    let max_diff = changed
        .data
        .iter()
        .zip(&base.data)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max_diff > 1e-2, "adapter moved logits by only {max_diff}");
}

#[test]
fn rows_with_different_adapters_in_one_batch_equal_their_solo_runs() {
    let model = tiny_model("lora-batch");
    let (a1, a2) = (
        trained_adapter(&model, 1, 0.05),
        trained_adapter(&model, 2, 0.05),
    );
    let prompts = [tokens(9, 1), tokens(14, 2), tokens(5, 3), tokens(11, 4)];
    let adapters = [Some(&a1), None, Some(&a2), Some(&a1)];
    let solo: Vec<Logits> = prompts
        .iter()
        .zip(adapters)
        .map(|(p, a)| run_alone(&model, p, a))
        .collect();

    let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut batch: Vec<SeqInput> = prompts
        .iter()
        .zip(caches.iter_mut())
        .zip(adapters)
        .map(|((p, cache), adapter)| SeqInput {
            tokens: p,
            cache,
            all_logits: true,
            adapter,
        })
        .collect();
    let batched = model.forward(&mut batch).expect("batched forward");
    for (i, (s, b)) in solo.iter().zip(&batched).enumerate() {
        assert_eq!(s.data, b.data, "row {i} differs from its solo run");
    }

    // Decode one more token per row, each against its own cache and adapter.
    let next = [42u32];
    let mut batch: Vec<SeqInput> = caches
        .iter_mut()
        .zip(adapters)
        .map(|(cache, adapter)| SeqInput {
            tokens: &next,
            cache,
            all_logits: false,
            adapter,
        })
        .collect();
    let decoded = model.forward(&mut batch).expect("decode");
    for (i, (p, a)) in prompts.iter().zip(adapters).enumerate() {
        let full = [p.as_slice(), &next].concat();
        let alone = run_alone(&model, &full, a);
        assert_eq!(
            alone.row(alone.rows - 1),
            decoded[i].row(0),
            "decode row {i}"
        );
    }
}

#[test]
fn save_then_load_round_trips_and_checks_shapes() {
    let model = tiny_model("lora-save");
    let adapter = trained_adapter(&model, 5, 0.05);
    let dir = std::env::temp_dir().join(format!("temper-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("adapter.safetensors");
    adapter.save(&path).expect("save");
    let loaded = LoraAdapter::load(&path, model.config()).expect("load");
    assert_eq!(loaded.config(), adapter.config());
    assert_eq!(loaded.params(), adapter.params());
    assert_eq!(loaded.num_params(), adapter.num_params());
    // The bytes of a save, without a file (what an object store keeps), read back the same.
    let bytes = adapter.to_bytes().expect("to_bytes");
    assert_eq!(bytes, std::fs::read(&path).expect("read"));
    let from_bytes = LoraAdapter::from_bytes(&bytes, "s3://b/x", model.config()).expect("bytes");
    assert_eq!(from_bytes.params(), adapter.params());
    match LoraAdapter::from_bytes(&bytes[..bytes.len() / 2], "s3://b/x", model.config()) {
        Err(e @ ModelError::Adapter { .. }) => assert!(e.to_string().contains("s3://b/x"), "{e}"),
        r => panic!("expected an adapter error, got {r:?}"),
    }
    // rank 8 on 4 layers: q 64->64, k/v 64->32, o 64->64, gate/up 64->256, down 256->64.
    let per_layer = 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 256) * 3);
    assert_eq!(adapter.num_params(), 4 * per_layer);
    assert_eq!(adapter.memory_bytes(), 4 * adapter.num_params());

    // With an LM-head pair (64 -> the vocabulary): saved, read back and counted with it.
    let config = LoraConfig {
        unembed: true,
        ..LoraConfig::default()
    };
    let with_head = trained_adapter_of(&model, config, 5, 0.05);
    let bytes = with_head.to_bytes().expect("to_bytes");
    let back = LoraAdapter::from_bytes(&bytes, "head", model.config()).expect("from_bytes");
    assert_eq!(back.config(), config);
    assert_eq!(back.params(), with_head.params());
    let vocab = model.config().vocab_size;
    assert_eq!(with_head.num_params(), 4 * per_layer + 8 * (64 + vocab));
    let toks = tokens(6, 4);
    assert_eq!(
        run_alone(&model, &toks, Some(&back)).data,
        run_alone(&model, &toks, Some(&with_head)).data
    );
    let mut smaller_vocab = model.config().clone();
    smaller_vocab.vocab_size -= 1;
    assert!(!with_head.fits(&smaller_vocab));
    match LoraAdapter::from_bytes(&bytes, "head", &smaller_vocab) {
        Err(ModelError::TensorShape { name, .. }) => assert_eq!(name, "output.lora_b"),
        r => panic!("expected a shape error, got {r:?}"),
    }

    // Another model shape: a clear shape error, not a panic.
    let mut other = model.config().clone();
    other.intermediate_size = 128;
    match LoraAdapter::load(&path, &other) {
        Err(ModelError::TensorShape { name, .. }) => assert!(name.contains("ffn_gate"), "{name}"),
        r => panic!("expected a shape error, got {r:?}"),
    }
    let mut deeper = model.config().clone();
    deeper.num_layers = 5;
    assert!(matches!(
        LoraAdapter::load(&path, &deeper),
        Err(ModelError::Adapter { .. })
    ));
    std::fs::write(&path, b"not safetensors").expect("write");
    assert!(matches!(
        LoraAdapter::load(&path, model.config()),
        Err(ModelError::Adapter { .. })
    ));
    assert!(matches!(
        LoraAdapter::load(&dir.join("missing"), model.config()),
        Err(ModelError::Io { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);

    // An adapter of another shape is refused by the forward.
    let wrong = LoraAdapter::new(&other, LoraConfig::default(), 1);
    let mut cache = model.new_cache();
    let err = model
        .forward(&mut [SeqInput {
            tokens: &[5, 6],
            cache: &mut cache,
            all_logits: false,
            adapter: Some(&wrong),
        }])
        .unwrap_err();
    assert!(
        matches!(err, ModelError::AdapterMismatch { index: 0 }),
        "{err}"
    );
    assert_eq!(cache.len(), 0);
}
