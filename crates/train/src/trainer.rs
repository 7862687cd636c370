//! Advantages, the loss of a sequence's trained tokens and its gradient, packing, AdamW: the
//! LoRA optimisation loop (training.md "Advantages", "Loss per trainable token",
//! "Optimisation").

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;
use serde::Serialize;
use temper_model::{Decoder, LoraAdapter, LoraConfig, PackedSequence};

use crate::request::{ImportanceSamplingLevel, LossConfig};
use crate::tokenize::{TokenizedJob, TokenizedSftJob};
use crate::TrainError;

/// Server-side trainer settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainerConfig {
    pub lora: LoraConfig,
    /// Longest packed sequence; a job with a longer trajectory fails (see
    /// `TokenizedJob::check_lengths`, which the HTTP edge runs before accepting it).
    pub max_seq_len: usize,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            lora: LoraConfig::default(),
            max_seq_len: 2048,
        }
    }
}

/// `gradient_step` event data (training.md).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepMetrics {
    pub step: usize,
    pub loss: f64,
    pub policy_loss: f64,
    pub entropy: f64,
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub reward: f64,
    pub reward_std_dev: f64,
    pub num_trajectories: usize,
    pub num_trainable_tokens: usize,
    pub num_groups_submitted: usize,
    pub num_groups_trainable: usize,
    /// Correlation of the sampler's token probabilities with the trainer's; left out with fewer
    /// than two tokens or no spread (the agent library reads every `gradient_step` value as a
    /// float, so a `null` would break its training loop).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probs_corr: Option<f64>,
}

/// `gradient_step` event data of an SFT job: one step per batch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SftStepMetrics {
    pub step: usize,
    /// Mean negative log-likelihood of the batch's trainable tokens (before the step).
    pub loss: f64,
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub num_trajectories: usize,
    pub num_trainable_tokens: usize,
    /// 1-based.
    pub epoch: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TrainEvent {
    /// `num_sequences`: the optimizer steps to come.
    Started {
        num_sequences: usize,
    },
    GradientStep(StepMetrics),
    SftStep(SftStepMetrics),
    /// `step`: gradient steps taken; `message` says why nothing was learned, if so.
    Ended {
        step: i64,
        message: Option<String>,
    },
}

const BETAS: (f64, f64) = (0.9, 0.99);
const WEIGHT_DECAY: f64 = 0.1;
const ADAM_EPS: f64 = 1e-8;
const MAX_GRAD_NORM: f64 = 0.1;

/// Per group: `A_i = r_i - mean`, divided by `std + 1e-6` with `scale_rewards`.
pub fn group_advantages(rewards: &[f64], scale_rewards: bool) -> Vec<f64> {
    let n = rewards.len() as f64;
    let mu = rewards.iter().sum::<f64>() / n;
    let sigma = (rewards.iter().map(|r| (r - mu).powi(2)).sum::<f64>() / n).sqrt();
    rewards
        .iter()
        .map(|r| {
            let a = r - mu;
            if scale_rewards {
                a / (sigma + 1e-6)
            } else {
                a
            }
        })
        .collect()
}

/// `advantage_balance` b: b > 0 scales negative advantages by (1 - b), b < 0 positive ones by
/// (1 + b).
fn balance(advantage: f64, b: f64) -> f64 {
    if b > 0.0 && advantage < 0.0 {
        advantage * (1.0 - b)
    } else if b < 0.0 && advantage > 0.0 {
        advantage * (1.0 + b)
    } else {
        advantage
    }
}

/// Per sequence, given (its trajectory, its trainable tokens, its advantage): the token weight
/// and the advantage to train with. Each trajectory's tokens weigh 1 / (its trainable tokens,
/// additional histories included), renormalised to mean 1 over all trainable tokens; then
/// A /= mean(|A| * w) over them.
fn weights_and_advantages(seqs: &[((usize, usize), usize, f64)]) -> Vec<(f64, f64)> {
    let mut per_trajectory: std::collections::HashMap<(usize, usize), usize> = Default::default();
    for &(trajectory, trainable, _) in seqs {
        *per_trajectory.entry(trajectory).or_default() += trainable;
    }
    let total: usize = seqs.iter().map(|s| s.1).sum();
    let weight_scale = total as f64 / per_trajectory.len() as f64;
    let weighted: Vec<(f64, f64)> = seqs
        .iter()
        .map(|(trajectory, _, a)| (weight_scale / per_trajectory[trajectory] as f64, *a))
        .collect();
    let abs_mean = seqs
        .iter()
        .zip(&weighted)
        .map(|((_, n, _), (w, a))| a.abs() * w * *n as f64)
        .sum::<f64>()
        / total as f64;
    weighted
        .into_iter()
        .map(|(w, a)| (w, a / abs_mean))
        .collect()
}

/// The losses of one sequence's trained tokens, each with d (the sequence's summed loss) /
/// d lp_new of that token, before the token weight and the `1 / (sum(mask) + 1e-6)`
/// normalisation. `lp_old[j]` is the sampler's logprob, or `lp_new[j]` where it gave none (the
/// detached value: d = 0, still with gradient 1).
///
/// Below the token level the ratio of every token depends on every lp_new of its sequence
/// through the mean of d, so PPO's loss is not separable: token j's gradient is its own term
/// plus `sum_i dL_i/drho_i * drho_i/dlp_j` over the sequence. At the token level that sum is
/// zero and is not added, so the result is exactly the per-token formula's.
pub fn sequence_loss(
    lp_new: &[f64],
    lp_old: &[f64],
    advantage: f64,
    cfg: &LossConfig,
) -> Vec<(f64, f64)> {
    let n = lp_new.len() as f64;
    let d: Vec<f64> = lp_new
        .iter()
        .zip(lp_old)
        .map(|(new, old)| new - old)
        .collect();
    let sequence_ratio = (d.iter().sum::<f64>() / n).exp();
    let (lo, hi) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high);
    let mut out = Vec::with_capacity(d.len());
    // sum_i dL_i/drho_i * (the part of drho_i/dlp_j that is the same for every j).
    let mut shared = 0.0;
    for (&lp, &d) in lp_new.iter().zip(&d) {
        let token_ratio = d.exp();
        // rho, d rho / d (this token's lp_new), and d rho / d (each lp_new of the sequence)
        // through the mean; the derivatives are zero where rho is replaced by a constant.
        let (mut rho, mut own, mut each) = match cfg.importance_sampling_level {
            ImportanceSamplingLevel::Token => (token_ratio, token_ratio, 0.0),
            ImportanceSamplingLevel::Sequence => (sequence_ratio, 0.0, sequence_ratio / n),
            ImportanceSamplingLevel::Average => (
                (token_ratio + sequence_ratio) / 2.0,
                token_ratio / 2.0,
                sequence_ratio / (2.0 * n),
            ),
            ImportanceSamplingLevel::GeometricAverage => {
                let rho = token_ratio.sqrt() * sequence_ratio.sqrt();
                (rho, rho / 2.0, rho / (2.0 * n))
            }
        };
        // training.md caps rho only on tokens with A < 0, as the option's name says; the
        // openpipe-art library's loss caps every token's ratio. We keep training.md's rule.
        if let Some(w) = cfg.max_negative_is_weight {
            if advantage < 0.0 && rho > w {
                (rho, own, each) = (w, 0.0, 0.0);
            }
        }
        if cfg.mask_prob_ratio && !(lo < rho && rho < hi) {
            (rho, own, each) = (0.0, 0.0, 0.0);
        }
        let a = match cfg.alt_k2_tau {
            Some(tau) => advantage - tau * d,
            None => advantage,
        };
        let clipped = rho.clamp(lo, hi);
        if cfg.ppo {
            let unclipped_term = rho * a;
            let clipped_term = clipped * a;
            // The min's value and d L / d rho, none where the min is the clipped term outside
            // the range (a constant; rho itself may be infinite there).
            let (loss, dloss_drho) = if unclipped_term <= clipped_term {
                (-unclipped_term, Some(-a))
            } else if lo < rho && rho < hi {
                (-clipped_term, Some(-a))
            } else {
                (-clipped_term, None)
            };
            match dloss_drho {
                Some(g) => {
                    out.push((loss, g * own));
                    shared += g * each;
                }
                None => out.push((loss, 0.0)),
            }
        } else {
            // CISPO: the ratio is detached, only lp_new's factor carries the gradient.
            out.push((-clipped * a * lp, -clipped * a));
        }
    }
    if cfg.importance_sampling_level != ImportanceSamplingLevel::Token {
        for (_, grad) in &mut out {
            *grad += shared;
        }
    }
    out
}

/// One sequence ready to train: tokens, mask, old logprobs, per-token weight and advantage.
struct Prepared {
    tokens: Vec<u32>,
    mask: Vec<bool>,
    old: Vec<f32>,
    /// Tokens with mask 1.
    trainable: usize,
    weight: f64,
    advantage: f64,
}

/// The trainer's AdamW state (f64 moments) for one adapter's parameters; [`apply_gradients`]
/// (a job's fixed settings) and [`crate::adam_step`] (a caller's [`AdamParams`]) step it. Public
/// for `temper bench`, which times a step as a job takes it.
#[derive(Clone)]
pub struct AdamW {
    m: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    t: i32,
}

/// One AdamW step's settings: decoupled weight decay (`x -= lr * (update + weight_decay * x)`);
/// `grad_clip_norm` > 0 clips the gradient's global norm to it first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamParams {
    pub learning_rate: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub grad_clip_norm: f64,
}

impl AdamParams {
    /// A job's settings at `learning_rate` (training.md "Optimisation").
    pub fn job(learning_rate: f64) -> Self {
        AdamParams {
            learning_rate,
            beta1: BETAS.0,
            beta2: BETAS.1,
            eps: ADAM_EPS,
            weight_decay: WEIGHT_DECAY,
            grad_clip_norm: MAX_GRAD_NORM,
        }
    }
}

impl AdamW {
    pub fn new(adapter: &LoraAdapter) -> Self {
        let zeros: Vec<Vec<f64>> = adapter
            .params()
            .iter()
            .map(|p| vec![0.0; p.len()])
            .collect();
        AdamW {
            m: zeros.clone(),
            v: zeros,
            t: 0,
        }
    }

    /// Steps taken.
    pub fn steps(&self) -> i32 {
        self.t
    }

    fn step(&mut self, adapter: &mut LoraAdapter, grads: &[Vec<f32>], scale: f64, p: &AdamParams) {
        self.t += 1;
        let (b1, b2) = (p.beta1, p.beta2);
        let (c1, c2) = (1.0 - b1.powi(self.t), 1.0 - b2.powi(self.t));
        // Every tensor's values in pieces, all pieces in parallel (each value's update is its
        // own: the same bits in any order).
        let mut pieces = Vec::new();
        for (((x, g), m), v) in adapter
            .params_mut()
            .into_iter()
            .zip(grads)
            .zip(&mut self.m)
            .zip(&mut self.v)
            // An empty gradient: a frozen tensor (see `adam_step`).
            .filter(|(((_, g), _), _)| !g.is_empty())
        {
            let g = &g[..x.len()];
            pieces.extend(
                x.chunks_mut(VALUES_PER_TASK)
                    .zip(g.chunks(VALUES_PER_TASK))
                    .zip(m.chunks_mut(VALUES_PER_TASK))
                    .zip(v.chunks_mut(VALUES_PER_TASK)),
            );
        }
        pieces.into_par_iter().for_each(|(((x, g), m), v)| {
            for i in 0..x.len() {
                let g = f64::from(g[i]) * scale;
                m[i] = b1 * m[i] + (1.0 - b1) * g;
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                let w = f64::from(x[i]);
                let update = (m[i] / c1) / ((v[i] / c2).sqrt() + p.eps);
                x[i] = (w - p.learning_rate * (update + p.weight_decay * w)) as f32;
            }
        });
    }
}

/// Packs sequences of these lengths, in order, into packs of at most `max_len` tokens: a
/// sequence joins the current pack while it fits.
pub(crate) fn pack(lens: impl IntoIterator<Item = usize>, max_len: usize) -> Vec<Vec<usize>> {
    let mut packs: Vec<Vec<usize>> = Vec::new();
    let mut len = 0;
    for (i, n) in lens.into_iter().enumerate() {
        match packs.last_mut() {
            Some(pack) if len + n <= max_len => pack.push(i),
            _ => {
                packs.push(vec![i]);
                len = 0;
            }
        }
        len += n;
    }
    packs
}

/// Clips the gradient to `MAX_GRAD_NORM` and takes one AdamW step; returns the gradient's norm
/// before clipping. `step` (1-based) names a diverged step.
pub fn apply_gradients(
    optimizer: &mut AdamW,
    adapter: &mut LoraAdapter,
    grads: &[Vec<f32>],
    learning_rate: f64,
    step: usize,
) -> Result<f64, TrainError> {
    adam_step(
        optimizer,
        adapter,
        grads,
        &AdamParams::job(learning_rate),
        step,
    )
}

/// Values of the adapter per task of the AdamW step (its update and its gradient's norm).
const VALUES_PER_TASK: usize = 16 * 1024;

/// One AdamW step with `params`, the gradient clipped to `params.grad_clip_norm` when that is
/// positive; returns the gradient's norm before clipping. `step` (1-based) names a diverged step.
/// A tensor whose gradient is empty stays as it is, its moments too (a frozen tensor: no weight
/// decay either).
pub fn adam_step(
    optimizer: &mut AdamW,
    adapter: &mut LoraAdapter,
    grads: &[Vec<f32>],
    params: &AdamParams,
    step: usize,
) -> Result<f64, TrainError> {
    // Pieces' sums of squares in parallel, added in order: the same bits on any thread count.
    let piece_sums: Vec<f64> = grads
        .iter()
        .flat_map(|g| g.chunks(VALUES_PER_TASK))
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|piece| piece.iter().map(|g| f64::from(*g).powi(2)).sum::<f64>())
        .collect();
    let grad_norm = piece_sums.iter().sum::<f64>().sqrt();
    if !grad_norm.is_finite() {
        return Err(TrainError::NonFinite(format!(
            "gradient norm {grad_norm} at step {step}"
        )));
    }
    let clip = if params.grad_clip_norm > 0.0 {
        (params.grad_clip_norm / (grad_norm + 1e-6)).min(1.0)
    } else {
        1.0
    };
    optimizer.step(adapter, grads, clip, params);
    Ok(grad_norm)
}

fn pearson(x: &[f64], y: &[f64]) -> Option<f64> {
    let n = x.len() as f64;
    if x.len() < 2 {
        return None;
    }
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx).powi(2);
        syy += (b - my).powi(2);
    }
    let denom = (sxx * syy).sqrt();
    (denom > 0.0).then(|| sxy / denom)
}

/// Runs one job from `start` and returns the new adapter, or `None` (with an `Ended` event
/// saying why) when nothing can be learned. `cancel` is checked before every step.
pub fn run_job(
    model: &Decoder,
    start: &LoraAdapter,
    job: &TokenizedJob,
    cfg: &TrainerConfig,
    cancel: &AtomicBool,
    on_event: &mut dyn FnMut(TrainEvent),
) -> Result<Option<LoraAdapter>, TrainError> {
    // Accepted under a larger `max_seq_len` (before a restart): never trained cut short.
    job.check_lengths(cfg.max_seq_len)?;
    let loss_cfg = &job.loss;
    let advantages: Vec<Vec<f64>> = job
        .rewards
        .iter()
        .map(|r| group_advantages(r, loss_cfg.scale_rewards))
        .collect();
    let all_rewards: Vec<f64> = job.rewards.iter().flatten().copied().collect();
    let n = all_rewards.len() as f64;
    let reward = all_rewards.iter().sum::<f64>() / n;
    let reward_std_dev = (all_rewards
        .iter()
        .map(|r| (r - reward).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();

    let mut prepared: Vec<Prepared> = Vec::new();
    let mut shares = Vec::new();
    for s in &job.sequences {
        let advantage = advantages[s.group][s.trajectory];
        let trainable = s.trainable_tokens();
        if advantage == 0.0 || trainable == 0 {
            continue;
        }
        shares.push((
            (s.group, s.trajectory),
            trainable,
            balance(advantage, loss_cfg.advantage_balance),
        ));
        prepared.push(Prepared {
            tokens: s.tokens.clone(),
            mask: s.mask.clone(),
            old: s.old_logprobs.clone(),
            trainable,
            weight: 0.0,
            advantage: 0.0,
        });
    }
    if prepared.is_empty() {
        on_event(TrainEvent::Ended {
            step: 0,
            message: Some(
                "nothing to learn from: every group has equal rewards or no trainable tokens"
                    .to_owned(),
            ),
        });
        return Ok(None);
    }
    for (p, (weight, advantage)) in prepared.iter_mut().zip(weights_and_advantages(&shares)) {
        p.weight = weight;
        p.advantage = advantage;
    }
    let trainable_groups = advantages
        .iter()
        .enumerate()
        .filter(|(g, a)| a.iter().any(|x| *x != 0.0) && job.sequences.iter().any(|s| s.group == *g))
        .count();

    let packs = pack(prepared.iter().map(|p| p.tokens.len()), cfg.max_seq_len);
    on_event(TrainEvent::Started {
        num_sequences: packs.len(),
    });

    let mut adapter = start.clone();
    let mut optimizer = AdamW::new(&adapter);
    let num_trajectories = all_rewards.len();
    for (step, pack) in packs.iter().enumerate() {
        if cancel.load(Ordering::Relaxed) {
            return Err(TrainError::Cancelled);
        }
        let mut tokens = Vec::new();
        let mut scored = Vec::new();
        let mut segment_lens = Vec::new();
        let mut old = Vec::new();
        for &i in pack {
            let p = &prepared[i];
            tokens.extend(&p.tokens);
            scored.extend(&p.mask);
            segment_lens.push(p.tokens.len());
            old.extend(
                p.mask
                    .iter()
                    .zip(&p.old)
                    .filter(|(m, _)| **m)
                    .map(|(_, &lp)| f64::from(lp)),
            );
        }
        let seq = PackedSequence {
            tokens: &tokens,
            segment_lens: &segment_lens,
            scored: &scored,
        };
        let sampler_old = old.clone();
        let (scores, tape) = model.train_forward(&seq, &adapter)?;
        if loss_cfg.precalculate_logprobs {
            // The current weights' logprobs are the training forward's own: the numbers a
            // scoring pass gives, bit for bit, without a second forward.
            old = scores.logprobs.iter().map(|&x| f64::from(x)).collect();
        }
        let count = scores.logprobs.len();
        let norm = 1.0 / (count as f64 + 1e-6);
        let mut loss = 0.0;
        let mut dlogprobs = Vec::with_capacity(count);
        // The scored logprobs are the pack's sequences' trained tokens, in order.
        let mut at = 0;
        for &i in pack {
            let p = &prepared[i];
            let trained = at..at + p.trainable;
            at = trained.end;
            let lp_new: Vec<f64> = scores.logprobs[trained.clone()]
                .iter()
                .map(|&lp| f64::from(lp))
                .collect();
            // A missing sampler logprob is lp_new detached.
            let lp_old: Vec<f64> = old[trained]
                .iter()
                .zip(&lp_new)
                .map(|(&old, &new)| if old.is_nan() { new } else { old })
                .collect();
            for (l, dl) in sequence_loss(&lp_new, &lp_old, p.advantage, loss_cfg) {
                loss += l * p.weight * norm;
                dlogprobs.push((dl * p.weight * norm) as f32);
            }
        }
        let grads = model.backward(tape, &adapter, &dlogprobs)?;
        let grad_norm = apply_gradients(
            &mut optimizer,
            &mut adapter,
            &grads.grads,
            loss_cfg.learning_rate,
            step + 1,
        )?;
        let new_probs: Vec<f64> = scores
            .logprobs
            .iter()
            .map(|&x| f64::from(x).exp())
            .collect();
        // Tokens the sampler gave no logprob for are left out of the correlation.
        let (old_probs, new_probs): (Vec<f64>, Vec<f64>) = sampler_old
            .iter()
            .zip(&new_probs)
            .filter(|(old, _)| !old.is_nan())
            .map(|(old, new)| (old.exp(), *new))
            .unzip();
        let entropy =
            scores.entropies.iter().map(|&e| f64::from(e)).sum::<f64>() / count.max(1) as f64;
        on_event(TrainEvent::GradientStep(StepMetrics {
            step: step + 1,
            loss,
            policy_loss: loss,
            entropy,
            grad_norm,
            learning_rate: loss_cfg.learning_rate,
            reward,
            reward_std_dev,
            num_trajectories,
            num_trainable_tokens: count,
            num_groups_submitted: job.rewards.len(),
            num_groups_trainable: trainable_groups,
            probs_corr: pearson(&old_probs, &new_probs),
        }));
    }
    on_event(TrainEvent::Ended {
        step: packs.len() as i64,
        message: None,
    });
    Ok(Some(adapter))
}

/// Runs one SFT job from `start`: per batch of `batch_size` trajectories (in order, each epoch),
/// one AdamW step on the mean negative log-likelihood of the batch's trainable tokens. A batch
/// longer than `max_seq_len` is split into packs whose gradients add up before the step.
/// `cancel` is checked before every pack.
pub fn run_sft_job(
    model: &Decoder,
    start: &LoraAdapter,
    job: &TokenizedSftJob,
    cfg: &TrainerConfig,
    cancel: &AtomicBool,
    on_event: &mut dyn FnMut(TrainEvent),
) -> Result<LoraAdapter, TrainError> {
    job.check_lengths(cfg.max_seq_len)?;
    let schedule = &job.schedule;
    let batches: Vec<&[crate::TokenizedSequence]> = (0..schedule.epochs)
        .flat_map(|_| job.sequences.chunks(schedule.batch_size))
        .collect();
    let per_epoch = batches.len() / schedule.epochs.max(1);
    on_event(TrainEvent::Started {
        num_sequences: batches.len(),
    });
    let mut adapter = start.clone();
    let mut optimizer = AdamW::new(&adapter);
    for (step, (batch, &learning_rate)) in batches.iter().zip(&schedule.learning_rates).enumerate()
    {
        let count: usize = batch.iter().map(|s| s.trainable_tokens()).sum();
        // Each trainable token's share of the batch's mean.
        let norm = 1.0 / count.max(1) as f64;
        let mut nll = 0.0;
        let mut grads: Vec<Vec<f32>> = Vec::new();
        for pack in pack(batch.iter().map(|s| s.tokens.len()), cfg.max_seq_len) {
            if cancel.load(Ordering::Relaxed) {
                return Err(TrainError::Cancelled);
            }
            let members = pack.iter().map(|&i| &batch[i]);
            let tokens: Vec<u32> = members.clone().flat_map(|s| s.tokens.clone()).collect();
            let scored: Vec<bool> = members.clone().flat_map(|s| s.mask.clone()).collect();
            let segment_lens: Vec<usize> = members.map(|s| s.tokens.len()).collect();
            let seq = PackedSequence {
                tokens: &tokens,
                segment_lens: &segment_lens,
                scored: &scored,
            };
            let (scores, tape) = model.train_forward(&seq, &adapter)?;
            nll -= scores.logprobs.iter().map(|&lp| f64::from(lp)).sum::<f64>();
            let dlogprobs = vec![-norm as f32; scores.logprobs.len()];
            let pack_grads = model.backward(tape, &adapter, &dlogprobs)?.grads;
            if grads.is_empty() {
                grads = pack_grads;
            } else {
                for (sum, g) in grads.iter_mut().zip(&pack_grads) {
                    sum.iter_mut().zip(g).for_each(|(s, x)| *s += x);
                }
            }
        }
        let grad_norm = apply_gradients(
            &mut optimizer,
            &mut adapter,
            &grads,
            learning_rate,
            step + 1,
        )?;
        on_event(TrainEvent::SftStep(SftStepMetrics {
            step: step + 1,
            loss: nll * norm,
            grad_norm,
            learning_rate,
            num_trajectories: batch.len(),
            num_trainable_tokens: count,
            epoch: step / per_epoch.max(1) + 1,
        }));
    }
    on_event(TrainEvent::Ended {
        step: batches.len() as i64,
        message: None,
    });
    Ok(adapter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ExperimentalConfig;

    fn cfg(json: serde_json::Value) -> LossConfig {
        serde_json::from_value::<ExperimentalConfig>(json)
            .unwrap()
            .resolve()
            .unwrap()
    }

    #[test]
    fn advantages_by_hand() {
        // mean 2, population std sqrt(2/3)
        let a = group_advantages(&[1.0, 2.0, 3.0], false);
        assert_eq!(a, vec![-1.0, 0.0, 1.0]);
        let a = group_advantages(&[1.0, 2.0, 3.0], true);
        let s = (2.0f64 / 3.0).sqrt() + 1e-6;
        assert!((a[0] + 1.0 / s).abs() < 1e-12 && a[1] == 0.0 && (a[2] - 1.0 / s).abs() < 1e-12);
        assert_eq!(group_advantages(&[5.0, 5.0], true), vec![0.0, 0.0]);
    }

    #[test]
    fn defaults() {
        let c = cfg(serde_json::json!({}));
        assert_eq!(
            (c.ppo, c.epsilon, c.epsilon_high, c.learning_rate),
            (false, 1.0, 4.0, 5e-6)
        );
        let c = cfg(serde_json::json!({"ppo": true}));
        assert_eq!((c.epsilon, c.epsilon_high), (0.2, 0.2));
        let c = cfg(serde_json::json!({"kimi_k2_tau": 0.5}));
        assert_eq!(c.alt_k2_tau, Some(0.5));
        assert!(
            serde_json::from_value::<ExperimentalConfig>(serde_json::json!({"lr": 1})).is_err()
        );
    }

    /// A one-token sequence's loss and gradient.
    fn token_loss(lp_new: f64, lp_old: f64, advantage: f64, c: &LossConfig) -> (f64, f64) {
        sequence_loss(&[lp_new], &[lp_old], advantage, c)[0]
    }

    /// The `experimental_config` openpipe-art's ServerlessBackend sends (its
    /// `ExperimentalTrainingConfig`: every key present, unset ones null): with the library's
    /// defaults it is our defaults; every non-default reaches the loss configuration.
    #[test]
    fn the_art_library_config() {
        let defaults = cfg(serde_json::json!({
            "advantage_balance": 0.0,
            "epsilon": null,
            "epsilon_high": null,
            "importance_sampling_level": "token",
            "kimi_k2_tau": null,
            "learning_rate": 5e-6,
            "mask_prob_ratio": false,
            "max_negative_advantage_importance_sampling_weight": null,
            "ppo": false,
            "precalculate_logprobs": false,
            "scale_rewards": true
        }));
        assert_eq!(defaults, cfg(serde_json::json!({})));
        let all_null = cfg(serde_json::json!({
            "advantage_balance": null, "epsilon": null, "epsilon_high": null,
            "importance_sampling_level": null, "kimi_k2_tau": null, "learning_rate": null,
            "mask_prob_ratio": null, "max_negative_advantage_importance_sampling_weight": null,
            "ppo": null, "precalculate_logprobs": null, "scale_rewards": null
        }));
        assert_eq!(all_null, defaults);
        let chosen = cfg(serde_json::json!({
            "advantage_balance": -0.5,
            "epsilon": 0.3,
            "epsilon_high": 0.4,
            "importance_sampling_level": "geometric_average",
            "kimi_k2_tau": 0.1,
            "learning_rate": 1e-4,
            "mask_prob_ratio": true,
            "max_negative_advantage_importance_sampling_weight": 2.0,
            "ppo": true,
            "precalculate_logprobs": true,
            "scale_rewards": false
        }));
        assert_eq!(
            chosen,
            LossConfig {
                ppo: true,
                epsilon: 0.3,
                epsilon_high: 0.4,
                importance_sampling_level: ImportanceSamplingLevel::GeometricAverage,
                advantage_balance: -0.5,
                alt_k2_tau: Some(0.1),
                learning_rate: 1e-4,
                mask_prob_ratio: true,
                max_negative_is_weight: Some(2.0),
                precalculate_logprobs: true,
                scale_rewards: false,
            }
        );
        for (level, want) in [
            ("token", ImportanceSamplingLevel::Token),
            ("sequence", ImportanceSamplingLevel::Sequence),
            ("average", ImportanceSamplingLevel::Average),
            (
                "geometric_average",
                ImportanceSamplingLevel::GeometricAverage,
            ),
        ] {
            let c = cfg(serde_json::json!({ "importance_sampling_level": level }));
            assert_eq!(c.importance_sampling_level, want);
        }
        let bad = serde_json::from_value::<ExperimentalConfig>(
            serde_json::json!({"importance_sampling_level": "tokens"}),
        )
        .unwrap_err();
        assert!(
            bad.to_string().contains("unknown variant `tokens`"),
            "{bad}"
        );
    }

    #[test]
    fn losses_by_hand() {
        let ln = |x: f64| x.ln();
        // CISPO: rho = 2 within [0, 5]: L = -2 * A * lp_new, dL = -2A.
        let c = cfg(serde_json::json!({}));
        let (l, d) = token_loss(ln(0.5), ln(0.25), 1.5, &c);
        assert!((l - (-2.0 * 1.5 * ln(0.5))).abs() < 1e-12 && (d + 3.0).abs() < 1e-12);
        // rho = 8 clipped to 1 + 4 = 5.
        let (_, d) = token_loss(ln(0.8), ln(0.1), 1.0, &c);
        assert!((d + 5.0).abs() < 1e-9);
        // PPO, A > 0, rho = 1.5 > 1.2: the clipped term is the min, constant: no gradient.
        let p = cfg(serde_json::json!({"ppo": true}));
        let (l, d) = token_loss(ln(0.3), ln(0.2), 1.0, &p);
        assert!((l + 1.2).abs() < 1e-12 && d == 0.0);
        // PPO, rho = 1.1 inside: L = -rho A, dL = -rho A.
        let (l, d) = token_loss(ln(0.22), ln(0.2), 2.0, &p);
        assert!((l + 2.2).abs() < 1e-9 && (d + 2.2).abs() < 1e-9);
        // W caps rho on negative advantages: rho 4 -> 2, no gradient through it (PPO unclipped
        // term -rho*A = 2*... picks min(rho A, clip A) = min(-2, -1.2) = -2).
        let w = cfg(
            serde_json::json!({"ppo": true, "max_negative_advantage_importance_sampling_weight": 2.0}),
        );
        let (l, d) = token_loss(ln(0.4), ln(0.1), -1.0, &w);
        assert!((l - 2.0).abs() < 1e-12 && d == 0.0);
        // mask_prob_ratio zeroes rho outside (1 - eps, 1 + eps_high) = (0, 1.5) here.
        let m = cfg(serde_json::json!({"mask_prob_ratio": true, "epsilon_high": 0.5}));
        let (l, d) = token_loss(ln(0.8), ln(0.1), 1.0, &m);
        assert_eq!((l, d), (-0.0, -0.0));
        let (_, d) = token_loss(ln(0.12), ln(0.1), 1.0, &m);
        assert!((d + 1.2).abs() < 1e-9);
        // alt_k2_tau: A' = A - tau * d with d = ln 2.
        let k = cfg(serde_json::json!({"alt_k2_tau": 0.5}));
        let (_, d) = token_loss(ln(0.2), ln(0.1), 1.0, &k);
        assert!((d + 2.0 * (1.0 - 0.5 * ln(2.0))).abs() < 1e-12);
        // PPO with alt_k2_tau: rho = 1.1 inside [0.8, 1.2], A' = 2 - 0.5 ln 1.1 (a constant):
        // L = -rho A', dL = -rho A'.
        let pk = cfg(serde_json::json!({"ppo": true, "alt_k2_tau": 0.5}));
        let (l, d) = token_loss(ln(0.22), ln(0.2), 2.0, &pk);
        let a = 2.0 - 0.5 * ln(1.1);
        assert!(
            (l + 1.1 * a).abs() < 1e-9 && (d + 1.1 * a).abs() < 1e-9,
            "{l} {d}"
        );
        // A missing sampler logprob is lp_new detached: rho = 1 with gradient rho, so PPO's
        // dL = -A and CISPO's dL = -clip(1) A = -A.
        let (l, d) = token_loss(ln(0.3), ln(0.3), 0.8, &p);
        assert!((l + 0.8).abs() < 1e-12 && (d + 0.8).abs() < 1e-12);
    }

    /// The loss of one sequence's trained tokens, summed, written as training.md and
    /// openpipe-art's loss.py write it, as autograd evaluates it: `lp` carries the gradient and
    /// `lp_detached` (the same values) is read wherever the formula says `.detach()`; a missing
    /// (NaN) sampler logprob is `lp_detached`.
    fn spec_loss(lp: &[f64], lp_detached: &[f64], lp_old: &[f64], a: f64, c: &LossConfig) -> f64 {
        let lp_old: Vec<f64> = lp_old
            .iter()
            .zip(lp_detached)
            .map(|(&old, &det)| if old.is_nan() { det } else { old })
            .collect();
        let (lo, hi) = (1.0 - c.epsilon, 1.0 + c.epsilon_high);
        let ratios = |lp: &[f64]| -> Vec<f64> {
            let d: Vec<f64> = lp.iter().zip(&lp_old).map(|(x, o)| x - o).collect();
            let seq = (d.iter().sum::<f64>() / d.len() as f64).exp();
            d.iter()
                .map(|d| {
                    let tok = d.exp();
                    let mut rho = match c.importance_sampling_level {
                        ImportanceSamplingLevel::Token => tok,
                        ImportanceSamplingLevel::Sequence => seq,
                        ImportanceSamplingLevel::Average => (tok + seq) / 2.0,
                        ImportanceSamplingLevel::GeometricAverage => tok.sqrt() * seq.sqrt(),
                    };
                    if let (Some(w), true) = (c.max_negative_is_weight, a < 0.0) {
                        rho = rho.min(w);
                    }
                    if c.mask_prob_ratio && !(lo < rho && rho < hi) {
                        rho = 0.0;
                    }
                    rho
                })
                .collect()
        };
        let advantages: Vec<f64> = lp_detached
            .iter()
            .zip(&lp_old)
            .map(|(det, old)| a - c.alt_k2_tau.unwrap_or(0.0) * (det - old))
            .collect();
        if c.ppo {
            ratios(lp)
                .iter()
                .zip(&advantages)
                .map(|(rho, a)| -(rho * a).min(rho.clamp(lo, hi) * a))
                .sum()
        } else {
            ratios(lp_detached)
                .iter()
                .zip(&advantages)
                .zip(lp)
                .map(|((rho, a), lp)| -rho.clamp(lo, hi) * a * lp)
                .sum()
        }
    }

    /// (lp_new, lp_old, A) of sequences whose ratios at every level stay away from every edge
    /// of the configs below (checked): token ratios inside the clip ranges, above and below
    /// them, a missing sampler logprob, both advantage signs, one- and several-token sequences.
    fn sequences() -> Vec<(Vec<f64>, Vec<f64>, f64)> {
        let ln = f64::ln;
        let seq = |lp: &[f64], ratios: &[f64], a: f64| {
            let old: Vec<f64> = lp.iter().zip(ratios).map(|(x, r)| x - ln(*r)).collect();
            (lp.to_vec(), old, a)
        };
        let mut missing = seq(&[-1.0, -2.5, -0.3, -0.8], &[3.0, 0.3, 2.0, 1.0], -1.1);
        missing.1[3] = f64::NAN;
        vec![
            seq(&[-1.0, -2.0, -0.5], &[1.1, 0.9, 1.05], 0.7),
            seq(&[-1.0, -2.0, -0.5], &[1.1, 0.9, 1.05], -0.4),
            missing,
            seq(&[-1.6], &[0.3], 0.8),
            seq(&[-0.7], &[1.1], -0.6),
            seq(&[-0.5, -1.2, -3.0, -0.9], &[6.0, 3.0, 7.0, 5.5], 1.3),
            seq(&[-0.9, -0.2, -1.4, -2.2], &[6.0, 3.0, 7.0, 5.5], -0.9),
            seq(&[-1.6, -0.4, -1.0, -2.0], &[0.3, 0.4, 1.3, 0.25], -0.8),
            seq(&[-1.6, -0.4, -1.0, -2.0], &[0.3, 0.4, 1.3, 0.25], 0.5),
        ]
    }

    /// For every importance sampling level, objective and option, on sequences of several
    /// tokens: the losses' sum against the spec's, and each token's gradient against central
    /// differences of the spec's summed loss w.r.t. that token's lp_new (detached parts held).
    #[test]
    fn sequence_gradients_match_finite_differences() {
        let configs = [
            serde_json::json!({}),
            serde_json::json!({"alt_k2_tau": 0.5}),
            serde_json::json!({"kimi_k2_tau": 2.0, "epsilon": 0.3, "epsilon_high": 0.6}),
            serde_json::json!({"ppo": true}),
            serde_json::json!({"ppo": true, "alt_k2_tau": 0.5}),
            serde_json::json!({"ppo": true, "epsilon": 0.5, "epsilon_high": 1.5}),
            serde_json::json!({"max_negative_advantage_importance_sampling_weight": 1.5}),
            serde_json::json!({
                "ppo": true,
                "max_negative_advantage_importance_sampling_weight": 1.5
            }),
            serde_json::json!({"mask_prob_ratio": true, "epsilon_high": 0.5}),
            serde_json::json!({"ppo": true, "mask_prob_ratio": true, "alt_k2_tau": 0.3}),
        ];
        let levels = ["token", "sequence", "average", "geometric_average"];
        let h = 1e-6;
        for json in configs {
            for level in levels {
                let mut json = json.clone();
                json["importance_sampling_level"] = serde_json::json!(level);
                let c = cfg(json.clone());
                for (lp, old, a) in sequences() {
                    let what = format!("{json} lp {lp:?} old {old:?} A {a}");
                    // run_job's substitution for a missing sampler logprob.
                    let used_old: Vec<f64> = old
                        .iter()
                        .zip(&lp)
                        .map(|(&o, &x)| if o.is_nan() { x } else { o })
                        .collect();
                    assert_away_from_edges(&lp, &used_old, a, &c, &what);
                    let out = sequence_loss(&lp, &used_old, a, &c);
                    let value: f64 = out.iter().map(|o| o.0).sum();
                    let spec = spec_loss(&lp, &lp, &old, a, &c);
                    assert!(
                        (value - spec).abs() < 1e-12 * (1.0 + spec.abs()),
                        "{what}: loss {value} vs {spec}"
                    );
                    for (k, &(_, analytic)) in out.iter().enumerate() {
                        let at = |x: f64| {
                            let mut moved = lp.clone();
                            moved[k] = x;
                            spec_loss(&moved, &lp, &old, a, &c)
                        };
                        let numeric = (at(lp[k] + h) - at(lp[k] - h)) / (2.0 * h);
                        assert!(
                            (numeric - analytic).abs() < 1e-6 * (1.0 + analytic.abs()),
                            "{what} token {k}: numeric {numeric} vs analytic {analytic}"
                        );
                    }
                }
            }
        }
    }

    /// The finite differences above are only meaningful off the kinks: every ratio at least
    /// 0.01 from the clip, mask and cap edges, and every (alt_k2) advantage away from 0.
    fn assert_away_from_edges(lp: &[f64], old: &[f64], a: f64, c: &LossConfig, what: &str) {
        let d: Vec<f64> = lp.iter().zip(old).map(|(x, o)| x - o).collect();
        let seq = (d.iter().sum::<f64>() / d.len() as f64).exp();
        let mut edges = vec![1.0 - c.epsilon, 1.0 + c.epsilon_high];
        edges.extend(c.max_negative_is_weight);
        for d in &d {
            let tok = d.exp();
            for rho in [tok, seq, (tok + seq) / 2.0, tok.sqrt() * seq.sqrt()] {
                for e in &edges {
                    assert!((rho - e).abs() > 0.01, "{what}: ratio {rho} at edge {e}");
                }
            }
            let a = a - c.alt_k2_tau.unwrap_or(0.0) * d;
            assert!(a.abs() > 0.01, "{what}: advantage {a}");
        }
    }

    /// A one-token sequence's mean is its token: every level gives the token level's loss and
    /// gradient; on longer sequences the levels differ.
    #[test]
    fn levels_agree_on_one_token() {
        for ppo in [false, true] {
            let token = cfg(serde_json::json!({"ppo": ppo}));
            for level in ["sequence", "average", "geometric_average"] {
                let c = cfg(serde_json::json!({"ppo": ppo, "importance_sampling_level": level}));
                let mut differ = 0;
                for (lp, old, a) in sequences() {
                    let old: Vec<f64> = old
                        .iter()
                        .zip(&lp)
                        .map(|(&o, &x)| if o.is_nan() { x } else { o })
                        .collect();
                    let (want, got) = (
                        sequence_loss(&lp, &old, a, &token),
                        sequence_loss(&lp, &old, a, &c),
                    );
                    let close = want
                        .iter()
                        .zip(&got)
                        .all(|(w, g)| (w.0 - g.0).abs() < 1e-12 && (w.1 - g.1).abs() < 1e-12);
                    assert!(close || lp.len() > 1, "{level} ppo {ppo}: {want:?} {got:?}");
                    differ += usize::from(!close);
                }
                assert!(differ > 0, "{level} ppo {ppo}");
            }
        }
    }

    #[test]
    fn weights_and_advantages_by_hand() {
        assert_eq!(balance(-4.0, 0.5), -2.0);
        assert_eq!(balance(4.0, 0.5), 4.0);
        assert_eq!(balance(4.0, -0.25), 3.0);
        // Trajectory (0, 0): a main sequence of 1 trainable token and a history of 3, A = 1;
        // trajectory (0, 1): 2 tokens, A = -2. Weights 1/4 and 1/2, times 6 tokens / 2
        // trajectories: 0.75 and 1.5. mean(|A| w) = (4 * 1 * 0.75 + 2 * 2 * 1.5) / 6 = 1.5.
        let out = weights_and_advantages(&[((0, 0), 1, 1.0), ((0, 1), 2, -2.0), ((0, 0), 3, 1.0)]);
        let want = [(0.75, 1.0 / 1.5), (1.5, -2.0 / 1.5), (0.75, 1.0 / 1.5)];
        for (got, want) in out.iter().zip(want) {
            assert!(
                (got.0 - want.0).abs() < 1e-12 && (got.1 - want.1).abs() < 1e-12,
                "{out:?}"
            );
        }
    }

    #[test]
    fn pearson_by_hand() {
        assert!((pearson(&[1.0, 2.0, 3.0], &[2.0, 4.0, 6.0]).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(pearson(&[1.0], &[1.0]), None);
        assert_eq!(pearson(&[1.0, 1.0], &[1.0, 2.0]), None);
    }
}
