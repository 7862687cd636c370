//! The `<think>…</think>` reasoning parser: splits generated text into reasoning and content.
//!
//! Rule (the same whole or streamed, so concatenated deltas equal the non-streamed split): output
//! that begins with `<think>` is reasoning up to `</think>` and content after it; an unclosed
//! `<think>` makes the rest reasoning (generation stopped while thinking); output that does not
//! begin with `<think>` is all content. Templates that open `<think>` in the prompt themselves
//! (the generation prompt ends with it) start the parser inside the reasoning: `new(true)`.

pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";

/// Reasoning and content of one whole output; `reasoning` is `None` when the output has no
/// `<think>` opener.
pub fn split_reasoning(text: &str) -> (Option<String>, String) {
    ReasoningParser::default().split(text)
}

/// What one pushed piece of text turned into (either part may be empty).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReasoningDelta {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not yet known whether the output opens with `<think>`.
    #[default]
    Start,
    Reasoning,
    Content,
}

/// Streaming form: text that might be the beginning of a tag is held back until the next push
/// (or `finish`) decides it.
#[derive(Debug, Default, Clone)]
pub struct ReasoningParser {
    state: State,
    held: String,
    saw_start: bool,
}

impl ReasoningParser {
    /// `opened_by_prompt`: the prompt already ends with `<think>`, so output starts as reasoning.
    pub fn new(opened_by_prompt: bool) -> Self {
        if opened_by_prompt {
            ReasoningParser {
                state: State::Reasoning,
                held: String::new(),
                saw_start: true,
            }
        } else {
            ReasoningParser::default()
        }
    }

    /// One whole output: reasoning (`None` without a `<think>` opener) and content.
    pub fn split(mut self, text: &str) -> (Option<String>, String) {
        let mut first = self.push(text);
        let last = self.finish();
        first.reasoning.push_str(&last.reasoning);
        first.content.push_str(&last.content);
        let reasoning = self.saw_start.then_some(first.reasoning);
        (reasoning, first.content)
    }

    pub fn push(&mut self, text: &str) -> ReasoningDelta {
        self.held.push_str(text);
        let mut out = ReasoningDelta::default();
        loop {
            match self.state {
                State::Start => {
                    if let Some(rest) = self.held.strip_prefix(THINK_START) {
                        self.held = rest.to_owned();
                        self.saw_start = true;
                        self.state = State::Reasoning;
                    } else if THINK_START.starts_with(self.held.as_str()) {
                        return out;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => match self.held.find(THINK_END) {
                    Some(at) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + THINK_END.len());
                        self.state = State::Content;
                    }
                    None => {
                        let keep = partial_suffix(&self.held, THINK_END);
                        let emit = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..emit]);
                        self.held.drain(..emit);
                        return out;
                    }
                },
                State::Content => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// The end of the output: whatever was held back goes where the current state says.
    pub fn finish(&mut self) -> ReasoningDelta {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Reasoning => ReasoningDelta {
                reasoning: held,
                content: String::new(),
            },
            State::Start | State::Content => ReasoningDelta {
                reasoning: String::new(),
                content: held,
            },
        }
    }
}

/// Length of the longest proper prefix of `tag` that `text` ends with (bytes; tags are ASCII, so
/// the cut is on a character boundary).
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(pieces: &[&str]) -> (String, String) {
        let mut p = ReasoningParser::default();
        let (mut r, mut c) = (String::new(), String::new());
        for piece in pieces {
            let d = p.push(piece);
            r.push_str(&d.reasoning);
            c.push_str(&d.content);
        }
        let d = p.finish();
        r.push_str(&d.reasoning);
        c.push_str(&d.content);
        (r, c)
    }

    #[test]
    fn whole_outputs() {
        assert_eq!(
            split_reasoning("<think>why</think>answer"),
            (Some("why".into()), "answer".into())
        );
        assert_eq!(split_reasoning("plain"), (None, "plain".into()));
        assert_eq!(
            split_reasoning("<think>unfinished"),
            (Some("unfinished".into()), String::new())
        );
        // A tag later in the output is content, not reasoning.
        assert_eq!(
            split_reasoning("a <think>b</think>"),
            (None, "a <think>b</think>".into())
        );
        assert_eq!(split_reasoning("<thi"), (None, "<thi".into()));
        assert_eq!(split_reasoning(""), (None, String::new()));
    }

    #[test]
    fn streaming_matches_whole_at_every_split() {
        let text = "<think>a < b </thin</think>x</think>é";
        let (reasoning, content) = split_reasoning(text);
        assert_eq!(reasoning.as_deref(), Some("a < b </thin"));
        assert_eq!(content, "x</think>é");
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        for &(i, _) in &chars {
            for &(j, _) in chars.iter().filter(|(j, _)| *j >= i) {
                let got = streamed(&[&text[..i], &text[i..j], &text[j..]]);
                assert_eq!(
                    got,
                    (reasoning.clone().unwrap(), content.clone()),
                    "{i} {j}"
                );
            }
        }
        // Per character, as tokens of one character would arrive.
        let pieces: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        assert_eq!(streamed(&refs), (reasoning.unwrap(), content));
    }

    #[test]
    fn opened_by_the_prompt() {
        assert_eq!(
            ReasoningParser::new(true).split("why</think>so"),
            (Some("why".into()), "so".into())
        );
        assert_eq!(
            ReasoningParser::new(true).split("still thinking"),
            (Some("still thinking".into()), String::new())
        );
        let mut p = ReasoningParser::new(true);
        assert_eq!(p.push("a</th").reasoning, "a");
        assert_eq!(p.push("ink>b").content, "b");
    }

    #[test]
    fn partial_tag_is_held_back() {
        let mut p = ReasoningParser::default();
        assert_eq!(p.push("<th"), ReasoningDelta::default());
        let d = p.push("ink>abc</th");
        assert_eq!(d.reasoning, "abc");
        let d = p.push("ink>ok");
        assert_eq!((d.reasoning.as_str(), d.content.as_str()), ("", "ok"));
    }
}
