//! OpenAI/vLLM wire types. Requests are parsed leniently here (unknown fields ignored, every field
//! optional) and turned into typed parameters by `validation`; nothing past that step sees them.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub type JsonObject = Map<String, Value>;

/// The header that makes a training-route post idempotent.
pub const IDEMPOTENCY_KEY_HEADER: &str = "Idempotency-Key";

/// `POST /v1/chat/completions` body as sent. Fields of `interface.md` that are not implemented
/// yet are parsed with their real types too, so that validation can reject any non-default value
/// and the next issue only adds behaviour.
#[derive(Debug, Default, Deserialize)]
pub struct ChatCompletionRequest {
    pub messages: Vec<RequestMessage>,
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub n: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptionsField>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub chat_template: Option<String>,
    pub chat_template_kwargs: Option<JsonObject>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub request_id: Option<String>,
    pub return_token_ids: Option<bool>,
    pub user: Option<String>,
    pub priority: Option<i64>,
    pub tool_choice: Option<Value>,
    pub service_tier: Option<String>,

    // Issue 3's fields.
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub length_penalty: Option<f64>,
    pub logit_bias: Option<HashMap<String, f64>>,
    pub response_format: Option<ResponseFormat>,
    pub structured_outputs: Option<StructuredOutputs>,
    pub tools: Option<Vec<Value>>,
    pub reasoning_effort: Option<String>,
    pub include_reasoning: Option<bool>,
    pub parallel_tool_calls: Option<bool>,
    pub use_beam_search: Option<bool>,
    pub min_tokens: Option<i64>,
    pub truncate_prompt_tokens: Option<i64>,
    pub prompt_logprobs: Option<i64>,
    pub allowed_token_ids: Option<Vec<i64>>,
    pub bad_words: Option<Vec<String>>,
    pub echo: Option<bool>,
    pub documents: Option<Vec<JsonObject>>,
    pub mm_processor_kwargs: Option<JsonObject>,
    pub return_tokens_as_token_ids: Option<bool>,
    pub cache_salt: Option<String>,
    pub kv_transfer_params: Option<JsonObject>,
    pub engine_xargs: Option<JsonObject>,
    pub repetition_detection: Option<JsonObject>,
}

/// `POST /v1/completions` body as sent (vLLM's `CompletionRequest`): the legacy text completion.
/// `suffix` and `prompt_embeds` are parsed so that validation can refuse them by name.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    pub model: Option<String>,
    pub suffix: Option<String>,
    pub prompt_embeds: Option<Value>,
    pub max_tokens: Option<i64>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub echo: Option<bool>,
    pub logprobs: Option<i64>,
    pub prompt_logprobs: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptionsField>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<HashMap<String, f64>>,
    pub allowed_token_ids: Option<Vec<i64>>,
    pub bad_words: Option<Vec<String>>,
    pub min_tokens: Option<i64>,
    pub repetition_detection: Option<JsonObject>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
    pub use_beam_search: Option<bool>,
    pub length_penalty: Option<f64>,
    pub add_special_tokens: Option<bool>,
    pub truncate_prompt_tokens: Option<i64>,
    pub response_format: Option<ResponseFormat>,
    pub structured_outputs: Option<StructuredOutputs>,
    pub return_token_ids: Option<bool>,
    pub return_tokens_as_token_ids: Option<bool>,
    pub request_id: Option<String>,
    pub user: Option<String>,
    pub priority: Option<i64>,
    pub cache_salt: Option<String>,
    pub kv_transfer_params: Option<JsonObject>,
    pub engine_xargs: Option<JsonObject>,
}

/// A completion's `prompt`: one string, or a list (of strings, of token ids, or of lists of
/// token ids; validation refuses a list that mixes them).
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a list of strings, a list of token ids or a list of lists of token ids"
)]
pub enum PromptField {
    Text(String),
    List(Vec<PromptItem>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a token id (an integer) or a list of token ids"
)]
pub enum PromptItem {
    Text(String),
    Id(i64),
    Ids(Vec<i64>),
}

/// The sampling and stopping fields as sent, borrowed from a `ChatCompletionRequest` or a
/// `CompletionRequest` (their `sampling_fields()`, generated for both by `sampling_fields!`
/// below, the one list of these fields) for `crate::sampling`'s validation.
#[derive(Debug, Clone, Copy, Default)]
pub struct SamplingFields<'a> {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<&'a HashMap<String, f64>>,
    pub allowed_token_ids: Option<&'a Vec<i64>>,
    pub bad_words: Option<&'a Vec<String>>,
    pub min_tokens: Option<i64>,
    pub repetition_detection: Option<&'a JsonObject>,
    pub stop: Option<&'a StopField>,
    pub stop_token_ids: Option<&'a Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
}

/// The one list of the sampling and stopping fields both request types carry, read by
/// `sampling_params` and `stop_params` for both routes.
macro_rules! sampling_fields {
    ($($request:ty),+) => {$(
        impl $request {
            pub fn sampling_fields(&self) -> SamplingFields<'_> {
                SamplingFields {
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    min_p: self.min_p,
                    seed: self.seed,
                    frequency_penalty: self.frequency_penalty,
                    presence_penalty: self.presence_penalty,
                    repetition_penalty: self.repetition_penalty,
                    logit_bias: self.logit_bias.as_ref(),
                    allowed_token_ids: self.allowed_token_ids.as_ref(),
                    bad_words: self.bad_words.as_ref(),
                    min_tokens: self.min_tokens,
                    repetition_detection: self.repetition_detection.as_ref(),
                    stop: self.stop.as_ref(),
                    stop_token_ids: self.stop_token_ids.as_ref(),
                    ignore_eos: self.ignore_eos,
                    include_stop_str_in_output: self.include_stop_str_in_output,
                    skip_special_tokens: self.skip_special_tokens,
                    spaces_between_special_tokens: self.spaces_between_special_tokens,
                }
            }
        }
    )+};
}

sampling_fields!(ChatCompletionRequest, CompletionRequest);

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptionsField {
    pub include_usage: Option<bool>,
    pub continuous_usage_stats: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    pub content: Option<MessageContentField>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<ToolCallField>>,
    pub tool_call_id: Option<String>,
    /// `reasoning_content`, its older name (vLLM's, DeepSeek's), is accepted too.
    #[serde(alias = "reasoning_content")]
    pub reasoning: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContentField {
    Text(String),
    Parts(Vec<ContentPartField>),
}

/// A content part as sent; only `{"type": "text", "text": …}` is valid for a text-only model.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPartField {
    pub r#type: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallField {
    pub id: String,
    #[serde(default = "function_type")]
    pub r#type: String,
    pub function: FunctionCallField,
}

fn function_type() -> String {
    "function".to_owned()
}

#[derive(Debug, Clone, Deserialize)]
pub struct FunctionCallField {
    pub name: String,
    pub arguments: String,
}

// ---- responses ----

#[derive(Debug, Serialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub system_fingerprint: &'static str,
    /// The request's `service_tier`, echoed (null when it sent none), as vLLM does.
    pub service_tier: Option<ServiceTier>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// One entry per prompt token; the first is null.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<PromptLogprobsAt>>>,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ResponseMessage,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: FinishReasonJson,
    pub stop_reason: Option<StopReasonJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Serialize)]
pub struct ResponseMessage {
    pub role: &'static str,
    /// `None` (null) only when tool calls were parsed and nothing else was said.
    pub content: Option<String>,
    /// What the reasoning parser split off (models whose template marks thinking).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Left out when there are none, as in responses without tools.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ResponseToolCall>,
}

/// A parsed tool call: `{id, type: "function", function: {name, arguments}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseToolCall {
    pub id: String,
    pub r#type: &'static str,
    pub function: ResponseFunctionCall,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResponseFunctionCall {
    pub name: String,
    /// The arguments' JSON text as generated.
    pub arguments: String,
}

/// A streamed call: the whole call in one delta, with its position among the choice's calls.
#[derive(Debug, Clone, Serialize)]
pub struct DeltaToolCall {
    pub index: usize,
    #[serde(flatten)]
    pub call: ResponseToolCall,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReasonJson {
    Stop,
    Length,
    Repetition,
    Abort,
    ToolCalls,
}

/// vLLM's `stop_reason`: the matched stop string, or the stop token id as an integer.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StopReasonJson {
    Text(String),
    Token(u32),
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChoiceLogprobs {
    pub content: Vec<LogprobEntry>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LogprobEntry {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// A prompt position's logprobs: a JSON object keyed by token id (as a string), the prompt's
/// own token first, then the top tokens best first (vLLM's order).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobsAt(pub Vec<(u32, PromptTokenLogprob)>);

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptTokenLogprob {
    pub logprob: f32,
    /// 1-based rank in the vocabulary.
    pub rank: usize,
    pub decoded_token: String,
}

impl Serialize for PromptLogprobsAt {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (id, lp) in &self.0 {
            map.serialize_entry(&id.to_string(), lp)?;
        }
        map.end()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    /// `cached_tokens`: prompt tokens the prefix cache held.
    pub fn new(prompt_tokens: usize, cached_tokens: usize, completion_tokens: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// `cached_tokens`: prompt tokens whose keys and values came from the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct ChatCompletionChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<&'a [u32]>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: Option<FinishReasonJson>,
    pub stop_reason: Option<StopReasonJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<DeltaToolCall>>,
}

/// `POST /v1/completions`'s answer (`object: "text_completion"`).
#[derive(Debug, Serialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
    pub system_fingerprint: &'static str,
}

/// A completion choice, whole or (in a stream) one chunk of it.
#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    /// `prompt index × n + choice`: each prompt's choices in turn.
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    /// Always set in a whole answer; in a stream, on each choice's last chunk only.
    pub finish_reason: Option<FinishReasonJson>,
    pub stop_reason: Option<StopReasonJson>,
    /// The choice's prompt's `prompt_logprobs` (vLLM's shape: one entry per prompt token, the
    /// first null).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<PromptLogprobsAt>>>,
    /// `return_token_ids`: the choice's prompt's ids (in a stream, on its first chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// `return_token_ids`: the generated ids (in a stream, this chunk's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The legacy logprobs: per token its string, its logprob (null for a prompt's first token),
/// the top alternatives as `{token: logprob}` and its offset in the text.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub text_offset: Vec<usize>,
    pub token_logprobs: Vec<Option<f32>>,
    pub tokens: Vec<String>,
    pub top_logprobs: Vec<Option<TopLogprobsAt>>,
}

impl CompletionLogprobs {
    pub fn extend(&mut self, other: CompletionLogprobs) {
        self.text_offset.extend(other.text_offset);
        self.token_logprobs.extend(other.token_logprobs);
        self.tokens.extend(other.tokens);
        self.top_logprobs.extend(other.top_logprobs);
    }
}

/// One position's `{token: logprob}`, in order (the position's own token first); a JSON
/// object, so tokens of the same text appear once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobsAt(pub Vec<(String, f32)>);

impl Serialize for TopLogprobsAt {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (token, lp) in &self.0 {
            map.serialize_entry(token, lp)?;
        }
        map.end()
    }
}

/// A streamed completion's chunk (`object: "text_completion"`, as vLLM sends them).
#[derive(Debug, Serialize)]
pub struct CompletionChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: String,
    pub max_model_len: usize,
    /// A trained model's base model (vLLM lists LoRA adapters so).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

/// `POST /tokenize`: vLLM's completion form (`prompt`) or chat form (`messages`).
#[derive(Debug, Default, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<RequestMessage>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub chat_template: Option<String>,
    pub chat_template_kwargs: Option<JsonObject>,
    pub tools: Option<Vec<Value>>,
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<i64>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// `service_tier`: recorded and echoed in the response (every tier is served the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ServiceTier {
    Auto,
    Default,
    Flex,
    Scale,
    Priority,
}

/// `response_format`: `{type: "text" | "json_object" | "json_schema" | "structural_tag", ...}`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ResponseFormat {
    pub r#type: String,
    pub json_schema: Option<JsonSchemaFormat>,
    /// `structural_tag` only.
    pub structures: Option<Vec<TagStructureField>>,
    pub triggers: Option<Vec<String>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub description: Option<String>,
    pub schema: Option<Value>,
    /// The output always matches the schema, strict or not.
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct TagStructureField {
    pub begin: String,
    pub schema: Value,
    pub end: String,
}

/// vLLM's `structured_outputs`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredOutputs {
    /// A JSON schema, as a JSON string or an object.
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
    /// There is one backend and never a fallback, so either value behaves the same.
    pub disable_fallback: Option<bool>,
    pub disable_any_whitespace: Option<bool>,
    pub disable_additional_properties: Option<bool>,
    pub whitespace_pattern: Option<String>,
    /// `{"type": "structural_tag", "structures": [...], "triggers": [...]}` as a JSON string.
    pub structural_tag: Option<String>,
    #[serde(rename = "_backend")]
    pub backend: Option<String>,
    /// vLLM's internal record of how the backend was chosen; no effect.
    #[serde(rename = "_backend_was_auto")]
    pub backend_was_auto: Option<bool>,
}
