//! Greedy decoding of the real Gemma 3 270M against llama.cpp's output
//! (`tests/fixtures/greedy-sample.jsonl`, see /work/shared/golden/README.md).

use temper_model::{load_gguf, Gemma3, SeqInput};

struct Sample {
    prompt: Vec<u32>,
    ids: Vec<u32>,
    top: Vec<Vec<(u32, f32)>>,
}

fn samples() -> Vec<Sample> {
    let text = include_str!("fixtures/greedy-sample.jsonl");
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("json line");
            let top = v["top_logprobs"]
                .as_array()
                .expect("top_logprobs")
                .iter()
                .map(|pos| {
                    pos.as_array()
                        .expect("position")
                        .iter()
                        .map(|e| {
                            (
                                e["id"].as_u64().expect("id") as u32,
                                e["logprob"].as_f64().expect("logprob") as f32,
                            )
                        })
                        .collect()
                })
                .collect();
            Sample {
                prompt: ids(&v["prompt_ids"]),
                ids: ids(&v["ids"]),
                top,
            }
        })
        .collect()
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max
        + row
            .iter()
            .map(|&x| ((x - max) as f64).exp())
            .sum::<f64>()
            .ln() as f32;
    row.iter().map(|&x| x - lse).collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy-decodes `n` tokens one at a time through the cache, returning the ids and the
/// log-softmax of every step.
fn greedy(model: &Gemma3, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = model.new_cache();
    let mut next = prompt.to_vec();
    let mut ids = Vec::new();
    let mut lps = Vec::new();
    for _ in 0..n {
        let logits = model
            .forward(&mut [SeqInput {
                tokens: &next,
                cache: &mut cache,
                all_logits: false,
                adapter: None,
            }])
            .expect("forward");
        let row = logits[0].row(0);
        let id = argmax(row);
        lps.push(log_softmax(row));
        ids.push(id);
        next = vec![id];
    }
    (ids, lps)
}

/// Reference top-1 minus top-2 logprob: below this a position is a near-tie, where ids may
/// legitimately differ between two correct implementations.
const NEAR_TIE: f32 = 0.5;

#[test]
fn greedy_matches_llama_cpp() {
    let Some(path) = temper_model::paths::real_model_for_tests() else {
        return;
    };
    let model = load_gguf(&path).expect("load").model;
    let samples = samples();
    let (mut greedy16, mut sum_diff, mut n_diff, mut max_diff) = (0, 0f64, 0usize, 0f32);
    let (mut decisive, mut decisive_agree) = (0, 0);
    for (si, s) in samples.iter().enumerate() {
        // Free-running greedy decoding, one token at a time through the cache.
        let (ids, _) = greedy(&model, &s.prompt, s.ids.len());
        let same = ids.iter().zip(&s.ids).take_while(|(a, b)| a == b).count();
        if same >= 16 {
            greedy16 += 1;
        }
        // Ids must agree at least up to the first position where llama.cpp itself was unsure.
        let first_tie = s
            .top
            .iter()
            .position(|top| top[0].1 - top[1].1 < NEAR_TIE)
            .unwrap_or(s.ids.len());
        assert!(
            same >= first_tie.min(s.ids.len()),
            "sample {si}: greedy ids part at {same}, before the first near-tie at {first_tie}"
        );
        // Teacher-forced: llama.cpp's continuation in one prefill, so every position is compared
        // in the same context even after a near-tie made the greedy runs part ways.
        let mut tokens = s.prompt.clone();
        tokens.extend_from_slice(&s.ids[..s.ids.len() - 1]);
        let mut cache = model.new_cache();
        let logits = model
            .forward(&mut [SeqInput {
                tokens: &tokens,
                cache: &mut cache,
                all_logits: true,
                adapter: None,
            }])
            .expect("forward")
            .remove(0);
        let first = s.prompt.len() - 1;
        let (mut sd, mut md) = (0f64, 0f32);
        for (pos, top) in s.top.iter().enumerate() {
            let lp = log_softmax(logits.row(first + pos));
            for &(id, ref_lp) in top {
                let d = (lp[id as usize] - ref_lp).abs();
                sd += d as f64;
                md = md.max(d);
                n_diff += 1;
            }
            if top[0].1 - top[1].1 >= NEAR_TIE {
                decisive += 1;
                if argmax(&lp) == top[0].0 {
                    decisive_agree += 1;
                }
            }
        }
        sum_diff += sd;
        max_diff = max_diff.max(md);
        eprintln!(
            "sample {si}: greedy {same:2}/{} ids identical; teacher-forced top-5 |logprob diff| mean {:.4} max {md:.4}",
            s.ids.len(),
            sd / (5 * s.top.len()) as f64,
        );
    }
    let mean = sum_diff / n_diff as f64;
    eprintln!(
        "golden: {greedy16}/{} prompts with 16 identical greedy ids; top-5 logprob diff mean {mean:.4} max {max_diff:.4}; argmax agrees on {decisive_agree}/{decisive} positions that are not near-ties",
        samples.len()
    );
    assert_eq!(
        decisive_agree, decisive,
        "argmax differs where llama.cpp is decisive"
    );
    // Bounds, not targets: llama.cpp rounds K/V, attention and GELU through f16 and our kernels
    // sum in another order; through 8-bit activation quantization such differences grow to ~0.1
    // in logprobs (a wrong RoPE base of 5000 instead of 10000 already gives a mean of 0.18).
    assert!(mean < 0.15, "mean logprob difference {mean} too large");
    assert!(
        max_diff < 1.2,
        "max logprob difference {max_diff} too large"
    );
}
