//! The paged KV cache on the tiny random model (through the real GGUF writer and loader): a
//! row's logits depend only on its own sequence however its prompt is chunked, and forks share
//! blocks until they write. (The prefix cache and the pool's budget are the engine's block
//! manager's, tested there.)

mod common;

use common::{chunked_rows, tokens};
use temper_model::{tiny, Decoder, KvArena, Logits, ModelError, SeqCache, SeqInput, BLOCK_TOKENS};

fn tiny_model() -> Decoder {
    tiny::load_tiny(7).expect("tiny model").model
}

fn run(model: &Decoder, toks: &[u32], cache: &mut SeqCache, all: bool) -> Logits {
    run_with(model, toks, cache, all).expect("forward")
}

fn run_with(
    model: &Decoder,
    toks: &[u32],
    cache: &mut SeqCache,
    all: bool,
) -> Result<Logits, ModelError> {
    Ok(model
        .forward(&mut [SeqInput {
            tokens: toks,
            cache,
            all_logits: all,
            adapter: None,
        }])?
        .remove(0))
}

#[test]
fn a_rows_logits_do_not_depend_on_how_its_sequence_is_chunked() {
    let model = tiny_model();
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
fn forks_share_blocks_until_they_write() {
    let model = tiny_model();
    let prompt = tokens(2 * BLOCK_TOKENS + 3, 4);
    let mut parent = model.new_cache();
    run(&model, &prompt, &mut parent, false);
    let arena = parent.arena().clone();
    let live = || arena.live_blocks();
    assert_eq!(live(), 3);

    let mut forks: Vec<SeqCache> = (0..4).map(|_| parent.clone()).collect();
    assert_eq!(live(), 3, "a fork copies nothing");
    // Each fork writes into the shared partial block: that block alone is copied.
    let mut outs = Vec::new();
    for (i, f) in forks.iter_mut().enumerate() {
        outs.push(run(&model, &[20 + i as u32], f, false));
    }
    assert_eq!(live(), 3 + 4);
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
    assert_eq!(live(), 0, "every block went back to the pool");
}

#[test]
fn a_managed_cache_takes_only_the_blocks_reserved_for_it() {
    let model = tiny_model();
    let arena = KvArena::new(model.config());
    let mut cache = SeqCache::managed(arena.clone());
    let toks = tokens(BLOCK_TOKENS + 3, 8);
    let err = run_with(&model, &toks, &mut cache, false);
    assert!(
        matches!(err, Err(ModelError::KvNotReserved { index: 0 })),
        "{:?}",
        err.map(|_| ())
    );
    assert_eq!(
        (cache.len(), cache.blocks(), arena.live_blocks()),
        (0, 0, 0)
    );

    let needed = cache.blocks_needed(toks.len());
    assert_eq!(needed, 2);
    cache.reserve(toks.len(), arena.allocate(needed));
    let managed = run(&model, &toks, &mut cache, false);
    assert_eq!((cache.len(), arena.live_blocks()), (toks.len(), 2));
    assert!(managed.data == run(&model, &toks, &mut model.new_cache(), false).data);
}
