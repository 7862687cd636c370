//! On the real model, a sequence's logits do not depend on what else is in the batch: the same
//! request gives the same tokens alone or batched (the engine's seed guarantee rests on this).

mod common;

use common::{alone_and_batched, argmax, diffs, greedy};
use temper_model::{load_gguf, SeqInput};

#[test]
fn batched_logits_equal_alone_bit_for_bit() {
    let Some(path) = temper_model::paths::real_model_for_tests() else {
        return;
    };
    let model = load_gguf(&path).unwrap().model;
    let a: Vec<u32> = vec![
        2, 105, 2364, 107, 3689, 563, 506, 92900, 10565, 580, 106, 107, 105, 4368, 107,
    ];
    let b: Vec<u32> = vec![
        2, 105, 2364, 107, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799,
    ];
    let [prompt, step] = alone_and_batched(&model, &a, &b, (818, 4799));
    let (_, mean) = diffs(&prompt.0, &prompt.1);
    assert!(prompt.0 == prompt.1, "prefill: mean abs diff {mean}");
    // Decode: one row alone against the same row next to another sequence's.
    assert!(step.0 == step.1, "decode: one row alone vs two rows");
}

/// Greedy decoding of the five golden prompts, each alone and all five as one batch.
#[test]
fn greedy_batch_of_five_equals_alone() {
    let Some(path) = temper_model::paths::real_model_for_tests() else {
        return;
    };
    let model = load_gguf(&path).unwrap().model;
    let prompts: Vec<Vec<u32>> = include_str!("fixtures/greedy-sample.jsonl")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect();
    let steps = 16;
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&model, p, steps)).collect();
    let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut inputs = prompts.clone();
    let mut outs = vec![Vec::new(); prompts.len()];
    for _ in 0..steps {
        let mut batch: Vec<SeqInput> = inputs
            .iter()
            .zip(caches.iter_mut())
            .map(|(t, c)| SeqInput {
                tokens: t,
                cache: c,
                all_logits: false,
                adapter: None,
            })
            .collect();
        let logits = model.forward(&mut batch).unwrap();
        for (i, l) in logits.iter().enumerate() {
            let t = argmax(l.row(0));
            outs[i].push(t);
            inputs[i] = vec![t];
        }
    }
    assert_eq!(outs, alone);
}

/// The real model's kernels keep a row's logits independent of how its sequence is fed: a
/// 300-token sequence in one forward and in uneven chunks give the same bits at every position.
/// (Through a prefix found in the cache: the engine's block manager's tests.)
#[test]
fn chunked_prefixes_equal_one_forward_bit_for_bit() {
    let Some(path) = temper_model::paths::real_model_for_tests() else {
        return;
    };
    let model = load_gguf(&path).unwrap().model;
    let toks: Vec<u32> = (0..300u32).map(|i| 100 + (i * 7919) % 20000).collect();
    let forward = |cache: &mut temper_model::SeqCache, tokens: &[u32]| {
        model
            .forward(&mut [SeqInput {
                tokens,
                cache,
                all_logits: true,
                adapter: None,
            }])
            .unwrap()
            .remove(0)
            .data
    };
    let whole = forward(&mut model.new_cache(), &toks);

    let mut cache = model.new_cache();
    let mut chunked = Vec::new();
    let mut at = 0;
    for size in [1, 37, 64, 5, 193] {
        chunked.extend(forward(&mut cache, &toks[at..at + size]));
        at += size;
    }
    assert!(chunked == whole, "chunking changed the logits");
}
