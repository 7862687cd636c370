//! The KV block policy (vLLM's `KVCacheManager` over its `BlockPool`): the block budget of one
//! served model, the prefix cache, and the blocks each sequence holds. The model only stores
//! blocks (`temper_model::SeqCache`); which ones a sequence gets is decided here.
//!
//! Full blocks are published under the hash of every token up to their end (keyed by the adapter
//! and the request's salt), so a later sequence with the same prefix takes them instead of
//! recomputing them (`KvManager::reuse_prefix`); published blocks no sequence holds are evicted
//! least recently used when an allocation needs room. A block goes back to the pool when its
//! last holder drops it.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use temper_model::{Decoder, KvArena, KvBlock, SeqCache, BLOCK_TOKENS};

/// The hash of a prefix (all tokens up to a block's end, chained from the key's seed); 128 bits
/// from two keyed hashes, so that a collision is out of reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PrefixHash(u64, u64);

impl PrefixHash {
    fn chain(parent: PrefixHash, tokens: &[u32]) -> PrefixHash {
        let half = |seed: u64| {
            let mut h = DefaultHasher::new();
            (seed, parent.0, parent.1, tokens).hash(&mut h);
            h.finish()
        };
        PrefixHash(half(0x7465_6d70_6572_0001), half(0x7465_6d70_6572_0002))
    }
}

/// What a sequence's blocks may be shared under: blocks computed with one adapter are found
/// only by sequences of that adapter and the same `cache_salt`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PrefixKey(PrefixHash);

impl PrefixKey {
    /// `adapter`: the served adapter's identity (`LoraAdapter::id`), `None` for base weights.
    pub(crate) fn new(adapter: Option<u64>, salt: Option<&str>) -> PrefixKey {
        let mut h = DefaultHasher::new();
        (adapter, salt).hash(&mut h);
        let seed = h.finish();
        PrefixKey(PrefixHash::chain(PrefixHash(seed, !seed), &[]))
    }
}

/// A snapshot of a served model's KV block pool (`Engine::kv_cache_stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvCacheStats {
    pub capacity_blocks: usize,
    /// Blocks allocated (held by sequences or kept for reuse).
    pub live_blocks: usize,
    /// Published blocks no sequence holds (evicted first when the pool is full).
    pub idle_cached_blocks: usize,
    pub block_bytes: usize,
}

impl KvCacheStats {
    /// Blocks an allocation can get now: free ones plus idle cached ones.
    pub fn available_blocks(&self) -> usize {
        self.capacity_blocks.saturating_sub(self.live_blocks) + self.idle_cached_blocks
    }
}

/// The block pool of one served model (cheap to clone: a handle, which the engine's handles
/// keep for its stats).
#[derive(Clone)]
pub(crate) struct KvManager(Arc<Pool>);

struct Pool {
    arena: KvArena,
    capacity_blocks: usize,
    published: Mutex<Published>,
}

/// Published full blocks by prefix hash, each with the tick of its last use.
#[derive(Default)]
struct Published {
    blocks: HashMap<PrefixHash, (Arc<KvBlock>, u64)>,
    tick: u64,
}

/// One sequence's KV: its blocks, and where its full blocks are published. `Clone` forks it
/// (the blocks are shared until written, see `SeqCache`); dropping it frees its blocks.
#[derive(Clone, Debug)]
pub(crate) struct SeqKv {
    cache: SeqCache,
    /// `None`: its blocks are never shared with other requests.
    key: Option<PrefixKey>,
    /// The hash of each full block so far (with `key`).
    hashes: Vec<PrefixHash>,
}

impl KvManager {
    /// A pool of `capacity_bytes` (at least one block) for `model`'s caches.
    pub(crate) fn new(model: &Decoder, capacity_bytes: usize) -> KvManager {
        let arena = KvArena::new(model.config());
        let capacity_blocks = (capacity_bytes / arena.block_bytes()).max(1);
        KvManager(Arc::new(Pool {
            arena,
            capacity_blocks,
            published: Mutex::new(Published::default()),
        }))
    }

    /// An empty sequence whose full blocks are published under `key` (and which can take
    /// published blocks of the same key); `None`: never shared.
    pub(crate) fn new_seq(&self, key: Option<PrefixKey>) -> SeqKv {
        SeqKv {
            cache: SeqCache::managed(self.0.arena.clone()),
            key,
            hashes: Vec::new(),
        }
    }

    pub(crate) fn block_bytes(&self) -> usize {
        self.0.arena.block_bytes()
    }

    pub(crate) fn stats(&self) -> KvCacheStats {
        let idle = self
            .published()
            .blocks
            .values()
            .filter(|(b, _)| Arc::strong_count(b) == 1)
            .count();
        KvCacheStats {
            capacity_blocks: self.0.capacity_blocks,
            live_blocks: self.0.arena.live_blocks(),
            idle_cached_blocks: idle,
            block_bytes: self.block_bytes(),
        }
    }

    fn published(&self) -> MutexGuard<'_, Published> {
        // A panic while holding the lock leaves the map consistent (every update is one call).
        self.0
            .published
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes the published blocks that hold a prefix of `prompt` (whole blocks, leaving at
    /// least its last token to compute, whose logits the caller needs) into an empty sequence
    /// (vLLM's `get_computed_blocks`). Returns the number of positions now cached.
    pub(crate) fn reuse_prefix(&self, seq: &mut SeqKv, prompt: &[u32]) -> usize {
        let Some(key) = seq.key else {
            return 0;
        };
        if !seq.cache.is_empty() {
            return 0;
        }
        let mut parent = key.0;
        for block in prompt[..prompt.len().saturating_sub(1)].chunks_exact(BLOCK_TOKENS) {
            let hash = PrefixHash::chain(parent, block);
            let Some(found) = self.find(hash) else {
                break;
            };
            seq.cache.push_full_block(found, block);
            seq.hashes.push(hash);
            parent = hash;
        }
        seq.cache.len()
    }

    /// Reserves room for `n` more positions of `seq`: new blocks, and a private copy of a shared
    /// last block (vLLM's `allocate_slots`). `None`: the pool cannot hold them, even after
    /// evicting every idle cached block; someone must be preempted. Then nothing changed.
    pub(crate) fn allocate(&self, seq: &mut SeqKv, n: usize) -> Option<()> {
        let fresh = self.allocate_blocks(seq.cache.blocks_needed(n))?;
        seq.cache.reserve(n, fresh);
        Some(())
    }

    /// `n` new blocks, evicting idle published blocks (least recently used first) when the
    /// budget is reached.
    fn allocate_blocks(&self, n: usize) -> Option<Vec<Arc<KvBlock>>> {
        let live = self.0.arena.live_blocks();
        let short = (live + n).saturating_sub(self.0.capacity_blocks);
        if short > 0 {
            let mut published = self.published();
            let mut idle: Vec<(u64, PrefixHash)> = published
                .blocks
                .iter()
                .filter(|(_, (b, _))| Arc::strong_count(b) == 1)
                .map(|(h, (_, tick))| (*tick, *h))
                .collect();
            if idle.len() < short {
                return None;
            }
            idle.sort_unstable_by_key(|(tick, _)| *tick);
            for (_, h) in &idle[..short] {
                published.blocks.remove(h);
            }
        }
        Some(self.0.arena.allocate(n))
    }

    /// The published block for `hash`, marked used.
    fn find(&self, hash: PrefixHash) -> Option<Arc<KvBlock>> {
        let mut published = self.published();
        published.tick += 1;
        let tick = published.tick;
        let (block, used) = published.blocks.get_mut(&hash)?;
        *used = tick;
        Some(block.clone())
    }

    /// Publishes the blocks `seq`'s last forward filled (a sequence without a key publishes
    /// none).
    pub(crate) fn publish(&self, seq: &mut SeqKv) {
        let Some(key) = seq.key else {
            return;
        };
        let SeqKv { cache, hashes, .. } = seq;
        for (tokens, block) in cache.full_blocks().skip(hashes.len()) {
            let parent = hashes.last().copied().unwrap_or(key.0);
            let hash = PrefixHash::chain(parent, tokens);
            let mut published = self.published();
            published.tick += 1;
            let tick = published.tick;
            published
                .blocks
                .entry(hash)
                .and_modify(|(_, used)| *used = tick)
                .or_insert_with(|| (block.clone(), tick));
            hashes.push(hash);
        }
    }
}

impl SeqKv {
    /// Number of tokens cached (the position the next token takes).
    pub(crate) fn len(&self) -> usize {
        self.cache.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// The tokens cached, in order.
    pub(crate) fn tokens(&self) -> &[u32] {
        self.cache.tokens()
    }

    /// Blocks an append of `n` tokens needs from the pool.
    pub(crate) fn blocks_needed(&self, n: usize) -> usize {
        self.cache.blocks_needed(n)
    }

    /// Most tokens an append can take with `blocks` blocks from the pool.
    pub(crate) fn room_in(&self, blocks: usize) -> usize {
        self.cache.room_in(blocks)
    }

    /// The blocks, for the forward that appends to them (through `KvManager::allocate` first).
    pub(crate) fn cache_mut(&mut self) -> &mut SeqCache {
        &mut self.cache
    }

    /// Forgets positions from `len` on (rejected draft tokens); blocks past it are freed.
    pub(crate) fn truncate(&mut self, len: usize) {
        self.cache.truncate(len);
        self.hashes.truncate(self.cache.len() / BLOCK_TOKENS);
    }

    /// This sequence's blocks, leaving it empty (with the same key).
    pub(crate) fn take(&mut self) -> SeqKv {
        let empty = SeqKv {
            cache: SeqCache::managed(self.cache.arena().clone()),
            key: self.key,
            hashes: Vec::new(),
        };
        std::mem::replace(self, empty)
    }

    /// Frees every block (those published stay in the prefix cache while the pool has room).
    pub(crate) fn free(&mut self) {
        drop(self.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use temper_model::{load_gguf, tiny, Logits, LoraAdapter, LoraConfig, SeqInput};

    fn tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|i| 10 + (i * 37 + salt * 101) % 400)
            .collect()
    }

    /// A forward of `toks` with every row's logits, as the scheduler runs one: allocate, run,
    /// publish.
    fn run(model: &Decoder, kv: &KvManager, seq: &mut SeqKv, toks: &[u32]) -> Logits {
        kv.allocate(seq, toks.len()).expect("room in the pool");
        let logits = model
            .forward(&mut [SeqInput {
                tokens: toks,
                cache: seq.cache_mut(),
                all_logits: true,
                adapter: None,
            }])
            .expect("forward")
            .remove(0);
        kv.publish(seq);
        logits
    }

    #[test]
    fn a_cached_prefix_gives_the_same_bits_as_recomputing_it() {
        let model = tiny::load_tiny(7).expect("tiny model").model;
        let kv = KvManager::new(&model, 1 << 30);
        let key = PrefixKey::new(None, None);
        let first = tokens(40, 1);
        let mut next_turn = first.clone();
        next_turn.extend(tokens(9, 2));

        // The first request publishes its full blocks.
        let mut a = kv.new_seq(Some(key));
        run(&model, &kv, &mut a, &first);
        assert_eq!(kv.stats().live_blocks, 3);

        // The next turn finds them: 40 tokens are two whole blocks... and a partial one, so 32.
        let mut b = kv.new_seq(Some(key));
        let hit = kv.reuse_prefix(&mut b, &next_turn);
        assert_eq!(hit, 2 * BLOCK_TOKENS);
        let cached = run(&model, &kv, &mut b, &next_turn[hit..]);
        let fresh = run(&model, &kv, &mut kv.new_seq(None), &next_turn);
        let tail = &fresh.data[hit * fresh.vocab..];
        assert!(cached.data == tail, "a cached prefix changed the logits");

        // Another salt or another adapter finds nothing; a prompt that is one whole block keeps
        // its last token to compute.
        let salted = PrefixKey::new(None, Some("other team"));
        assert_eq!(
            kv.reuse_prefix(&mut kv.new_seq(Some(salted)), &next_turn),
            0
        );
        let adapter = LoraAdapter::new(model.config(), LoraConfig::default(), 1);
        let with_adapter = PrefixKey::new(Some(adapter.id()), None);
        assert_eq!(
            kv.reuse_prefix(&mut kv.new_seq(Some(with_adapter)), &next_turn),
            0
        );
        assert_eq!(
            kv.reuse_prefix(&mut kv.new_seq(Some(key)), &first[..BLOCK_TOKENS]),
            0
        );
        // An unshared sequence neither publishes nor finds.
        let mut private = kv.new_seq(None);
        assert_eq!(kv.reuse_prefix(&mut private, &next_turn), 0);
    }

    #[test]
    fn the_pool_budget_is_enforced_and_idle_cached_blocks_make_room() {
        let model = tiny::load_tiny(7).expect("tiny model").model;
        let block_bytes = KvArena::new(model.config()).block_bytes();
        let kv = KvManager::new(&model, 4 * block_bytes);
        let key = PrefixKey::new(None, None);

        // Two full blocks published and then released: idle, but still found.
        let published = tokens(2 * BLOCK_TOKENS + 1, 5);
        let mut a = kv.new_seq(Some(key));
        run(&model, &kv, &mut a, &published);
        drop(a);
        let stats = kv.stats();
        assert_eq!((stats.live_blocks, stats.idle_cached_blocks), (2, 2));
        assert_eq!(stats.available_blocks(), 4);

        // A sequence needing five blocks gets none, its cache untouched.
        let mut big = kv.new_seq(None);
        let long = tokens(5 * BLOCK_TOKENS, 6);
        assert_eq!(big.blocks_needed(long.len()), 5);
        assert_eq!(kv.allocate(&mut big, long.len()), None);
        assert_eq!((big.len(), big.cache.blocks()), (0, 0));

        // Four blocks fit by evicting the idle cached ones (least recently used first).
        run(&model, &kv, &mut big, &tokens(4 * BLOCK_TOKENS, 7));
        assert_eq!(kv.stats().live_blocks, 4);
        assert_eq!(kv.reuse_prefix(&mut kv.new_seq(Some(key)), &published), 0);
        drop(big);
        assert_eq!(kv.stats().live_blocks, 0);
    }

    /// On the real model, a 300-token sequence's rows computed through a prefix found in the
    /// cache are the bits one forward gives.
    #[test]
    fn a_cached_prefix_equals_one_forward_bit_for_bit_on_the_real_model() {
        let Some(path) = temper_model::paths::real_model_for_tests() else {
            return;
        };
        let model = load_gguf(&path).unwrap().model;
        let kv = KvManager::new(&model, 1 << 30);
        let toks: Vec<u32> = (0..300u32).map(|i| 100 + (i * 7919) % 20000).collect();
        let whole = run(&model, &kv, &mut kv.new_seq(None), &toks).data;
        let vocab = whole.len() / toks.len();

        let key = PrefixKey::new(None, None);
        run(&model, &kv, &mut kv.new_seq(Some(key)), &toks[..250]);
        let mut reused = kv.new_seq(Some(key));
        let hit = kv.reuse_prefix(&mut reused, &toks);
        assert_eq!(hit, 240);
        let tail = run(&model, &kv, &mut reused, &toks[hit..]).data;
        assert!(
            tail == whole[hit * vocab..],
            "a cached prefix changed the logits"
        );
    }
}
