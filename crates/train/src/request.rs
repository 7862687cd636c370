//! The training request as posted (training.md): trajectory groups and experimental options.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use temper_text::{ChatMessage, ToolDef};

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct TrainingRequest {
    pub trajectory_groups: Vec<TrajectoryGroup>,
    #[serde(default)]
    pub experimental_config: Option<ExperimentalConfig>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct TrajectoryGroup {
    pub trajectories: Vec<Trajectory>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Trajectory {
    pub messages_and_choices: Vec<MessageOrChoice>,
    #[serde(default)]
    pub tools: Option<Vec<ToolDef>>,
    #[serde(default)]
    pub reward: f64,
    #[serde(default)]
    pub additional_histories: Vec<History>,
    // Stored with the job and echoed in its metrics; training does not read them.
    #[serde(default)]
    pub metrics: Map<String, Value>,
    #[serde(default)]
    pub metadata: Map<String, Value>,
    #[serde(default)]
    pub logs: Vec<Value>,
    #[serde(default)]
    pub start_time: Option<String>,
    #[serde(default)]
    pub initial_policy_version: Option<i64>,
    #[serde(default)]
    pub final_policy_version: Option<i64>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct History {
    pub messages_and_choices: Vec<MessageOrChoice>,
    #[serde(default)]
    pub tools: Option<Vec<ToolDef>>,
}

/// A Choice object (it has `message`) or an OpenAI message dict (it has `role`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum MessageOrChoice {
    Choice(Choice),
    Message(ChatMessage),
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Choice {
    pub message: ChatMessage,
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub index: Option<i64>,
    #[serde(default)]
    pub logprobs: Option<ChoiceLogprobs>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ChoiceLogprobs {
    #[serde(default)]
    pub content: Option<Vec<TokenLogprob>>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    /// The token's raw bytes, as the server's logprobs give them; they decide which token
    /// `token` is (`Tokenizer::id_of_logprob_token`). Missing or null: `token`'s UTF-8.
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
    /// Missing or null: the trainer uses its own logprob, detached (rho = 1).
    #[serde(default)]
    pub logprob: Option<f64>,
}

/// Every option of training.md; `None` (or null) is its default.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentalConfig {
    pub advantage_balance: Option<f64>,
    pub epsilon: Option<f64>,
    pub epsilon_high: Option<f64>,
    pub importance_sampling_level: Option<ImportanceSamplingLevel>,
    #[serde(alias = "kimi_k2_tau")]
    pub alt_k2_tau: Option<f64>,
    pub learning_rate: Option<f64>,
    pub mask_prob_ratio: Option<bool>,
    pub max_negative_advantage_importance_sampling_weight: Option<f64>,
    pub ppo: Option<bool>,
    pub precalculate_logprobs: Option<bool>,
    pub scale_rewards: Option<bool>,
}

/// Which importance ratio a trained token uses (training.md "Loss per trainable token"), as the
/// `openpipe-art` library names them. With `d = lp_new - lp_old` per token, the token ratio is
/// `exp(d)` and the sequence ratio `exp(mean of d over the sequence's trained tokens)`, the
/// gradient flowing through the mean. A sequence is one tokenized conversation: a trajectory's
/// `messages_and_choices` or one of its `additional_histories` (openpipe-art's group id).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingLevel {
    /// The token ratio.
    #[default]
    Token,
    /// The sequence ratio.
    Sequence,
    /// `(token ratio + sequence ratio) / 2`.
    Average,
    /// `sqrt(token ratio) * sqrt(sequence ratio)`.
    GeometricAverage,
}

/// `ExperimentalConfig` with training.md's defaults filled in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossConfig {
    pub ppo: bool,
    pub epsilon: f64,
    pub epsilon_high: f64,
    pub importance_sampling_level: ImportanceSamplingLevel,
    pub advantage_balance: f64,
    pub alt_k2_tau: Option<f64>,
    pub learning_rate: f64,
    pub mask_prob_ratio: bool,
    pub max_negative_is_weight: Option<f64>,
    pub precalculate_logprobs: bool,
    pub scale_rewards: bool,
}

impl ExperimentalConfig {
    pub fn resolve(&self) -> Result<LossConfig, crate::TrainError> {
        let ppo = self.ppo.unwrap_or(false);
        let epsilon = self.epsilon.unwrap_or(if ppo { 0.2 } else { 1.0 });
        let epsilon_high = self.epsilon_high.unwrap_or(if ppo { epsilon } else { 4.0 });
        let bad = |field: &str, why: &str| {
            Err(crate::TrainError::Invalid {
                param: format!("experimental_config.{field}"),
                message: why.to_owned(),
            })
        };
        let advantage_balance = self.advantage_balance.unwrap_or(0.0);
        if !(-1.0..=1.0).contains(&advantage_balance) {
            return bad("advantage_balance", "must be in [-1, 1]");
        }
        if !(epsilon.is_finite() && epsilon >= 0.0) {
            return bad("epsilon", "must be a number >= 0");
        }
        if !(epsilon_high.is_finite() && epsilon_high >= 0.0) {
            return bad("epsilon_high", "must be a number >= 0");
        }
        let learning_rate = self.learning_rate.unwrap_or(5e-6);
        if !(learning_rate.is_finite() && learning_rate > 0.0) {
            return bad("learning_rate", "must be a number > 0");
        }
        if let Some(w) = self.max_negative_advantage_importance_sampling_weight {
            if !(w.is_finite() && w > 0.0) {
                return bad(
                    "max_negative_advantage_importance_sampling_weight",
                    "must be a number > 0",
                );
            }
        }
        if let Some(tau) = self.alt_k2_tau {
            if !tau.is_finite() {
                return bad("alt_k2_tau", "must be a finite number");
            }
        }
        Ok(LossConfig {
            ppo,
            epsilon,
            epsilon_high,
            importance_sampling_level: self.importance_sampling_level.unwrap_or_default(),
            advantage_balance,
            alt_k2_tau: self.alt_k2_tau,
            learning_rate,
            mask_prob_ratio: self.mask_prob_ratio.unwrap_or(false),
            max_negative_is_weight: self.max_negative_advantage_importance_sampling_weight,
            precalculate_logprobs: self.precalculate_logprobs.unwrap_or(false),
            scale_rewards: self.scale_rewards.unwrap_or(true),
        })
    }
}

/// An SFT job as posted (`POST /v1/preview/sft-training-jobs`, less the model).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct SftRequest {
    pub trajectories: Vec<SftTrajectory>,
    #[serde(default)]
    pub config: Option<SftConfig>,
}

/// One conversation to imitate: ART's SFT line `{"messages", "tools"}` or a Trajectory object
/// (`messages_and_choices`; its reward, metrics and the like are accepted and not read).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct SftTrajectory {
    #[serde(alias = "messages")]
    pub messages_and_choices: Vec<MessageOrChoice>,
    #[serde(default)]
    pub tools: Option<Vec<ToolDef>>,
}

/// ART's `SFTTrainingConfig` plus `epochs`; `None` (or null) is the default.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SftConfig {
    pub learning_rate: Option<LearningRate>,
    pub batch_size: Option<u64>,
    pub epochs: Option<u64>,
}

/// One rate for every batch, or one per batch (ART's per-batch schedule).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum LearningRate {
    Constant(f64),
    PerBatch(Vec<f64>),
}

/// ART's `TrainSFTConfig` defaults: learning rate 5e-5, batch size 2 (the backends' "auto"),
/// one epoch.
pub const SFT_DEFAULT_LEARNING_RATE: f64 = 5e-5;
pub const SFT_DEFAULT_BATCH_SIZE: usize = 2;
pub const SFT_DEFAULT_EPOCHS: usize = 1;
/// Bounds that keep a job's step count sane (a typo such as `epochs: 1e9` is a 400, not a job
/// that never ends).
const SFT_MAX_BATCH_SIZE: u64 = 1024;
const SFT_MAX_EPOCHS: u64 = 100;

/// `SftConfig` resolved against the number of trajectories: every optimizer step's batch and
/// learning rate.
#[derive(Debug, Clone, PartialEq)]
pub struct SftSchedule {
    pub batch_size: usize,
    pub epochs: usize,
    /// One per optimizer step (batches of every epoch, in order).
    pub learning_rates: Vec<f64>,
}

impl SftConfig {
    pub fn resolve(&self, num_trajectories: usize) -> Result<SftSchedule, crate::TrainError> {
        let bad = |field: &str, why: String| {
            Err(crate::TrainError::Invalid {
                param: format!("config.{field}"),
                message: why,
            })
        };
        let batch_size = self.batch_size.unwrap_or(SFT_DEFAULT_BATCH_SIZE as u64);
        if !(1..=SFT_MAX_BATCH_SIZE).contains(&batch_size) {
            return bad(
                "batch_size",
                format!("must be an integer from 1 to {SFT_MAX_BATCH_SIZE}"),
            );
        }
        let epochs = self.epochs.unwrap_or(SFT_DEFAULT_EPOCHS as u64);
        if !(1..=SFT_MAX_EPOCHS).contains(&epochs) {
            return bad(
                "epochs",
                format!("must be an integer from 1 to {SFT_MAX_EPOCHS}"),
            );
        }
        let (batch_size, epochs) = (batch_size as usize, epochs as usize);
        let steps = num_trajectories.div_ceil(batch_size) * epochs;
        let learning_rates = match &self.learning_rate {
            None => vec![SFT_DEFAULT_LEARNING_RATE; steps],
            Some(LearningRate::Constant(lr)) => vec![*lr; steps],
            Some(LearningRate::PerBatch(lrs)) if lrs.len() != steps => {
                return bad(
                    "learning_rate",
                    format!(
                        "a list needs one rate per batch: {steps} ({num_trajectories} \
                         trajectories in batches of {batch_size}, {epochs} epoch(s)), got {}",
                        lrs.len()
                    ),
                );
            }
            Some(LearningRate::PerBatch(lrs)) => lrs.clone(),
        };
        if let Some(i) = learning_rates
            .iter()
            .position(|lr| !(lr.is_finite() && *lr > 0.0))
        {
            let field = match self.learning_rate {
                Some(LearningRate::PerBatch(_)) => format!("learning_rate[{i}]"),
                _ => "learning_rate".to_owned(),
            };
            return bad(&field, "must be a number > 0".to_owned());
        }
        Ok(SftSchedule {
            batch_size,
            epochs,
            learning_rates,
        })
    }
}

/// A group of `/log` (training.md): only the rewards and metrics of its trajectories are read.
#[derive(Debug, Deserialize)]
pub struct LogGroup {
    pub trajectories: Vec<LogTrajectory>,
}

#[derive(Debug, Deserialize)]
pub struct LogTrajectory {
    #[serde(default)]
    pub reward: f64,
    #[serde(default)]
    pub metrics: Map<String, Value>,
}
