//! Logits processors that run before the sampler, in vLLM's order: the structured-output mask,
//! allowed_token_ids, bad_words, min_tokens masking, logit_bias, then repetition / frequency /
//! presence penalties. Everything
//! per request is prepared once at submission; per token only the touched entries are written
//! (seen tokens, biased tokens, banned tokens) on top of one copy of the raw row into a reused
//! buffer. Logprobs are taken from the raw row, never from this one.

use std::collections::HashMap;

use temper_text::Tokenizer;

use crate::structured::{masked_copy, TokenMask};
use crate::{RepetitionDetection, SamplingParams, StopParams};

/// What a request asks of the processors, prepared once and shared by its choices.
#[derive(Debug, Default)]
pub(crate) struct Processors {
    /// Sorted, deduplicated; `None` = every token allowed.
    allowed: Option<Vec<u32>>,
    /// Each bad word as token ids (both spellings, deduplicated, never empty).
    bad_words: Vec<Vec<u32>>,
    min_tokens: usize,
    /// Tokens masked while fewer than `min_tokens` were generated: the ones that would stop.
    stop_ids: Vec<u32>,
    logit_bias: Vec<(u32, f32)>,
    repetition_penalty: f32,
    frequency_penalty: f32,
    presence_penalty: f32,
    /// Distinct prompt tokens, sorted; only kept when the repetition penalty is on.
    prompt_tokens: Vec<u32>,
}

/// One choice's output so far, kept incrementally for penalties, bad words and repetition
/// detection.
#[derive(Clone, Debug, Default)]
pub(crate) struct History {
    pub(crate) output: Vec<u32>,
    /// Occurrences of each token in `output`.
    counts: HashMap<u32, u32>,
}

impl History {
    pub(crate) fn push(&mut self, token: u32) {
        self.output.push(token);
        *self.counts.entry(token).or_insert(0) += 1;
    }
}

impl Processors {
    /// `end_tokens` are the tokens that end generation like EOS (masked by min_tokens unless
    /// `ignore_eos`).
    pub(crate) fn new(
        sampling: &SamplingParams,
        stopping: &StopParams,
        prompt: &[u32],
        tokenizer: &Tokenizer,
        end_tokens: &[u32],
    ) -> Self {
        let allowed = sampling.allowed_token_ids.as_ref().map(|ids| {
            let mut ids = ids.clone();
            ids.sort_unstable();
            ids.dedup();
            ids
        });
        let mut bad_words: Vec<Vec<u32>> = Vec::new();
        for word in &sampling.bad_words {
            let word = word.trim_start();
            // vLLM's rule: the word as written and after a space, since a leading space usually
            // changes the first token.
            for text in [word.to_owned(), format!(" {word}")] {
                let ids = tokenizer.encode(&text, true);
                if !ids.is_empty() && !bad_words.contains(&ids) {
                    bad_words.push(ids);
                }
            }
        }
        let mut stop_ids: Vec<u32> = Vec::new();
        if stopping.min_tokens > 0 {
            if !stopping.ignore_eos {
                stop_ids.extend_from_slice(end_tokens);
            }
            stop_ids.extend_from_slice(&stopping.stop_token_ids);
            stop_ids.sort_unstable();
            stop_ids.dedup();
        }
        let mut prompt_tokens = Vec::new();
        if sampling.repetition_penalty != 1.0 {
            prompt_tokens = prompt.to_vec();
            prompt_tokens.sort_unstable();
            prompt_tokens.dedup();
        }
        Processors {
            allowed,
            bad_words,
            min_tokens: stopping.min_tokens,
            stop_ids,
            logit_bias: sampling
                .logit_bias
                .iter()
                .map(|&(t, b)| (t, b.clamp(-100.0, 100.0)))
                .collect(),
            repetition_penalty: sampling.repetition_penalty,
            frequency_penalty: sampling.frequency_penalty,
            presence_penalty: sampling.presence_penalty,
            prompt_tokens,
        }
    }

    fn active(&self, hist: &History, grammar: Option<&TokenMask>) -> bool {
        grammar.is_some()
            || self.allowed.is_some()
            || !self.bad_words.is_empty()
            || (hist.output.len() < self.min_tokens && !self.stop_ids.is_empty())
            || !self.logit_bias.is_empty()
            || self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// Writes the processed row into `out` and returns true, or returns false (leaving `out`
    /// alone) when nothing would change the raw row. `grammar`: the structured-output mask of
    /// this step. Token ids outside the row are skipped.
    pub(crate) fn apply(
        &self,
        raw: &[f32],
        hist: &History,
        grammar: Option<&TokenMask>,
        out: &mut Vec<f32>,
    ) -> bool {
        if !self.active(hist, grammar) {
            return false;
        }
        out.clear();
        match (&self.allowed, grammar) {
            // The allowed set is usually small: start from all-masked and copy it in.
            (Some(ids), _) => {
                out.resize(raw.len(), f32::NEG_INFINITY);
                for &t in ids {
                    if let Some(&l) = raw.get(t as usize) {
                        if grammar.is_none_or(|m| m.is_allowed(t)) {
                            out[t as usize] = l;
                        }
                    }
                }
            }
            (None, Some(mask)) => masked_copy(raw, mask, out),
            (None, None) => out.extend_from_slice(raw),
        }
        let mut set = |t: u32, f: &dyn Fn(f32) -> f32| {
            if let Some(l) = out.get_mut(t as usize) {
                *l = f(*l);
            }
        };
        for word in &self.bad_words {
            if let Some((&last, prefix)) = word.split_last() {
                if hist.output.ends_with(prefix) {
                    set(last, &|_| f32::NEG_INFINITY);
                }
            }
        }
        if hist.output.len() < self.min_tokens {
            for &t in &self.stop_ids {
                set(t, &|_| f32::NEG_INFINITY);
            }
        }
        for &(t, b) in &self.logit_bias {
            set(t, &|l| l + b);
        }
        let rp = self.repetition_penalty;
        if rp != 1.0 {
            let penalize = |l: f32| if l > 0.0 { l / rp } else { l * rp };
            for &t in &self.prompt_tokens {
                set(t, &penalize);
            }
            for &t in hist.counts.keys() {
                if self.prompt_tokens.binary_search(&t).is_err() {
                    set(t, &penalize);
                }
            }
        }
        let (fp, pp) = (self.frequency_penalty, self.presence_penalty);
        if fp != 0.0 || pp != 0.0 {
            for (&t, &c) in &hist.counts {
                set(t, &|l| l - fp * c as f32 - pp);
            }
        }
        true
    }
}

/// vLLM's check: the output's tail is one pattern of a length in [min, max] repeated
/// `min_count` times (shorter patterns tried first).
pub(crate) fn repeats(output: &[u32], p: &RepetitionDetection) -> bool {
    let min = p.min_pattern_size.max(1);
    if p.max_pattern_size == 0 || p.min_count < 2 || min > p.max_pattern_size {
        return false;
    }
    for len in min..=p.max_pattern_size {
        let Some(span) = len.checked_mul(p.min_count) else {
            return false;
        };
        if span > output.len() {
            return false;
        }
        let tail = &output[output.len() - span..];
        let (first, rest) = tail.split_at(len);
        if rest.chunks(len).all(|c| c == first) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn procs(f: impl FnOnce(&mut Processors)) -> Processors {
        let mut p = Processors {
            repetition_penalty: 1.0,
            ..Processors::default()
        };
        f(&mut p);
        p
    }

    fn hist(output: &[u32]) -> History {
        let mut h = History::default();
        for &t in output {
            h.push(t);
        }
        h
    }

    fn run(p: &Processors, raw: &[f32], output: &[u32]) -> Vec<f32> {
        let mut out = vec![7.0; 3];
        assert!(p.apply(raw, &hist(output), None, &mut out));
        out
    }

    const NEG: f32 = f32::NEG_INFINITY;

    #[test]
    fn nothing_active_leaves_the_raw_row() {
        let p = procs(|_| {});
        let mut out = Vec::new();
        assert!(!p.apply(&[1.0, 2.0], &hist(&[0, 1]), None, &mut out));
        // min_tokens with nothing to mask is not active either.
        let p = procs(|p| p.min_tokens = 5);
        assert!(!p.apply(&[1.0, 2.0], &hist(&[]), None, &mut out));
    }

    #[test]
    fn allowed_token_ids_mask_everything_else() {
        let p = procs(|p| p.allowed = Some(vec![1, 3]));
        assert_eq!(
            run(&p, &[1.0, 2.0, 3.0, 4.0], &[]),
            vec![NEG, 2.0, NEG, 4.0]
        );
    }

    #[test]
    fn bad_words_ban_the_last_token_after_their_prefix() {
        let p = procs(|p| p.bad_words = vec![vec![2], vec![0, 1, 3]]);
        let raw = [1.0, 1.0, 1.0, 1.0];
        // One-token words always; the 3-token word only after "0 1".
        assert_eq!(run(&p, &raw, &[]), vec![1.0, 1.0, NEG, 1.0]);
        assert_eq!(run(&p, &raw, &[1, 0]), vec![1.0, 1.0, NEG, 1.0]);
        assert_eq!(run(&p, &raw, &[3, 0, 1]), vec![1.0, 1.0, NEG, NEG]);
    }

    #[test]
    fn min_tokens_masks_stop_tokens_until_reached() {
        let p = procs(|p| {
            p.min_tokens = 2;
            p.stop_ids = vec![0, 2];
        });
        let raw = [5.0, 1.0, 5.0];
        assert_eq!(run(&p, &raw, &[1]), vec![NEG, 1.0, NEG]);
        let mut out = Vec::new();
        assert!(!p.apply(&raw, &hist(&[1, 1]), None, &mut out));
    }

    #[test]
    fn logit_bias_adds_sparse_and_is_clamped() {
        let p = Processors::new(
            &SamplingParams {
                logit_bias: vec![(1, 500.0), (2, -3.0)],
                ..SamplingParams::default()
            },
            &StopParams::default(),
            &[],
            &tiny_tokenizer(),
            &[],
        );
        assert_eq!(run(&p, &[1.0, 1.0, 1.0], &[]), vec![1.0, 101.0, -2.0]);
    }

    #[test]
    fn penalties_follow_vllm() {
        // Repetition: prompt token 0 and output token 2; positive divided, negative multiplied.
        let p = procs(|p| {
            p.repetition_penalty = 2.0;
            p.prompt_tokens = vec![0];
        });
        assert_eq!(
            run(&p, &[4.0, 4.0, -4.0, 4.0], &[2, 2]),
            vec![2.0, 4.0, -8.0, 4.0]
        );
        // Frequency and presence: output only, count-weighted and once.
        let p = procs(|p| {
            p.frequency_penalty = 0.5;
            p.presence_penalty = 1.0;
            p.prompt_tokens = vec![0];
        });
        assert_eq!(
            run(&p, &[4.0, 4.0, 4.0, 4.0], &[2, 2, 3]),
            vec![4.0, 4.0, 2.0, 2.5]
        );
        // Negative values encourage repeats.
        let p = procs(|p| p.presence_penalty = -2.0);
        assert_eq!(run(&p, &[0.0, 0.0], &[1]), vec![0.0, 2.0]);
    }

    #[test]
    fn order_is_masks_then_bias_then_penalties() {
        // Bias before the repetition penalty: (1 + 3) / 2 = 2, not 1 / 2 + 3.
        let p = procs(|p| {
            p.logit_bias = vec![(0, 3.0), (1, 50.0)];
            p.repetition_penalty = 2.0;
            p.allowed = Some(vec![0, 2]);
        });
        // Token 1 is masked before its bias: a bias cannot undo a mask.
        assert_eq!(run(&p, &[1.0, 1.0, 1.0], &[0]), vec![2.0, NEG, 1.0]);
    }

    #[test]
    fn the_sampler_sees_the_processed_row() {
        // Raw favourite 0; a bias lifts 2 above it and top_k 1 (after the bias) keeps only 2.
        let p = procs(|p| p.logit_bias = vec![(2, 5.0)]);
        let raw = [3.0, 1.0, 0.0, 2.0];
        let mut out = Vec::new();
        assert!(p.apply(&raw, &hist(&[]), None, &mut out));
        let mut s = crate::sampler::Sampler::default();
        let mut rng = crate::rng::Rng::new(1);
        let params = SamplingParams {
            top_k: 1,
            ..SamplingParams::default()
        };
        for _ in 0..20 {
            assert_eq!(s.sample(&out, &params, &mut rng), 2);
        }
    }

    #[test]
    fn repetition_detection_finds_the_tail_pattern() {
        let rd = |min, max, count| RepetitionDetection {
            min_pattern_size: min,
            max_pattern_size: max,
            min_count: count,
        };
        assert!(repeats(&[9, 1, 2, 1, 2, 1, 2], &rd(2, 2, 3)));
        assert!(!repeats(&[9, 1, 2, 1, 2, 1, 2], &rd(2, 2, 4)));
        // Pattern length outside [min, max].
        assert!(!repeats(&[1, 2, 3, 1, 2, 3], &rd(1, 2, 2)));
        assert!(repeats(&[1, 2, 3, 1, 2, 3], &rd(0, 3, 2)));
        // Only the tail counts.
        assert!(!repeats(&[5, 5, 5, 6], &rd(1, 1, 3)));
        assert!(repeats(&[5, 5, 5], &rd(1, 1, 3)));
        // Disabled.
        assert!(!repeats(&[5, 5, 5], &rd(0, 0, 3)));
    }

    /// Per-token cost on Gemma 3's vocabulary (a measurement, not a check):
    /// `cargo test --release -p temper-engine -- --ignored --nocapture processing_cost`.
    #[test]
    #[ignore]
    fn processing_cost_on_a_262k_row() {
        let v = 262_144;
        let mut lrng = crate::rng::Rng::new(3);
        let raw: Vec<f32> = (0..v)
            .map(|_| lrng.next_f64() as f32 * 20.0 - 10.0)
            .collect();
        let output: Vec<u32> = (0..512).map(|i| (i * 7919) % v as u32).collect();
        let h = hist(&output);
        let prompt: Vec<u32> = (0..2048).map(|i| (i * 104_729) % v as u32).collect();
        let cases: Vec<(&str, Processors)> = vec![
            ("none (raw row)", procs(|_| {})),
            (
                "logit_bias x100",
                procs(|p| p.logit_bias = (0..100).map(|i| (i * 31, 1.0)).collect()),
            ),
            (
                "allowed_token_ids x1000",
                procs(|p| p.allowed = Some((0..1000).map(|i| i * 97).collect())),
            ),
            (
                "penalties (2048-token prompt, 512 output)",
                procs(|p| {
                    p.repetition_penalty = 1.1;
                    p.frequency_penalty = 0.5;
                    p.presence_penalty = 0.5;
                    p.prompt_tokens = prompt.clone();
                    p.prompt_tokens.sort_unstable();
                    p.prompt_tokens.dedup();
                }),
            ),
            (
                "bad_words x20",
                procs(|p| p.bad_words = (0..20).map(|i| vec![i, i + 1, i + 2]).collect()),
            ),
        ];
        let mut sampler = crate::sampler::Sampler::default();
        let params = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 50,
            ..SamplingParams::default()
        };
        let mut out = Vec::new();
        let mut rng = crate::rng::Rng::new(1);
        for (name, p) in &cases {
            let n = 200;
            let t0 = std::time::Instant::now();
            for _ in 0..n {
                let row: &[f32] = if p.apply(&raw, &h, None, &mut out) {
                    &out
                } else {
                    &raw
                };
                std::hint::black_box(row[0]);
            }
            let proc_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
            let t0 = std::time::Instant::now();
            for _ in 0..n {
                let row: &[f32] = if p.apply(&raw, &h, None, &mut out) {
                    &out
                } else {
                    &raw
                };
                std::hint::black_box(sampler.sample(row, &params, &mut rng));
            }
            let total_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
            println!(
                "{name}: processors {proc_us:.0} µs, with sampling {total_us:.0} µs per token"
            );
        }
    }

    fn tiny_tokenizer() -> Tokenizer {
        let dir = std::env::temp_dir().join(format!("temper-logits-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tiny.gguf");
        temper_model::tiny::write_tiny_gguf(&path, 7).expect("tiny model");
        let loaded = temper_model::load_gguf(&path).expect("load");
        let _ = std::fs::remove_dir_all(&dir);
        Tokenizer::from_gguf_metadata(&loaded.metadata).expect("tokenizer")
    }
}
