//! The JSON bodies of the Tinker API as the `tinker` SDK 0.38.0 sends them (`tinker/types`).
//! Fields temper does not use are ignored (the SDK adds a `type` tag to every request).

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Deserialize)]
pub struct CreateSessionRequest {
    #[serde(default)]
    pub user_metadata: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
pub struct SessionRequest {
    pub session_id: String,
}

#[derive(Debug, Deserialize)]
pub struct LoraConfig {
    pub rank: i64,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default = "yes")]
    pub train_unembed: bool,
    #[serde(default = "yes")]
    pub train_mlp: bool,
    #[serde(default = "yes")]
    pub train_attn: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
pub struct OptimizerConfig {
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Debug, Deserialize)]
pub struct CreateModelRequest {
    pub session_id: String,
    #[serde(default)]
    pub model_seq_id: Option<i64>,
    pub base_model: String,
    #[serde(default)]
    pub user_metadata: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub lora_config: Option<LoraConfig>,
    #[serde(default)]
    pub optimizer_config: Option<OptimizerConfig>,
}

#[derive(Debug, Deserialize)]
pub struct ModelIdRequest {
    pub model_id: String,
}

/// `adam_params` as the SDK names it (`optim_params` and `optimizer_params` are its aliases).
#[derive(Debug, Deserialize)]
pub struct OptimStepRequest {
    pub model_id: String,
    #[serde(default)]
    pub seq_id: Option<i64>,
    #[serde(default, alias = "optim_params", alias = "optimizer_params")]
    pub adam_params: Option<AdamParams>,
}

#[derive(Debug, Deserialize)]
pub struct AdamParams {
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default = "lr")]
    pub learning_rate: f64,
    #[serde(default = "beta1")]
    pub beta1: f64,
    #[serde(default = "beta2")]
    pub beta2: f64,
    #[serde(default = "eps")]
    pub eps: f64,
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default)]
    pub grad_clip_norm: f64,
}

// The SDK's defaults (tinker/types/optimizer.py).
fn lr() -> f64 {
    1e-4
}
fn beta1() -> f64 {
    0.9
}
fn beta2() -> f64 {
    0.95
}
fn eps() -> f64 {
    1e-12
}

#[derive(Debug, Deserialize)]
pub struct SaveWeightsRequest {
    pub model_id: String,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub seq_id: Option<i64>,
    #[serde(default)]
    pub sampling_session_seq_id: Option<i64>,
    #[serde(default)]
    pub kind: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct LoadWeightsRequest {
    #[serde(default)]
    pub model_id: Option<String>,
    /// With `model_seq_id` and no `model_id`: a new run from the state
    /// (`create_training_client_from_state`), `model_id` `<session_id>:train:<model_seq_id>`.
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub model_seq_id: Option<i64>,
    #[serde(default)]
    pub base_model: Option<String>,
    #[serde(default)]
    pub user_metadata: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub seq_id: Option<i64>,
    pub path: String,
    #[serde(default)]
    pub optimizer: bool,
}

#[derive(Debug, Deserialize)]
pub struct CreateSamplingSessionRequest {
    pub session_id: String,
    #[serde(default)]
    pub base_model: Option<String>,
    #[serde(default)]
    pub model_path: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ModelInput {
    pub chunks: Vec<Value>,
}

#[derive(Debug, Deserialize)]
pub struct SamplingParams {
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Value>,
    #[serde(default = "one")]
    pub temperature: f64,
    #[serde(default = "minus_one")]
    pub top_k: i64,
    #[serde(default = "one")]
    pub top_p: f64,
}

fn one() -> f64 {
    1.0
}
fn minus_one() -> i64 {
    -1
}

#[derive(Debug, Deserialize)]
pub struct SampleRequest {
    #[serde(default = "one_sample")]
    pub num_samples: i64,
    pub prompt: ModelInput,
    pub sampling_params: SamplingParams,
    #[serde(default)]
    pub base_model: Option<String>,
    #[serde(default)]
    pub model_path: Option<String>,
    #[serde(default)]
    pub sampling_session_id: Option<String>,
    #[serde(default)]
    pub seq_id: Option<i64>,
    #[serde(default)]
    pub prompt_logprobs: Option<bool>,
    #[serde(default)]
    pub topk_prompt_logprobs: i64,
    #[serde(default)]
    pub topk_sample_logprobs: i64,
    #[serde(default)]
    pub target_prompt_logprobs: Option<Value>,
    #[serde(default)]
    pub prompt_alt_tokens_k: i64,
}

fn one_sample() -> i64 {
    1
}

#[derive(Debug, Deserialize)]
pub struct FutureRequest {
    pub request_id: String,
}

/// What a request that runs in the background answers: the future to poll.
#[derive(Debug, Clone, Serialize)]
pub struct UntypedFuture {
    pub request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample_sequence_ids: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    #[serde(default)]
    pub limit: Option<usize>,
    #[serde(default)]
    pub offset: Option<usize>,
}
