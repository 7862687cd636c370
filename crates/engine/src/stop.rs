//! Stop strings on the decoded text, with streaming hold-back: text is released only once it can
//! no longer turn out to be the start of a stop string.

pub(crate) struct StopMatcher {
    stops: Vec<String>,
    include_stop: bool,
    /// Longest stop string in bytes (0 when there are none).
    max_stop: usize,
    /// All text decoded so far (cut at the stop match once one is found).
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl StopMatcher {
    pub(crate) fn new(stops: &[String], include_stop: bool) -> Self {
        // An empty stop string would match everywhere; the HTTP layer rejects it, and here it is
        // simply ignored.
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let max_stop = stops.iter().map(String::len).max().unwrap_or(0);
        StopMatcher {
            stops,
            include_stop,
            max_stop,
            text: String::new(),
            emitted: 0,
        }
    }

    /// Adds newly decoded text. Returns the text that may be released now and, when a stop
    /// string matched, that string (generation must end; the returned text then completes the
    /// output up to the cut). With `check` false (before min_tokens) nothing matches, but text
    /// that could start a stop string is still held back, as a later match may begin in it.
    pub(crate) fn push(&mut self, delta: &str, check: bool) -> (String, Option<String>) {
        let old_len = self.text.len();
        self.text.push_str(delta);
        if self.stops.is_empty() {
            return (self.release(self.text.len()), None);
        }
        if !check {
            let hold = self.held_suffix();
            return (self.release(self.text.len() - hold), None);
        }
        // A new match must end inside the new text, so it starts at most max_stop - 1 bytes
        // before it.
        let start = floor_boundary(&self.text, old_len.saturating_sub(self.max_stop - 1));
        let mut best: Option<(usize, usize)> = None; // (byte position, stop index)
        for (k, s) in self.stops.iter().enumerate() {
            if let Some(p) = self.text[start..].find(s.as_str()) {
                let pos = start + p;
                if best.is_none_or(|(bp, _)| pos < bp) {
                    best = Some((pos, k));
                }
            }
        }
        if let Some((pos, k)) = best {
            let stop = self.stops[k].clone();
            let cut = if self.include_stop {
                pos + stop.len()
            } else {
                pos
            };
            // Hold-back guarantees nothing from `pos` on was released yet.
            let cut = cut.max(self.emitted);
            self.text.truncate(cut);
            return (self.release(cut), Some(stop));
        }
        let hold = self.held_suffix();
        (self.release(self.text.len() - hold), None)
    }

    /// The rest of the output, released at the end of generation.
    pub(crate) fn finish(&mut self) -> String {
        self.release(self.text.len())
    }

    fn release(&mut self, end: usize) -> String {
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }

    /// Length in bytes of the longest unreleased suffix that is a proper prefix of a stop
    /// string (at most longest stop - 1 bytes).
    fn held_suffix(&self) -> usize {
        let pending = &self.text[self.emitted..];
        let limit = (self.max_stop - 1).min(pending.len());
        for len in (1..=limit).rev() {
            let at = pending.len() - len;
            if !pending.is_char_boundary(at) {
                continue;
            }
            let suffix = &pending[at..];
            if self
                .stops
                .iter()
                .any(|s| s.len() > len && s.starts_with(suffix))
            {
                return len;
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    /// Feeds deltas; returns the streamed pieces, the finish text, and the matched stop.
    fn run(
        stop_list: &[&str],
        include: bool,
        deltas: &[&str],
    ) -> (Vec<String>, String, Option<String>) {
        let mut m = StopMatcher::new(&stops(stop_list), include);
        let mut out = Vec::new();
        for d in deltas {
            let (text, stop) = m.push(d, true);
            out.push(text);
            if stop.is_some() {
                return (out, m.finish(), stop);
            }
        }
        (out, m.finish(), None)
    }

    #[test]
    fn unchecked_text_never_matches_but_is_held_back() {
        let mut m = StopMatcher::new(&stops(&["ab"]), false);
        // Before min_tokens: "ab" is no stop; the trailing "a" could start one.
        assert_eq!(m.push("xaba", false), ("xab".to_string(), None));
        let (t, s) = m.push("b", true);
        assert_eq!((t.as_str(), s.as_deref()), ("", Some("ab")));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn no_stops_releases_everything_at_once() {
        let (out, fin, stop) = run(&[], false, &["Hello", " world"]);
        assert_eq!(out, vec!["Hello", " world"]);
        assert_eq!(fin, "");
        assert_eq!(stop, None);
    }

    #[test]
    fn stop_split_across_tokens_is_cut_and_never_leaked() {
        let (out, fin, stop) = run(&["STOP"], false, &["abc S", "TO", "P tail"]);
        // "S" and "STO" are held back while they could still start "STOP".
        assert_eq!(out, vec!["abc ", "", ""]);
        assert_eq!(fin, "");
        assert_eq!(stop.as_deref(), Some("STOP"));
    }

    #[test]
    fn include_stop_str_in_output_keeps_the_match() {
        let (out, fin, stop) = run(&["STOP"], true, &["abc S", "TO", "P tail"]);
        assert_eq!(out.concat() + &fin, "abc STOP");
        assert_eq!(stop.as_deref(), Some("STOP"));
    }

    #[test]
    fn false_start_is_released_once_disproved() {
        let (out, fin, stop) = run(&["STOP"], false, &["abc ST", "AR", "T!"]);
        assert_eq!(out, vec!["abc ", "STAR", "T!"]);
        assert_eq!(fin, "");
        assert_eq!(stop, None);
    }

    #[test]
    fn held_back_text_comes_out_at_finish() {
        let (out, fin, stop) = run(&["\n\n"], false, &["line", "\n"]);
        assert_eq!(out, vec!["line", ""]);
        assert_eq!(fin, "\n");
        assert_eq!(stop, None);
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (out, fin, stop) = run(&["world", "lo w"], false, &["hello world"]);
        assert_eq!(out.concat() + &fin, "hel");
        assert_eq!(stop.as_deref(), Some("lo w"));
        let (out, _, stop) = run(&["xyz", "b"], false, &["a", "bc"]);
        assert_eq!(out.concat(), "a");
        assert_eq!(stop.as_deref(), Some("b"));
    }

    #[test]
    fn hold_back_only_for_possible_prefixes() {
        // "ab" cannot start "xyz" nor "bcd"... but "b" can start "bcd".
        let mut m = StopMatcher::new(&stops(&["xyz", "bcd"]), false);
        assert_eq!(m.push("ab", true).0, "a");
        assert_eq!(m.push("q", true).0, "bq");
        // Overlapping prefixes: "aab" must hold "aa" as a possible start.
        let mut m = StopMatcher::new(&stops(&["aab"]), false);
        assert_eq!(m.push("xaa", true).0, "x");
        assert_eq!(m.push("a", true).0, "a");
        let (t, s) = m.push("b", true);
        assert_eq!((t.as_str(), s.as_deref()), ("", Some("aab")));
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let (out, fin, stop) = run(&["é!"], false, &["caf", "é", "é", "!x"]);
        assert_eq!(out.concat() + &fin, "café");
        assert_eq!(stop.as_deref(), Some("é!"));
        let (out, fin, _) = run(&["日本"], false, &["日", "曜"]);
        assert_eq!(out, vec!["", "日曜"]);
        assert_eq!(fin, "");
    }

    #[test]
    fn streamed_plus_final_equals_output_for_many_splits() {
        let text = "the quick brown fox jumps over the lazy dog";
        for stop in ["fox", "lazy d", "dog", "zebra", "o"] {
            for include in [false, true] {
                let expect = match text.find(stop) {
                    Some(p) if include => &text[..p + stop.len()],
                    Some(p) => &text[..p],
                    None => text,
                };
                for chunk in 1..5 {
                    let deltas: Vec<String> = text
                        .as_bytes()
                        .chunks(chunk)
                        .map(|c| String::from_utf8_lossy(c).into_owned())
                        .collect();
                    let refs: Vec<&str> = deltas.iter().map(String::as_str).collect();
                    let (out, fin, _) = run(&[stop], include, &refs);
                    assert_eq!(out.concat() + &fin, expect, "stop {stop:?} chunk {chunk}");
                    // Nothing released mid-stream ever extends past the final output.
                    let mut acc = String::new();
                    for piece in &out {
                        acc.push_str(piece);
                        assert!(expect.starts_with(&acc));
                    }
                }
            }
        }
    }
}
