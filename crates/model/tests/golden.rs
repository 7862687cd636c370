//! Greedy decoding of the real Gemma 3 270M against llama.cpp's output
//! (`tests/fixtures/greedy-sample.jsonl`, see /work/shared/golden/README.md).

use std::path::PathBuf;

use temper_model::{load_gguf, Gemma3, SeqInput};

fn model_path() -> Option<PathBuf> {
    let path = match std::env::var_os("TEMPER_MODEL_PATH") {
        Some(p) => PathBuf::from(p),
        None => {
            let home = std::env::var_os("TEMPER_HOME")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/temper"))
                })
                .unwrap_or_default();
            home.join("models/gemma-3-270m-q4_k_m.gguf")
        }
    };
    if path.exists() {
        return Some(path);
    }
    if std::env::var("TEMPER_REQUIRE_MODEL").as_deref() == Ok("1") {
        panic!("TEMPER_REQUIRE_MODEL=1 but {} is missing", path.display());
    }
    eprintln!("skipping: model file {} not present", path.display());
    None
}

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

#[test]
fn greedy_matches_llama_cpp() {
    let Some(path) = model_path() else { return };
    let model = load_gguf(&path).expect("load").model;
    let mut prompts_ok = 0;
    let mut max_diff = 0f32;
    let samples = samples();
    for (si, s) in samples.iter().enumerate() {
        let (ids, lps) = greedy(&model, &s.prompt, s.ids.len());
        let same = ids.iter().zip(&s.ids).take_while(|(a, b)| a == b).count();
        // Logprobs are comparable only while both sides saw the same context.
        let mut diff = 0f32;
        for (pos, top) in s.top.iter().enumerate().take(same + 1) {
            for &(id, lp) in top {
                diff = diff.max((lps[pos][id as usize] - lp).abs());
            }
        }
        max_diff = max_diff.max(diff);
        if same >= 16 {
            prompts_ok += 1;
        }
        eprintln!(
            "sample {si}: {same}/{} ids identical, max |logprob diff| over top-5 {diff:.5}",
            s.ids.len()
        );
    }
    eprintln!(
        "{prompts_ok}/{} prompts with 16 identical ids; max logprob diff {max_diff:.5}",
        samples.len()
    );
    assert!(
        prompts_ok >= samples.len() - 1,
        "only {prompts_ok} prompts matched 16 ids"
    );
    assert!(max_diff < 0.05, "logprob difference {max_diff} too large");
}
