//! Helpers shared by the model's integration tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::Path;

use temper_model::{
    load_gguf, tiny, Decoder, Logits, LoraAdapter, LoraConfig, ModelError, PackedSequence,
    SeqCache, SeqInput, TokenScores,
};

/// The tiny random model through the real GGUF writer and loader.
pub fn tiny_model(name: &str) -> Decoder {
    load_tiny(name, tiny::write_tiny_gguf)
}

/// The tiny model with F32 weights (exact matmuls).
pub fn tiny_model_f32(name: &str) -> Decoder {
    load_tiny(name, tiny::write_tiny_gguf_f32)
}

fn load_tiny(name: &str, write: fn(&Path, u64) -> Result<(), ModelError>) -> Decoder {
    let path =
        std::env::temp_dir().join(format!("temper-model-{}-{name}.gguf", std::process::id()));
    write(&path, 7).expect("write tiny model");
    let model = load_gguf(&path).expect("load tiny model").model;
    let _ = std::fs::remove_file(&path);
    model
}

/// An adapter whose B is nonzero (as after some training), so it changes the model: every
/// parameter gets a deterministic pseudo-random value of about `b_scale` (B) or its init (A).
pub fn trained_adapter(model: &Decoder, seed: u64, b_scale: f32) -> LoraAdapter {
    trained_adapter_of(model, LoraConfig::default(), seed, b_scale)
}

/// [`trained_adapter`] of configuration `config` (with an LM-head pair where it says so).
pub fn trained_adapter_of(
    model: &Decoder,
    config: LoraConfig,
    seed: u64,
    b_scale: f32,
) -> LoraAdapter {
    let mut adapter = LoraAdapter::new(model.config(), config, seed);
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for (i, p) in adapter.params_mut().into_iter().enumerate() {
        // params alternate A, B.
        if i % 2 == 1 {
            for v in p.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *v = b_scale * ((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0);
            }
        }
    }
    adapter
}

pub fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 10 + (i * 37 + salt * 101) % 400)
        .collect()
}

/// Every row's logits of `toks` served alone, from an empty cache.
pub fn run_alone(model: &Decoder, toks: &[u32], adapter: Option<&LoraAdapter>) -> Logits {
    let mut cache = model.new_cache();
    model
        .forward(&mut [SeqInput {
            tokens: toks,
            cache: &mut cache,
            all_logits: true,
            adapter,
        }])
        .expect("forward")
        .remove(0)
}

/// Scored flags: every token but each segment's first.
pub fn scored_all(segment_lens: &[usize]) -> Vec<bool> {
    segment_lens
        .iter()
        .flat_map(|&n| std::iter::once(false).chain(std::iter::repeat_n(true, n - 1)))
        .collect()
}

/// The serving forward's log-softmax (and entropy, in f64) of each next token of `toks`, one
/// segment alone, computed from its full logits: the first token a prompt, every later one a sampled
/// token (as `scored_all` marks them), so each row is computed as its decode step was.
pub fn serving_scores(model: &Decoder, toks: &[u32], adapter: Option<&LoraAdapter>) -> TokenScores {
    let logits = run_alone(model, toks, adapter);
    let mut out = TokenScores {
        logprobs: Vec::new(),
        entropies: Vec::new(),
    };
    for t in 1..toks.len() {
        let row = logits.row(t - 1);
        // The server's normalizer (its sampler's logprobs use this function).
        let lse = temper_model::softmax::log_sum_exp(row);
        let entropy: f64 = row
            .iter()
            .map(|&z| {
                let lp = z as f64 - lse;
                -lp.exp() * lp
            })
            .sum();
        out.logprobs
            .push((row[toks[t] as usize] as f64 - lse) as f32);
        out.entropies.push(entropy as f32);
    }
    out
}

/// Max and mean |a - b|.
pub fn diffs(a: &[f32], b: &[f32]) -> (f32, f64) {
    assert_eq!(a.len(), b.len());
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let mean = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .sum::<f64>()
        / a.len() as f64;
    (max, mean)
}

/// Scores two segments packed together and compares them with each segment served alone.
/// Returns the (max, mean) |logprob diff|.
pub fn compare_with_serving(
    model: &Decoder,
    segs: &[Vec<u32>],
    adapter: Option<&LoraAdapter>,
) -> (f32, f64) {
    let toks: Vec<u32> = segs.concat();
    let lens: Vec<usize> = segs.iter().map(Vec::len).collect();
    let scored = scored_all(&lens);
    let packed = PackedSequence {
        tokens: &toks,
        segment_lens: &lens,
        scored: &scored,
    };
    let got = model.score(&packed, adapter).expect("score");
    let mut want = TokenScores {
        logprobs: Vec::new(),
        entropies: Vec::new(),
    };
    for s in segs {
        let w = serving_scores(model, s, adapter);
        want.logprobs.extend(w.logprobs);
        want.entropies.extend(w.entropies);
    }
    let (_, entropy_mean) = diffs(&got.entropies, &want.entropies);
    assert!(entropy_mean < 1e-4, "entropy mean diff {entropy_mean}");
    diffs(&got.logprobs, &want.logprobs)
}

/// Deterministic values in [-1, 1).
pub fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Central differences of `Σ c_t · logprob_t` against the backward, for `samples` entries of
/// every adapter tensor, with `c_t` zero for the first `unweighted` scored tokens.
/// `model` has F32 weights; token ids wrap around its vocabulary.
pub fn check_finite_differences(model: Decoder, lens: &[usize], unweighted: usize, samples: usize) {
    let config = LoraConfig::default();
    check_finite_differences_with_step(model, config, lens, unweighted, samples, 1e-2);
}

/// [`check_finite_differences`] for an adapter of `config`, with central differences of step
/// `eps` (the f32 noise of the differences grows as 1/`eps`, their truncation error as `eps`²).
pub fn check_finite_differences_with_step(
    mut model: Decoder,
    config: LoraConfig,
    lens: &[usize],
    unweighted: usize,
    samples: usize,
    eps: f32,
) {
    // The f16 keys, values and GELU table would make the loss a step function at this scale too.
    model.set_smooth(true);
    let mut adapter = trained_adapter_of(&model, config, 11, 0.1);
    let toks: Vec<u32> = lens
        .iter()
        .enumerate()
        .flat_map(|(i, &n)| tokens(n, 5 + i as u32))
        .map(|t| t % model.config().vocab_size as u32)
        .collect();
    let scored = scored_all(lens);
    let packed = PackedSequence {
        tokens: &toks,
        segment_lens: lens,
        scored: &scored,
    };
    let mut coef = pseudo_random(scored.iter().filter(|&&s| s).count(), 3);
    coef[..unweighted].fill(0.0);
    let loss = |adapter: &LoraAdapter| -> f64 {
        let s = model.score(&packed, Some(adapter)).expect("score");
        s.logprobs
            .iter()
            .zip(&coef)
            .map(|(&l, &c)| l as f64 * c as f64)
            .sum()
    };
    let (_, tape) = model.train_forward(&packed, &adapter).expect("forward");
    let grads = model.backward(tape, &adapter, &coef).expect("backward");

    let num_params = adapter.params().len();
    let mut worst = 0f64;
    let (mut err2, mut norm2) = (0f64, 0f64);
    for p in 0..num_params {
        let len = adapter.params()[p].len();
        for (k, r) in pseudo_random(samples, p as u64 + 100)
            .into_iter()
            .enumerate()
        {
            let i = (((r + 1.0) / 2.0) * len as f32) as usize % len;
            let orig = adapter.params()[p][i];
            adapter.params_mut()[p][i] = orig + eps;
            let up = loss(&adapter);
            adapter.params_mut()[p][i] = orig - eps;
            let down = loss(&adapter);
            adapter.params_mut()[p][i] = orig;
            let fd = (up - down) / (2.0 * eps as f64);
            let an = grads.grads[p][i] as f64;
            // Measured f32 noise of the differences is ~2e-4 (the loss sums 22 f32 logprobs of
            // ~6 nats; its rounding divided by 2·eps); 1e-3 absolute covers it, and 2% relative
            // is far below what a wrong op gives (a factor, a sign, a missing term).
            let excess = (fd - an).abs() / (0.02 * an.abs() + 1e-3);
            if excess > worst {
                worst = excess;
                eprintln!("param {p} entry {i} (sample {k}): fd {fd:.6} backward {an:.6}");
            }
            err2 += (fd - an).powi(2);
            norm2 += an.powi(2);
        }
    }
    let rel = (err2 / norm2).sqrt();
    eprintln!("worst entry at {worst:.2} of its bound, overall relative error {rel:.2e}");
    assert!(norm2.sqrt() > 1e-2, "gradients are suspiciously small");
    assert!(rel < 1e-2, "overall relative error {rel}");
    assert!(worst < 1.0, "an entry is off by {worst:.2} times its bound");
}

/// The index of a row's largest logit (the first of equals).
pub fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0 as u32
}

/// `steps` greedy tokens after `prompt` as the server makes them: the prompt in one forward,
/// then one forward per token through the cache.
pub fn greedy(model: &Decoder, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut cache = model.new_cache();
    let mut input = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..steps {
        let l = model
            .forward(&mut [SeqInput {
                tokens: &input,
                cache: &mut cache,
                all_logits: false,
                adapter: None,
            }])
            .expect("forward");
        let t = argmax(l[0].row(0));
        out.push(t);
        input = vec![t];
    }
    out
}

/// The logits of `a` served alone and served in one batch after `b`: every row of its prompt,
/// then one decode step of `next_a` (beside one step of `next_b`). Returns the (alone, batched)
/// pairs of the prompt's rows and of the step's row.
pub fn alone_and_batched(
    model: &Decoder,
    a: &[u32],
    b: &[u32],
    (next_a, next_b): (u32, u32),
) -> [(Vec<f32>, Vec<f32>); 2] {
    let mut alone = model.new_cache();
    let solo = run_alone_into(model, a, &mut alone, true);
    let (mut ca, mut cb) = (model.new_cache(), model.new_cache());
    let both = model
        .forward(&mut [
            SeqInput {
                tokens: b,
                cache: &mut cb,
                all_logits: false,
                adapter: None,
            },
            SeqInput {
                tokens: a,
                cache: &mut ca,
                all_logits: true,
                adapter: None,
            },
        ])
        .expect("forward");
    let prompt = (solo.data, both[1].data.clone());

    let solo = run_alone_into(model, &[next_a], &mut alone, false);
    let both = model
        .forward(&mut [
            SeqInput {
                tokens: &[next_a],
                cache: &mut ca,
                all_logits: false,
                adapter: None,
            },
            SeqInput {
                tokens: &[next_b],
                cache: &mut cb,
                all_logits: false,
                adapter: None,
            },
        ])
        .expect("forward");
    [prompt, (solo.data, both[0].data.clone())]
}

/// One forward of `toks` into `cache`: every row's logits, or the last's.
pub fn run_alone_into(model: &Decoder, toks: &[u32], cache: &mut SeqCache, all: bool) -> Logits {
    model
        .forward(&mut [SeqInput {
            tokens: toks,
            cache,
            all_logits: all,
            adapter: None,
        }])
        .expect("forward")
        .remove(0)
}

/// A prefix-cache hit as the engine's block manager makes one: `first` served, then a new
/// sequence takes `first`'s full blocks that hold a prefix of `second` (leaving at least its
/// last token to compute) and computes the rest of `second`. Returns the positions found, the
/// rows computed after them, and the same rows of `second` computed from an empty cache.
pub fn prefix_hit_rows(
    model: &Decoder,
    first: &[u32],
    second: &[u32],
) -> (usize, Vec<f32>, Vec<f32>) {
    let mut published = model.new_cache();
    run_alone_into(model, first, &mut published, false);
    let mut reused = SeqCache::new(published.arena().clone());
    for (toks, block) in published.full_blocks() {
        let at = reused.len();
        if at + toks.len() >= second.len() || second[at..at + toks.len()] != *toks {
            break;
        }
        reused.push_full_block(block.clone(), toks);
    }
    let hit = reused.len();
    let cached = run_alone_into(model, &second[hit..], &mut reused, true).data;
    let fresh = run_alone(model, second, None);
    (hit, cached, fresh.data[hit * fresh.vocab..].to_vec())
}

/// The logits rows of `toks` computed in forwards of the given sizes (cycled).
pub fn chunked_rows(model: &Decoder, toks: &[u32], sizes: &[usize]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let mut rows = Vec::new();
    let mut at = 0;
    for &size in sizes.iter().cycle() {
        if at == toks.len() {
            break;
        }
        let end = (at + size).min(toks.len());
        rows.extend(run_alone_into(model, &toks[at..end], &mut cache, true).data);
        at = end;
    }
    rows
}
