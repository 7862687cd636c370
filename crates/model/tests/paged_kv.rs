//! The paged KV cache on the tiny random model (through the real GGUF writer and loader): a
//! row's logits depend only on its own sequence however its prompt is chunked, a prefix found
//! in the cache gives the bits a recomputation gives, forks share blocks until they write, and
//! the pool's budget is enforced without losing a cache.

use temper_model::{
    load_gguf, tiny, Gemma3, Logits, LoraAdapter, LoraConfig, ModelError, PrefixKey, SeqCache,
    SeqInput, BLOCK_TOKENS,
};

fn tiny_model(name: &str) -> Gemma3 {
    let path = std::env::temp_dir().join(format!(
        "temper-model-{}-paged-{name}.gguf",
        std::process::id()
    ));
    tiny::write_tiny_gguf(&path, 7).expect("write tiny model");
    let model = load_gguf(&path).expect("load tiny model").model;
    let _ = std::fs::remove_file(&path);
    model
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 10 + (i * 37 + salt * 101) % 400)
        .collect()
}

fn run(model: &Gemma3, toks: &[u32], cache: &mut SeqCache, all: bool) -> Logits {
    run_with(model, toks, cache, all, None).expect("forward")
}

fn run_with(
    model: &Gemma3,
    toks: &[u32],
    cache: &mut SeqCache,
    all: bool,
    adapter: Option<&LoraAdapter>,
) -> Result<Logits, ModelError> {
    Ok(model
        .forward(&mut [SeqInput {
            tokens: toks,
            cache,
            all_logits: all,
            adapter,
        }])?
        .remove(0))
}

/// The logits rows of `toks` computed in forwards of the given sizes (cycled).
fn chunked_rows(model: &Gemma3, toks: &[u32], sizes: &[usize]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let mut rows = Vec::new();
    let mut at = 0;
    for &size in sizes.iter().cycle() {
        if at == toks.len() {
            break;
        }
        let end = (at + size).min(toks.len());
        rows.extend(run(model, &toks[at..end], &mut cache, true).data);
        at = end;
    }
    rows
}

#[test]
fn a_rows_logits_do_not_depend_on_how_its_sequence_is_chunked() {
    let model = tiny_model("chunks");
    // Past the sliding window (8) and over several blocks.
    let toks = tokens(3 * BLOCK_TOKENS + 5, 3);
    let whole = chunked_rows(&model, &toks, &[toks.len()]);
    for sizes in [&[1][..], &[7], &[16], &[3, 29, 1], &[BLOCK_TOKENS + 1]] {
        assert!(
            chunked_rows(&model, &toks, sizes) == whole,
            "chunks of {sizes:?} changed the logits"
        );
    }
}

#[test]
fn a_cached_prefix_gives_the_same_bits_as_recomputing_it() {
    let model = tiny_model("prefix");
    let key = PrefixKey::new(None, None);
    let first = tokens(40, 1);
    let mut next_turn = first.clone();
    next_turn.extend(tokens(9, 2));

    // The first request publishes its full blocks.
    let mut a = model.new_shared_cache(key);
    run(&model, &first, &mut a, false);
    assert_eq!(model.kv_pool().stats().live_blocks, 3);

    // The next turn finds them: 40 tokens are two whole blocks... and a partial one, so 32.
    let mut b = model.new_shared_cache(key);
    let hit = b.reuse_prefix(&next_turn);
    assert_eq!(hit, 2 * BLOCK_TOKENS);
    let cached = run(&model, &next_turn[hit..], &mut b, true);
    let fresh = run(&model, &next_turn, &mut model.new_cache(), true);
    let tail = &fresh.data[hit * fresh.vocab..];
    assert!(cached.data == tail, "a cached prefix changed the logits");

    // Another salt or another adapter finds nothing; a prompt that is one whole block keeps
    // its last token to compute.
    let salted = PrefixKey::new(None, Some("other team"));
    assert_eq!(model.new_shared_cache(salted).reuse_prefix(&next_turn), 0);
    let adapter = LoraAdapter::new(model.config(), LoraConfig::default(), 1);
    let with_adapter = PrefixKey::new(Some(adapter.id()), None);
    assert_eq!(
        model
            .new_shared_cache(with_adapter)
            .reuse_prefix(&next_turn),
        0
    );
    assert_eq!(
        model
            .new_shared_cache(key)
            .reuse_prefix(&first[..BLOCK_TOKENS]),
        0
    );
    // An unshared cache neither publishes nor finds.
    let mut private = model.new_cache();
    assert_eq!(private.reuse_prefix(&next_turn), 0);
}

#[test]
fn forks_share_blocks_until_they_write() {
    let model = tiny_model("fork");
    let prompt = tokens(2 * BLOCK_TOKENS + 3, 4);
    let mut parent = model.new_cache();
    run(&model, &prompt, &mut parent, false);
    let live = |m: &Gemma3| m.kv_pool().stats().live_blocks;
    assert_eq!(live(&model), 3);

    let mut forks: Vec<SeqCache> = (0..4).map(|_| parent.clone()).collect();
    assert_eq!(live(&model), 3, "a fork copies nothing");
    // Each fork writes into the shared partial block: that block alone is copied.
    let mut outs = Vec::new();
    for (i, f) in forks.iter_mut().enumerate() {
        outs.push(run(&model, &[20 + i as u32], f, false));
    }
    assert_eq!(live(&model), 3 + 4);
    // The same as each continuation computed from scratch.
    for (i, out) in outs.iter().enumerate() {
        let mut seq = prompt.clone();
        seq.push(20 + i as u32);
        let fresh = run(&model, &seq, &mut model.new_cache(), false);
        assert!(
            out.data == fresh.data,
            "fork {i} differs from its recomputation"
        );
    }
    drop(forks);
    drop(parent);
    assert_eq!(live(&model), 0, "every block went back to the pool");
}

#[test]
fn the_pool_budget_is_enforced_and_idle_cached_blocks_make_room() {
    let model = tiny_model("budget");
    let pool = model.kv_pool();
    pool.set_capacity_bytes(4 * pool.block_bytes());
    let key = PrefixKey::new(None, None);

    // Two full blocks published and then released: idle, but still found.
    let published = tokens(2 * BLOCK_TOKENS + 1, 5);
    let mut a = model.new_shared_cache(key);
    run(&model, &published, &mut a, false);
    drop(a);
    let stats = pool.stats();
    assert_eq!((stats.live_blocks, stats.idle_cached_blocks), (2, 2));
    assert_eq!(stats.available_blocks(), 4);

    // A sequence needing five blocks fails cleanly, its cache untouched.
    let mut big = model.new_cache();
    let err = run_with(&model, &tokens(5 * BLOCK_TOKENS, 6), &mut big, false, None);
    assert!(
        matches!(err, Err(ModelError::KvCacheFull { needed: 5, .. })),
        "{:?}",
        err.map(|_| ())
    );
    assert_eq!((big.len(), big.blocks()), (0, 0));

    // Four blocks fit by evicting the idle cached ones (least recently used first).
    run(&model, &tokens(4 * BLOCK_TOKENS, 7), &mut big, false);
    assert_eq!(pool.stats().live_blocks, 4);
    assert_eq!(model.new_shared_cache(key).reuse_prefix(&published), 0);
    drop(big);
    assert_eq!(pool.stats().live_blocks, 0);
}
