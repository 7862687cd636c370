//! Trajectories → token sequences (training.md "Trajectory → tokens").
//!
//! The conversation up to the last trainable Choice is rendered once with the chat template,
//! each trainable Choice's content replaced by a unique sentinel. The text between sentinels is
//! tokenized as the server tokenizes prompts; each sentinel becomes the Choice's exact sampled
//! tokens (mask 1, old logprobs from the request). When the sampled tokens end with the
//! template's end-of-turn token, the same text right after the sentinel is not repeated.
//!
//! SFT conversations go through the same rendering and sequence building; their assistant turns
//! are trained on as the template renders them (see [`tokenize_sft_job`]).

use temper_text::{ChatMessage, ChatTemplate, TemplateInput, Tokenizer};

use crate::request::{Choice, MessageOrChoice, SftRequest, SftSchedule, TrainingRequest};
use crate::TrainError;

/// One tokenized conversation (a trajectory or one of its additional histories).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizedSequence {
    pub tokens: Vec<u32>,
    /// Trainable tokens (RL: the sampled ones; SFT: the assistant turns).
    pub mask: Vec<bool>,
    /// The sampler's logprob per token (0 where not trainable, NaN where the request gave none).
    pub old_logprobs: Vec<f32>,
    /// Index of the group and of the trajectory in it (SFT: group 0).
    pub group: usize,
    pub trajectory: usize,
    /// Where it is in the request: `trajectory_groups[g].trajectories[t].messages_and_choices`
    /// or `...trajectories[t].additional_histories[h].messages_and_choices` (SFT:
    /// `trajectories[t].messages`).
    pub source: String,
}

impl TokenizedSequence {
    pub fn trainable_tokens(&self) -> usize {
        self.mask.iter().filter(|m| **m).count()
    }

    /// The trainable tokens' ids, in order.
    pub fn trained_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.tokens
            .iter()
            .zip(&self.mask)
            .filter(|(_, m)| **m)
            .map(|(t, _)| *t)
    }
}

#[derive(Debug, Clone)]
pub struct TokenizedJob {
    pub sequences: Vec<TokenizedSequence>,
    /// Rewards per group, per trajectory.
    pub rewards: Vec<Vec<f64>>,
    pub loss: crate::LossConfig,
}

impl TokenizedJob {
    pub fn check_lengths(&self, max_seq_len: usize) -> Result<(), TrainError> {
        check_lengths(&self.sequences, max_seq_len)
    }
}

/// An SFT job: one sequence per trajectory, and its batches' learning rates.
#[derive(Debug, Clone)]
pub struct TokenizedSftJob {
    pub sequences: Vec<TokenizedSequence>,
    pub schedule: SftSchedule,
}

impl TokenizedSftJob {
    pub fn check_lengths(&self, max_seq_len: usize) -> Result<(), TrainError> {
        check_lengths(&self.sequences, max_seq_len)
    }
}

/// Every sequence fits the trainer's `max_seq_len`: a longer one would have to be cut, and a cut
/// trajectory trains on part of an answer (with the whole answer's reward), so it is an error
/// naming the sequence instead.
fn check_lengths(sequences: &[TokenizedSequence], max_seq_len: usize) -> Result<(), TrainError> {
    match sequences.iter().find(|s| s.tokens.len() > max_seq_len) {
        Some(s) => Err(TrainError::invalid(
            &s.source,
            format!(
                "is {} tokens long once tokenized; this server trains sequences of at most \
                 {max_seq_len} tokens (`--max-train-seq-len`)",
                s.tokens.len()
            ),
        )),
        None => Ok(()),
    }
}

const SENTINEL_OPEN: &str = "\u{E000}temper-splice-";
const SENTINEL_CLOSE: &str = "\u{E001}";

/// Tokenizes every trajectory of the request and resolves its options; anything a job could not
/// train on is an error naming the field.
pub fn tokenize_job(
    req: &TrainingRequest,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
) -> Result<TokenizedJob, TrainError> {
    let loss = req
        .experimental_config
        .clone()
        .unwrap_or_default()
        .resolve()?;
    if req.trajectory_groups.is_empty() {
        return Err(TrainError::invalid(
            "trajectory_groups",
            "must not be empty",
        ));
    }
    let mut sequences = Vec::new();
    let mut rewards = Vec::new();
    for (g, group) in req.trajectory_groups.iter().enumerate() {
        if group.trajectories.is_empty() {
            return Err(TrainError::invalid(
                format!("trajectory_groups[{g}].trajectories"),
                "a group must have at least one trajectory",
            ));
        }
        let mut group_rewards = Vec::new();
        for (t, traj) in group.trajectories.iter().enumerate() {
            let path = format!("trajectory_groups[{g}].trajectories[{t}]");
            if !traj.reward.is_finite() {
                return Err(TrainError::invalid(
                    format!("{path}.reward"),
                    "must be finite",
                ));
            }
            group_rewards.push(traj.reward);
            let main = std::iter::once((
                format!("{path}.messages_and_choices"),
                &traj.messages_and_choices,
                traj.tools.as_deref(),
            ));
            let histories = traj
                .additional_histories
                .iter()
                .enumerate()
                .map(|(h, hist)| {
                    (
                        format!("{path}.additional_histories[{h}].messages_and_choices"),
                        &hist.messages_and_choices,
                        hist.tools.as_deref().or(traj.tools.as_deref()),
                    )
                });
            for (items_path, items, tools) in main.chain(histories) {
                if let Some((tokens, mask, old_logprobs)) =
                    tokenize_conversation(items, tools, tokenizer, template, &items_path)?
                {
                    sequences.push(TokenizedSequence {
                        tokens,
                        mask,
                        old_logprobs,
                        group: g,
                        trajectory: t,
                        source: items_path,
                    });
                }
            }
        }
        rewards.push(group_rewards);
    }
    Ok(TokenizedJob {
        sequences,
        rewards,
        loss,
    })
}

/// Tokenizes every trajectory of an SFT request and resolves its schedule; a trajectory without
/// an assistant message, like anything else it could not train on, is an error naming it.
pub fn tokenize_sft_job(
    req: &SftRequest,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
) -> Result<TokenizedSftJob, TrainError> {
    if req.trajectories.is_empty() {
        return Err(TrainError::invalid("trajectories", "must not be empty"));
    }
    let schedule = req
        .config
        .clone()
        .unwrap_or_default()
        .resolve(req.trajectories.len())?;
    let mut sequences = Vec::with_capacity(req.trajectories.len());
    for (t, traj) in req.trajectories.iter().enumerate() {
        let path = format!("trajectories[{t}].messages");
        let items = &traj.messages_and_choices;
        let Some((tokens, mask, old_logprobs)) =
            tokenize_targets(items, traj.tools.as_deref(), tokenizer, template, &path)?
        else {
            return Err(TrainError::invalid(
                path,
                "has no assistant message to learn from",
            ));
        };
        sequences.push(TokenizedSequence {
            tokens,
            mask,
            old_logprobs,
            group: 0,
            trajectory: t,
            source: path,
        });
    }
    Ok(TokenizedSftJob {
        sequences,
        schedule,
    })
}

type Tokenized = (Vec<u32>, Vec<bool>, Vec<f32>);

/// A Choice as the message the template renders (always the assistant's).
fn as_message(item: &MessageOrChoice) -> ChatMessage {
    match item {
        MessageOrChoice::Message(m) => m.clone(),
        MessageOrChoice::Choice(c) => {
            let mut m = c.message.clone();
            m.role = "assistant".to_owned();
            m
        }
    }
}

/// The conversation as the chat template writes it; a template error is the conversation's.
fn render(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    tools: Option<&[temper_text::ToolDef]>,
    add_generation_prompt: bool,
    path: &str,
) -> Result<String, TrainError> {
    template
        .render(&TemplateInput {
            messages,
            tools,
            documents: None,
            add_generation_prompt,
            continue_final_message: false,
            reasoning_effort: None,
            kwargs: &serde_json::Map::new(),
        })
        .map_err(|e| TrainError::invalid(path, format!("the chat template cannot render it: {e}")))
}

/// One sequence, built left to right from rendered context text (tokenized as the server
/// tokenizes prompts, mask 0) and trained parts (mask 1): RL's sampled tokens or SFT's rendered
/// assistant turns.
struct SequenceBuilder<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    mask: Vec<bool>,
    old: Vec<f32>,
    /// The last token of the sampled tokens just appended (see [`Self::context`]).
    after_sampled: Option<u32>,
}

impl<'a> SequenceBuilder<'a> {
    fn new(tokenizer: &'a Tokenizer) -> Self {
        SequenceBuilder {
            tokenizer,
            tokens: Vec::new(),
            mask: Vec::new(),
            old: Vec::new(),
            after_sampled: None,
        }
    }

    /// Context text, minus a leading end-of-turn the sampled tokens before it already hold (the
    /// last sampled token is a control token, such as Gemma's `<end_of_turn>`, whose text the
    /// template writes right after the content).
    fn context(&mut self, mut text: &str) {
        if let Some(prev) = self.after_sampled.take() {
            if self.tokenizer.is_special(prev) {
                if let Some(piece) = self.tokenizer.piece(prev) {
                    text = text.strip_prefix(piece).unwrap_or(text);
                }
            }
        }
        let ids = self.tokenizer.encode(text, true);
        self.push(&ids, false, &vec![0.0; ids.len()]);
    }

    /// Sampled tokens with the sampler's logprobs, trained exactly as sampled.
    fn sampled(&mut self, ids: &[u32], logprobs: &[f32]) {
        self.push(ids, true, logprobs);
        self.after_sampled = ids.last().copied();
    }

    /// Text to imitate (an assistant turn as the template renders it), tokenized like context;
    /// it has no sampler logprobs.
    fn target(&mut self, text: &str) {
        let ids = self.tokenizer.encode(text, true);
        self.push(&ids, true, &vec![f32::NAN; ids.len()]);
    }

    fn push(&mut self, ids: &[u32], trained: bool, old: &[f32]) {
        self.tokens.extend(ids);
        self.mask.extend(std::iter::repeat_n(trained, ids.len()));
        self.old.extend(old);
    }

    fn finish(self, path: &str) -> Result<Tokenized, TrainError> {
        if self.mask.first() == Some(&true) {
            return Err(TrainError::invalid(
                path,
                "a trained assistant turn needs context before it (a message)",
            ));
        }
        Ok((self.tokens, self.mask, self.old))
    }
}

/// `None` when the conversation has no trainable Choice.
fn tokenize_conversation(
    items: &[MessageOrChoice],
    tools: Option<&[temper_text::ToolDef]>,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    path: &str,
) -> Result<Option<Tokenized>, TrainError> {
    let trainable = |item: &MessageOrChoice| match item {
        MessageOrChoice::Choice(c) => c
            .logprobs
            .as_ref()
            .and_then(|l| l.content.as_ref())
            .is_some(),
        MessageOrChoice::Message(_) => false,
    };
    let Some(last) = items.iter().rposition(trainable) else {
        return Ok(None);
    };
    let mut messages = Vec::with_capacity(last + 1);
    let mut spliced: Vec<(Vec<u32>, Vec<f32>)> = Vec::new();
    for (i, item) in items[..=last].iter().enumerate() {
        match item {
            MessageOrChoice::Choice(c) if trainable(item) => {
                spliced.push(sampled_tokens(c, tokenizer, &format!("{path}[{i}]"))?);
                messages.push(ChatMessage::text(
                    "assistant",
                    format!("{SENTINEL_OPEN}{}{SENTINEL_CLOSE}", spliced.len() - 1),
                ));
            }
            item => messages.push(as_message(item)),
        }
    }
    let text = render(template, &messages, tools, false, path)?;
    let mut seq = SequenceBuilder::new(tokenizer);
    let mut rest = text.as_str();
    for (k, (ids, lps)) in spliced.iter().enumerate() {
        let marker = format!("{SENTINEL_OPEN}{k}{SENTINEL_CLOSE}");
        let Some(at) = rest.find(&marker) else {
            return Err(TrainError::invalid(
                path,
                "the chat template does not render assistant messages verbatim",
            ));
        };
        seq.context(&rest[..at]);
        seq.sampled(ids, lps);
        rest = &rest[at + marker.len()..];
    }
    seq.context(rest);
    seq.finish(path).map(Some)
}

/// SFT: every assistant message (or Choice) is trained on as the template renders its turn,
/// end-of-turn included: the text that rendering the conversation up to and including it adds
/// to the prompt before it (the generation prompt included). Messages after the last assistant
/// message are dropped. `None` when there is no assistant message.
fn tokenize_targets(
    items: &[MessageOrChoice],
    tools: Option<&[temper_text::ToolDef]>,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    path: &str,
) -> Result<Option<Tokenized>, TrainError> {
    let messages: Vec<ChatMessage> = items.iter().map(as_message).collect();
    let mut seq = SequenceBuilder::new(tokenizer);
    // The rendered text the sequence holds so far.
    let mut done = String::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        if i == 0 {
            return Err(TrainError::invalid(
                format!("{path}[0]"),
                "an assistant message needs context before it (a message)",
            ));
        }
        let prompt = render(template, &messages[..i], tools, true, path)?;
        let turn = render(template, &messages[..=i], tools, false, path)?;
        // A template that rewrites earlier turns once later ones follow (e.g. drops old
        // reasoning) has no single rendering to train on.
        let (Some(context), Some(target)) = (
            prompt.strip_prefix(done.as_str()),
            turn.strip_prefix(prompt.as_str()),
        ) else {
            return Err(TrainError::invalid(
                format!("{path}[{i}]"),
                "the chat template does not render this conversation as a continuation of \
                 its earlier turns",
            ));
        };
        seq.context(context);
        seq.target(target);
        done = turn;
    }
    if done.is_empty() {
        return Ok(None);
    }
    seq.finish(path).map(Some)
}

/// A Choice's sampled token ids (`token_id:<id>`, else the entry's `token` and `bytes` as the
/// server emits them, `Tokenizer::id_of_logprob_token`) and the sampler's logprobs.
fn sampled_tokens(
    choice: &Choice,
    tokenizer: &Tokenizer,
    path: &str,
) -> Result<(Vec<u32>, Vec<f32>), TrainError> {
    let entries = choice
        .logprobs
        .as_ref()
        .and_then(|l| l.content.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    if entries.is_empty() {
        return Err(TrainError::invalid(
            format!("{path}.logprobs.content"),
            "a trainable Choice needs at least one token",
        ));
    }
    let vocab = tokenizer.vocab_size();
    let mut ids = Vec::with_capacity(entries.len());
    let mut lps = Vec::with_capacity(entries.len());
    for (j, e) in entries.iter().enumerate() {
        let id = match e.token.strip_prefix("token_id:") {
            Some(n) => n.parse::<u32>().ok().filter(|&id| (id as usize) < vocab),
            None => tokenizer.id_of_logprob_token(&e.token, e.bytes.as_deref()),
        };
        let Some(id) = id else {
            let entry = format!("{path}.logprobs.content[{j}]");
            return Err(match &e.bytes {
                Some(bytes) => TrainError::invalid(
                    entry,
                    format!(
                        "token {:?} with bytes {bytes:?} is not a token of the model's \
                         vocabulary (`token` must be `bytes` read as UTF-8)",
                        e.token
                    ),
                ),
                None => TrainError::invalid(
                    format!("{entry}.token"),
                    format!(
                        "{:?} is not a token of the model's vocabulary (an entry of part of a \
                         UTF-8 character needs its `bytes`)",
                        e.token
                    ),
                ),
            });
        };
        let logprob = match e.logprob {
            Some(lp) if !lp.is_finite() || lp > 0.0 => {
                return Err(TrainError::invalid(
                    format!("{path}.logprobs.content[{j}].logprob"),
                    "must be a finite number <= 0",
                ));
            }
            Some(lp) => lp as f32,
            None => f32::NAN,
        };
        ids.push(id);
        lps.push(logprob);
    }
    Ok((ids, lps))
}
