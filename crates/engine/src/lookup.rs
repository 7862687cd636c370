//! Draft tokens for speculative decoding by prompt lookup (vLLM's `ngram` proposer, "prompt
//! lookup decoding"): the tokens that followed the latest earlier occurrence of a sequence's last
//! few tokens in its own prompt and output. Echoing, quoting, editing and extracting requests
//! repeat long runs of their prompt, which these drafts predict; the scheduler verifies them all
//! in one forward, so every accepted draft saves a step.
//!
//! Drafts only decide how many positions a step computes, never what is sampled: the scheduler
//! samples every row exactly as it would without them (same logits bit for bit, same random
//! draws), so a wrong draft costs compute and nothing else.

/// Longest suffix looked up (vLLM's `prompt_lookup_max`): longer matches are tried first.
pub(crate) const LOOKUP_MAX: usize = 3;
/// Shortest suffix looked up (vLLM's `prompt_lookup_min`). A single token recurs too often in
/// ordinary text for its continuation to be a useful guess.
pub(crate) const LOOKUP_MIN: usize = 2;

/// Proposes up to `k` draft tokens after the sequence `fed ++ out`, appending them to `out`,
/// which holds the sequence's last token(s) on entry (at least one). The suffix of the last
/// `LOOKUP_MAX` down to `LOOKUP_MIN` tokens is looked up; for the longest length found, its
/// latest earlier occurrence gives the drafts: the tokens that followed it. A continuation
/// that runs into the suffix itself carries on through the drafts already proposed, so a loop
/// of period p drafts k tokens rather than p. Nothing found: `out` is left as it was.
pub(crate) fn propose(fed: &[u32], out: &mut Vec<u32>, k: usize) {
    let total = fed.len() + out.len();
    let at = |i: usize, out: &[u32]| {
        if i < fed.len() {
            fed[i]
        } else {
            out[i - fed.len()]
        }
    };
    let Some(&last) = out.last() else {
        return;
    };
    if k == 0 || total < LOOKUP_MIN + 1 {
        return;
    }
    // `end`: the last position of an earlier occurrence; `len`: how many tokens match there.
    let mut best: Option<(usize, usize)> = None;
    for end in (0..total - 1).rev() {
        if at(end, out) != last {
            continue;
        }
        let len = (1..LOOKUP_MAX.min(end + 1))
            .take_while(|&i| at(end - i, out) == at(total - 1 - i, out))
            .count()
            + 1;
        if len >= LOOKUP_MIN && best.is_none_or(|(_, l)| len > l) {
            best = Some((end, len));
            if len == LOOKUP_MAX {
                break;
            }
        }
    }
    let Some((end, _)) = best else {
        return;
    };
    for i in end + 1..end + 1 + k {
        // i < fed.len() + out.len() always holds: `end` is before the last position and each
        // step appends one token.
        let t = at(i, out);
        out.push(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafts(fed: &[u32], last: u32, k: usize) -> Vec<u32> {
        let mut out = vec![last];
        propose(fed, &mut out, k);
        out[1..].to_vec()
    }

    #[test]
    fn copies_what_followed_the_latest_longest_match() {
        // ... 1 2 3 [4 5 6 7] ... 9 2 3 [8 9] ... 2 3 → the trigram 1 2 3 beats the later bigram.
        let fed = [1, 2, 3, 4, 5, 6, 7, 0, 9, 2, 3, 8, 9, 1, 2];
        assert_eq!(drafts(&fed, 3, 3), vec![4, 5, 6]);
        // Only bigrams: the latest one wins.
        let fed = [5, 2, 3, 4, 5, 6, 0, 9, 2, 3, 8, 9, 1, 2];
        assert_eq!(drafts(&fed, 3, 2), vec![8, 9]);
    }

    #[test]
    fn no_match_no_drafts() {
        assert!(drafts(&[1, 2, 3, 4], 5, 4).is_empty());
        // A single recurring token is not enough.
        assert!(drafts(&[1, 2, 3, 4], 2, 4).is_empty());
        assert!(drafts(&[], 2, 4).is_empty());
        assert!(drafts(&[7], 7, 4).is_empty());
        assert!(drafts(&[1, 2, 1, 2], 1, 0).is_empty());
    }

    #[test]
    fn a_loop_drafts_through_its_own_drafts() {
        // Period 2: the latest trigram match ends one period back.
        assert_eq!(drafts(&[1, 2, 1, 2, 1], 2, 5), vec![1, 2, 1, 2, 1]);
        // One token repeated.
        assert_eq!(drafts(&[7, 7], 7, 3), vec![7, 7, 7]);
    }

    #[test]
    fn a_continuation_is_cut_at_k() {
        let fed = [4, 5, 10, 11, 12, 13, 14, 15, 4];
        assert_eq!(drafts(&fed, 5, 2), vec![10, 11]);
        assert_eq!(drafts(&fed, 5, 1), vec![10]);
    }
}
