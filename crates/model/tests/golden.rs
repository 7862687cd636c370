//! Gemma 3 270M against llama.cpp (see `tests/fixtures/README.md`): logits bit for bit against
//! its library, greedy decoding against llama-server's golden output.

use temper_model::{load_gguf, Gemma3, SeqCache, SeqInput};

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

/// Feeds `tokens` as one forward and returns the last row's logits, as llama.cpp's
/// `llama_decode` of a batch does.
fn step(model: &Gemma3, cache: &mut SeqCache, tokens: &[u32]) -> Vec<f32> {
    let logits = model
        .forward(&mut [SeqInput {
            tokens,
            cache,
            all_logits: false,
            adapter: None,
        }])
        .expect("forward");
    logits[0].row(0).to_vec()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

fn model() -> Option<Gemma3> {
    let path = temper_model::paths::real_model_for_tests()?;
    Some(load_gguf(&path).expect("load").model)
}

/// The prompt in one forward, then one token per forward along llama.cpp's own greedy ids: the
/// 20 largest logits at every position equal llama.cpp's, bit for bit.
#[test]
fn logits_equal_llama_cpp_bit_for_bit() {
    let Some(model) = model() else {
        return;
    };
    let mut exact = 0;
    let mut total = 0;
    for (si, s) in lines(include_str!("fixtures/llama-logits.jsonl"))
        .iter()
        .enumerate()
    {
        let (prompt, greedy) = (ids(&s["prompt_ids"]), ids(&s["ids"]));
        let mut cache = model.new_cache();
        let mut row = step(&model, &mut cache, &prompt);
        for (pos, top) in s["top_logits"].as_array().expect("top").iter().enumerate() {
            for entry in top.as_array().expect("entries") {
                let id = entry[0].as_u64().expect("id") as usize;
                let want = f32::from_bits(entry[1].as_u64().expect("bits") as u32);
                total += 1;
                if row[id].to_bits() == want.to_bits() {
                    exact += 1;
                } else {
                    panic!(
                        "sample {si} position {pos}: logit of {id} is {} ({:#x}), llama.cpp {want} \
                         ({:#x})",
                        row[id],
                        row[id].to_bits(),
                        want.to_bits()
                    );
                }
            }
            assert_eq!(argmax(&row), greedy[pos], "sample {si} position {pos}");
            if pos + 1 < greedy.len() {
                row = step(&model, &mut cache, &greedy[pos..pos + 1]);
            }
        }
    }
    eprintln!("{exact}/{total} logits identical to llama.cpp's");
}

/// A long context: the prompt in llama.cpp's calls of 58 tokens, then decode steps past 256
/// positions, where ggml splits the attention across its threads: identical bits again.
#[test]
fn long_context_logits_equal_llama_cpp_bit_for_bit() {
    let Some(model) = model() else {
        return;
    };
    let s: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/llama-logits-long.json")).expect("json");
    let (prompt, greedy) = (ids(&s["prompt_ids"]), ids(&s["ids"]));
    let chunk = s["chunk"].as_u64().expect("chunk") as usize;
    // A plain cache: each forward is one llama.cpp call, as the fixture's calls were.
    let mut cache = model.new_cache();
    let mut row = Vec::new();
    for c in prompt.chunks(chunk) {
        row = step(&model, &mut cache, c);
    }
    for (pos, top) in s["top_logits"].as_array().expect("top").iter().enumerate() {
        for entry in top.as_array().expect("entries") {
            let id = entry[0].as_u64().expect("id") as usize;
            let want = entry[1].as_u64().expect("bits") as u32;
            assert_eq!(
                row[id].to_bits(),
                want,
                "position {}: logit of {id}",
                prompt.len() + pos
            );
        }
        assert_eq!(argmax(&row), greedy[pos]);
        if pos + 1 < greedy.len() {
            row = step(&model, &mut cache, &greedy[pos..pos + 1]);
        }
    }
}

/// Greedy decoding through the cache against llama-server's golden continuations (issue 2 asks
/// for the first 16 ids on at least 4 of the 5 prompts). The server's own logprobs carry more
/// than the logits: it sums the softmax in f32, and it reuses the previous request's prompt
/// prefix (so it computes the later prompts in a batch of another size); the logprob
/// differences printed here are those, not ours.
#[test]
fn greedy_matches_llama_server() {
    let Some(model) = model() else {
        return;
    };
    let samples = lines(include_str!("fixtures/greedy-sample.jsonl"));
    let (mut greedy16, mut sum_diff, mut n_diff) = (0, 0f64, 0usize);
    for (si, s) in samples.iter().enumerate() {
        let (prompt, want) = (ids(&s["prompt_ids"]), ids(&s["ids"]));
        let mut cache = model.new_cache();
        let mut row = step(&model, &mut cache, &prompt);
        let mut got = Vec::new();
        let (mut diff, mut n) = (0f64, 0usize);
        for (pos, top) in s["top_logprobs"]
            .as_array()
            .expect("top")
            .iter()
            .enumerate()
        {
            // Logprobs compared while both continuations are the same text.
            if got[..pos] == want[..pos] {
                let lp = log_softmax(&row);
                for e in top.as_array().expect("entries") {
                    let id = e["id"].as_u64().expect("id") as usize;
                    diff += (lp[id] - e["logprob"].as_f64().expect("logprob")).abs();
                    n += 1;
                }
            }
            got.push(argmax(&row));
            if pos + 1 < want.len() {
                row = step(&model, &mut cache, &[*got.last().expect("id")]);
            }
        }
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        if same >= 16 {
            greedy16 += 1;
        }
        sum_diff += diff;
        n_diff += n;
        eprintln!(
            "sample {si}: {same:2}/{} greedy ids identical; top-5 |logprob diff| mean {:.2e} over \
             {} positions",
            want.len(),
            diff / n as f64,
            n / 5
        );
    }
    eprintln!(
        "golden: {greedy16}/{} prompts with 16 identical greedy ids; top-5 logprob diff mean {:.2e}",
        samples.len(),
        sum_diff / n_diff as f64
    );
    assert!(
        greedy16 >= 4,
        "{greedy16}/5 prompts with 16 identical greedy ids"
    );
}
