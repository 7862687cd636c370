//! A caller-driven training step, the Tinker API's `forward` / `forward_backward`: datums (input
//! tokens and per-position targets with their loss inputs) → per-position logprobs of the targets,
//! the loss's sum, and the adapter's gradient of that sum. The caller accumulates gradients and
//! steps [`crate::AdamW`] with [`crate::adam_step`]. The forward is [`Decoder::train_forward`], the
//! job trainer's: the logprobs are the served ones.

use temper_model::{Decoder, LoraAdapter, PackedSequence};

use crate::trainer::pack;
use crate::TrainError;

/// A built-in loss and its settings. Per position `i` with sampler logprob `q_i`, advantage
/// `A_i`, weight `w_i` and the model's logprob `p_i` of the target, summed over positions and
/// datums (Tinker's definitions):
/// - `CrossEntropy`: `-w_i · p_i`;
/// - `ImportanceSampling`: `-exp(p_i - q_i) · A_i`;
/// - `Ppo`: `-min(r_i · A_i, clip(r_i, low, high) · A_i)` with `r_i = exp(p_i - q_i)`;
/// - `Cispo`: `-sg(clip(r_i, low, high)) · A_i · p_i` (the ratio carries no gradient).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepLoss {
    CrossEntropy,
    ImportanceSampling,
    Ppo { clip_low: f64, clip_high: f64 },
    Cispo { clip_low: f64, clip_high: f64 },
}

impl StepLoss {
    /// Whether the loss reads `weights` (else `logprobs` and `advantages`).
    pub fn uses_weights(self) -> bool {
        matches!(self, StepLoss::CrossEntropy)
    }

    /// The loss at one position and its derivative with respect to the model's logprob `p`.
    fn at(self, p: f64, weight: f64, old: f64, advantage: f64) -> (f64, f64) {
        match self {
            StepLoss::CrossEntropy => (-weight * p, -weight),
            StepLoss::ImportanceSampling => {
                let r = (p - old).exp();
                (-r * advantage, -r * advantage)
            }
            StepLoss::Ppo {
                clip_low,
                clip_high,
            } => {
                let r = (p - old).exp();
                let unclipped = r * advantage;
                let clipped = r.clamp(clip_low, clip_high) * advantage;
                if unclipped <= clipped {
                    (-unclipped, -r * advantage)
                } else {
                    // The clipped term is constant in p outside the range.
                    let inside = clip_low < r && r < clip_high;
                    (-clipped, if inside { -r * advantage } else { 0.0 })
                }
            }
            StepLoss::Cispo {
                clip_low,
                clip_high,
            } => {
                let c = (p - old).exp().clamp(clip_low, clip_high);
                (-c * advantage * p, -c * advantage)
            }
        }
    }
}

/// One training example: `tokens` is the model input; position `i` predicts `tokens[i + 1]`, and
/// the last position predicts `last_target`. `weights` (cross-entropy), or `old_logprobs` and
/// `advantages` (the policy losses), have one value per position.
#[derive(Debug, Clone, PartialEq)]
pub struct StepDatum {
    pub tokens: Vec<u32>,
    pub last_target: u32,
    pub weights: Vec<f32>,
    pub old_logprobs: Vec<f32>,
    pub advantages: Vec<f32>,
}

impl StepDatum {
    fn len(&self) -> usize {
        self.tokens.len()
    }
}

/// What a step returns.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// Per datum, per position: the model's logprob of that position's target.
    pub logprobs: Vec<Vec<f32>>,
    /// The loss summed over every datum's positions.
    pub loss_sum: f64,
    /// d `loss_sum` / d adapter parameters (parallel to `LoraAdapter::params`); `None` for a
    /// forward only.
    pub grads: Option<Vec<Vec<f32>>>,
}

/// Runs `data` through the model with `adapter` (packed into sequences of at most
/// `max_seq_len` tokens, each datum its own segment) and, with `backward`, the gradient of the
/// loss's sum. A datum longer than `max_seq_len` is refused (`data[i]` names it).
pub fn forward_backward(
    model: &Decoder,
    adapter: &LoraAdapter,
    data: &[StepDatum],
    loss: StepLoss,
    backward: bool,
    max_seq_len: usize,
) -> Result<StepOutput, TrainError> {
    for (i, d) in data.iter().enumerate() {
        let n = d.len();
        if n == 0 {
            return Err(TrainError::invalid(
                format!("data[{i}].model_input"),
                "the model input has no tokens",
            ));
        }
        if n + 1 > max_seq_len {
            return Err(TrainError::invalid(
                format!("data[{i}].model_input"),
                format!(
                    "{n} tokens (and the last target) are more than this server's longest \
                     training sequence, {max_seq_len} tokens"
                ),
            ));
        }
        let inputs: &[&[f32]] = if loss.uses_weights() {
            &[&d.weights]
        } else {
            &[&d.old_logprobs, &d.advantages]
        };
        if inputs.iter().any(|v| v.len() != n) {
            return Err(TrainError::invalid(
                format!("data[{i}].loss_fn_inputs"),
                format!("every loss input must have one value per input token ({n})"),
            ));
        }
    }
    let mut logprobs = Vec::with_capacity(data.len());
    let mut loss_sum = 0.0;
    let mut grads: Option<Vec<Vec<f32>>> = None;
    for members in pack(data.iter().map(|d| d.len() + 1), max_seq_len) {
        let mut tokens = Vec::new();
        let mut scored = Vec::new();
        let mut segment_lens = Vec::new();
        for &i in &members {
            let d = &data[i];
            tokens.extend(&d.tokens);
            tokens.push(d.last_target);
            scored.push(false);
            scored.extend(std::iter::repeat_n(true, d.len()));
            segment_lens.push(d.len() + 1);
        }
        let seq = PackedSequence {
            tokens: &tokens,
            segment_lens: &segment_lens,
            scored: &scored,
        };
        // Each scored token's loss inputs, in the packed order: the loss at a token follows from
        // its logprob (so an LM-head pair's backward runs in the forward).
        let inputs: Vec<(f64, f64, f64)> = members
            .iter()
            .flat_map(|&i| {
                let d = &data[i];
                (0..d.len()).map(move |j| {
                    if loss.uses_weights() {
                        (f64::from(d.weights[j]), 0.0, 0.0)
                    } else {
                        (
                            0.0,
                            f64::from(d.old_logprobs[j]),
                            f64::from(d.advantages[j]),
                        )
                    }
                })
            })
            .collect();
        let at = |i: usize, p: f32| {
            let (weight, old, advantage) = inputs[i];
            loss.at(f64::from(p), weight, old, advantage)
        };
        let dlogp = |i: usize, p: f32| at(i, p).1 as f32;
        let (scores, tape) = if backward {
            let (scores, tape) = model.train_forward_pointwise(&seq, adapter, &dlogp)?;
            (scores, Some(tape))
        } else {
            (model.score(&seq, Some(adapter))?, None)
        };
        let mut dlogprobs = Vec::with_capacity(scores.logprobs.len());
        for (i, &p) in scores.logprobs.iter().enumerate() {
            let (l, dl) = at(i, p);
            loss_sum += l;
            dlogprobs.push(dl as f32);
        }
        let mut start = 0;
        for &i in &members {
            logprobs.push(scores.logprobs[start..start + data[i].len()].to_vec());
            start += data[i].len();
        }
        if let Some(tape) = tape {
            let pack_grads = model.backward(tape, adapter, &dlogprobs)?.grads;
            match &mut grads {
                None => grads = Some(pack_grads),
                Some(sum) => add_grads(sum, &pack_grads),
            }
        }
    }
    // `pack` keeps the order: the logprobs are per datum, in order.
    Ok(StepOutput {
        logprobs,
        loss_sum,
        grads,
    })
}

/// `sum += g`, parameter by parameter.
pub fn add_grads(sum: &mut [Vec<f32>], g: &[Vec<f32>]) {
    for (s, g) in sum.iter_mut().zip(g) {
        s.iter_mut().zip(g).for_each(|(s, x)| *s += x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_and_their_gradients() {
        let num = |f: &dyn Fn(f64) -> f64, p: f64| (f(p + 1e-6) - f(p - 1e-6)) / 2e-6;
        for loss in [
            StepLoss::CrossEntropy,
            StepLoss::ImportanceSampling,
            StepLoss::Ppo {
                clip_low: 0.8,
                clip_high: 1.2,
            },
            StepLoss::Cispo {
                clip_low: 0.8,
                clip_high: 1.2,
            },
        ] {
            for (p, old, a) in [(-1.0, -1.1, 0.7), (-2.0, -1.0, -0.5), (-0.5, -0.9, 1.0)] {
                let (_, d) = loss.at(p, 0.5, old, a);
                let f = |p: f64| loss.at(p, 0.5, old, a).0;
                let expected = match loss {
                    // The ratio is detached: only p's own factor.
                    StepLoss::Cispo { .. } => -(p - old).exp().clamp(0.8, 1.2) * a,
                    _ => num(&f, p),
                };
                assert!(
                    (d - expected).abs() < 1e-5,
                    "{loss:?} {p} {old} {a}: {d} {expected}"
                );
            }
        }
        assert_eq!(StepLoss::CrossEntropy.at(-2.0, 0.5, 0.0, 0.0), (1.0, -0.5));
    }
}
