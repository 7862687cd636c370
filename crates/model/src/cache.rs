//! The paged KV cache: keys and values live in fixed blocks of `BLOCK_TOKENS` positions drawn
//! from one pool per model, whose size is a budget in blocks. A sequence's cache is a table of
//! shared blocks: forks (n choices, beams) share them and copy only the partly filled block they
//! write to (copy on write). Full blocks are published under the hash of every token up to their
//! end (keyed by the adapter and the request's salt), so a later sequence with the same prefix
//! takes them instead of recomputing; published blocks no sequence holds are evicted least
//! recently used when the pool needs room.
//!
//! Every row of the forward is computed the same way whatever else is in the batch, so a block
//! found by its hash holds exactly the bits a recomputation would write.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::ModelError;

/// Positions per KV block.
pub const BLOCK_TOKENS: usize = 16;

/// The hash of a prefix (all tokens up to a block's end, chained from the key's seed); 128 bits
/// from two keyed hashes, so that a collision is out of reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefixHash(u64, u64);

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
pub struct PrefixKey(PrefixHash);

impl PrefixKey {
    /// `adapter`: the served adapter's identity (`LoraAdapter::id`), `None` for base weights.
    pub fn new(adapter: Option<u64>, salt: Option<&str>) -> PrefixKey {
        let mut h = DefaultHasher::new();
        (adapter, salt).hash(&mut h);
        let seed = h.finish();
        PrefixKey(PrefixHash::chain(PrefixHash(seed, !seed), &[]))
    }
}

/// One block: for each layer, `BLOCK_TOKENS` key rows then as many value rows, each
/// `kv_width` f16 values.
pub(crate) struct KvBlock {
    data: Box<[f16]>,
    live: Arc<AtomicUsize>,
}

impl Drop for KvBlock {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The block pool of one model (cheap to clone: a handle).
#[derive(Clone)]
pub struct KvPool(Arc<Pool>);

struct Pool {
    num_layers: usize,
    kv_width: usize,
    capacity: AtomicUsize,
    /// Blocks allocated: held by sequences or published (or both).
    live: Arc<AtomicUsize>,
    published: Mutex<Published>,
}

/// Published full blocks by prefix hash, each with the tick of its last use.
#[derive(Default)]
struct Published {
    blocks: HashMap<PrefixHash, (Arc<KvBlock>, u64)>,
    tick: u64,
}

/// A snapshot of the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvPoolStats {
    pub capacity_blocks: usize,
    /// Blocks allocated (held by sequences or kept for reuse).
    pub live_blocks: usize,
    /// Published blocks no sequence holds (evicted first when the pool is full).
    pub idle_cached_blocks: usize,
    pub block_bytes: usize,
}

impl KvPoolStats {
    /// Blocks an allocation can get now: free ones plus idle cached ones.
    pub fn available_blocks(&self) -> usize {
        self.capacity_blocks.saturating_sub(self.live_blocks) + self.idle_cached_blocks
    }
}

impl KvPool {
    pub(crate) fn new(num_layers: usize, kv_width: usize, capacity_blocks: usize) -> KvPool {
        KvPool(Arc::new(Pool {
            num_layers,
            kv_width,
            capacity: AtomicUsize::new(capacity_blocks),
            live: Arc::new(AtomicUsize::new(0)),
            published: Mutex::new(Published::default()),
        }))
    }

    /// Bytes of one block (all layers' keys and values for `BLOCK_TOKENS` positions).
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * 2
    }

    fn block_elems(&self) -> usize {
        self.0.num_layers * 2 * BLOCK_TOKENS * self.0.kv_width
    }

    /// Sets the budget; blocks already allocated stay until released.
    pub fn set_capacity_bytes(&self, bytes: usize) {
        let blocks = (bytes / self.block_bytes()).max(1);
        self.0.capacity.store(blocks, Ordering::Relaxed);
    }

    pub fn stats(&self) -> KvPoolStats {
        let idle = self
            .published()
            .blocks
            .values()
            .filter(|(b, _)| Arc::strong_count(b) == 1)
            .count();
        KvPoolStats {
            capacity_blocks: self.0.capacity.load(Ordering::Relaxed),
            live_blocks: self.0.live.load(Ordering::Relaxed),
            idle_cached_blocks: idle,
            block_bytes: self.block_bytes(),
        }
    }

    /// Drops every published block no sequence holds.
    pub fn clear_prefix_cache(&self) {
        self.published()
            .blocks
            .retain(|_, (b, _)| Arc::strong_count(b) > 1);
    }

    fn published(&self) -> std::sync::MutexGuard<'_, Published> {
        // A panic while holding the lock leaves the map consistent (every update is one call).
        self.0
            .published
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `n` new blocks, evicting idle published blocks (least recently used first) when the
    /// budget is reached.
    fn allocate(&self, n: usize) -> Result<Vec<Arc<KvBlock>>, ModelError> {
        let capacity = self.0.capacity.load(Ordering::Relaxed);
        let live = self.0.live.load(Ordering::Relaxed);
        let short = (live + n).saturating_sub(capacity);
        if short > 0 {
            let mut published = self.published();
            let mut idle: Vec<(u64, PrefixHash)> = published
                .blocks
                .iter()
                .filter(|(_, (b, _))| Arc::strong_count(b) == 1)
                .map(|(h, (_, tick))| (*tick, *h))
                .collect();
            if idle.len() < short {
                return Err(ModelError::KvCacheFull {
                    needed: n,
                    available: capacity.saturating_sub(live) + idle.len(),
                    capacity,
                });
            }
            idle.sort_unstable_by_key(|(tick, _)| *tick);
            for (_, h) in &idle[..short] {
                published.blocks.remove(h);
            }
        }
        let elems = self.block_elems();
        Ok((0..n)
            .map(|_| {
                self.0.live.fetch_add(1, Ordering::Relaxed);
                Arc::new(KvBlock {
                    data: vec![f16::ZERO; elems].into_boxed_slice(),
                    live: self.0.live.clone(),
                })
            })
            .collect())
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

    fn publish(&self, hash: PrefixHash, block: &Arc<KvBlock>) {
        let mut published = self.published();
        published.tick += 1;
        let tick = published.tick;
        published
            .blocks
            .entry(hash)
            .and_modify(|(_, used)| *used = tick)
            .or_insert_with(|| (block.clone(), tick));
    }
}

/// One sequence's keys and values: a table of blocks (keys already normed and rotated, in
/// f16). `Clone` forks it: the clone shares every block and copies the last one only when it
/// writes to it.
#[derive(Clone)]
pub struct SeqCache {
    pool: KvPool,
    blocks: Vec<Arc<KvBlock>>,
    len: usize,
    /// The tokens at positions `0..len` (the prefix hashes are over them).
    tokens: Vec<u32>,
    /// Where this sequence's full blocks are published; `None`: never.
    key: Option<PrefixKey>,
    /// The hash of each full block so far (with `key`).
    hashes: Vec<PrefixHash>,
}

impl std::fmt::Debug for SeqCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqCache")
            .field("len", &self.len)
            .field("blocks", &self.blocks.len())
            .field("key", &self.key)
            .finish()
    }
}

/// One layer of a sequence's cache as attention reads it: position `p`'s key row is
/// `chunks[p / chunk].0[(p % chunk) * stride..][..stride]`, its value row likewise in `.1`.
pub(crate) struct KvView<'a, T = f16> {
    chunks: Vec<(&'a [T], &'a [T])>,
    chunk: usize,
}

impl<'a, T> KvView<'a, T> {
    pub(crate) fn chunked(chunks: Vec<(&'a [T], &'a [T])>, chunk: usize) -> Self {
        KvView { chunks, chunk }
    }

    /// Keys and values of consecutive positions in one buffer each (a packed segment).
    pub(crate) fn contiguous(keys: &'a [T], values: &'a [T], len: usize) -> Self {
        KvView {
            chunks: vec![(keys, values)],
            chunk: len.max(1),
        }
    }

    /// The parts of the chunks covering positions `lo..hi`, in order, each as (key rows, value
    /// rows, number of rows).
    pub(crate) fn spans(
        &self,
        lo: usize,
        hi: usize,
        stride: usize,
    ) -> impl Iterator<Item = (&'a [T], &'a [T], usize)> + '_ {
        let c = self.chunk;
        (lo / c..hi.div_ceil(c)).map(move |i| {
            let start = (i * c).max(lo);
            let end = ((i + 1) * c).min(hi);
            let (k, v) = self.chunks[i];
            let off = (start - i * c) * stride;
            let n = end - start;
            (&k[off..off + n * stride], &v[off..off + n * stride], n)
        })
    }
}

impl SeqCache {
    pub(crate) fn new(pool: KvPool, key: Option<PrefixKey>) -> Self {
        Self {
            pool,
            blocks: Vec::new(),
            len: 0,
            tokens: Vec::new(),
            key,
            hashes: Vec::new(),
        }
    }

    /// Number of tokens cached (the position the next token takes).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The tokens cached, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Blocks this sequence holds.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Takes the published blocks that hold a prefix of `prompt` (whole blocks, leaving at
    /// least its last token to compute, whose logits the caller needs) into an empty cache.
    /// Returns the number of positions now cached.
    pub fn reuse_prefix(&mut self, prompt: &[u32]) -> usize {
        let Some(key) = self.key else {
            return 0;
        };
        if self.len > 0 {
            return 0;
        }
        let mut parent = key.0;
        for block in prompt[..prompt.len().saturating_sub(1)].chunks_exact(BLOCK_TOKENS) {
            let hash = PrefixHash::chain(parent, block);
            let Some(found) = self.pool.find(hash) else {
                break;
            };
            self.blocks.push(found);
            self.hashes.push(hash);
            self.tokens.extend_from_slice(block);
            parent = hash;
        }
        self.len = self.tokens.len();
        self.len
    }

    /// Blocks an append of `n` tokens needs from the pool (new blocks, and a copy of a shared
    /// last block it writes into).
    pub fn blocks_needed(&self, n: usize) -> usize {
        let new = (self.len + n).div_ceil(BLOCK_TOKENS) - self.blocks.len();
        let partial_shared = !self.len.is_multiple_of(BLOCK_TOKENS)
            && self.blocks.last().is_some_and(|b| Arc::strong_count(b) > 1);
        new + usize::from(n > 0 && partial_shared)
    }

    /// Most tokens an append can take with `blocks` blocks from the pool (the free slots of
    /// its last block, unless that block is shared and must be copied first).
    pub fn room_in(&self, blocks: usize) -> usize {
        let free_slots = self.blocks.len() * BLOCK_TOKENS - self.len;
        let shared = free_slots > 0 && self.blocks.last().is_some_and(|b| Arc::strong_count(b) > 1);
        match (shared, blocks) {
            (true, 0) => 0,
            (true, b) => free_slots + (b - 1) * BLOCK_TOKENS,
            (false, b) => free_slots + b * BLOCK_TOKENS,
        }
    }

    pub(crate) fn fits(&self, pool: &KvPool) -> bool {
        Arc::ptr_eq(&self.pool.0, &pool.0)
    }

    /// Makes room for `n` more positions: new blocks, and a private copy of a shared last
    /// block. On error nothing changed.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<(), ModelError> {
        let mut fresh = self.pool.allocate(self.blocks_needed(n))?;
        if !self.len.is_multiple_of(BLOCK_TOKENS) {
            let last = self.blocks.last_mut().expect("a partial block");
            if Arc::strong_count(last) > 1 {
                let mut copy = fresh.pop().expect("allocated for the copy");
                Arc::get_mut(&mut copy)
                    .expect("a fresh block")
                    .data
                    .copy_from_slice(&last.data);
                *last = copy;
            }
        }
        self.blocks.extend(fresh);
        Ok(())
    }

    /// Writes rows of one layer at positions `start..` (reserved): `k` and `v` hold whole rows.
    pub(crate) fn write(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        let width = self.pool.0.kv_width;
        let per_layer = 2 * BLOCK_TOKENS * width;
        for (i, (kr, vr)) in k.chunks_exact(width).zip(v.chunks_exact(width)).enumerate() {
            let pos = start + i;
            let block = Arc::get_mut(&mut self.blocks[pos / BLOCK_TOKENS])
                .expect("reserve made the written blocks private");
            let at = layer * per_layer + (pos % BLOCK_TOKENS) * width;
            block.data[at..at + width].convert_from_f32_slice(kr);
            let at = at + BLOCK_TOKENS * width;
            block.data[at..at + width].convert_from_f32_slice(vr);
        }
    }

    /// One layer's keys and values over every reserved position.
    pub(crate) fn view(&self, layer: usize) -> KvView<'_> {
        let width = self.pool.0.kv_width;
        let per_layer = 2 * BLOCK_TOKENS * width;
        let rows = BLOCK_TOKENS * width;
        let at = layer * per_layer;
        let chunks = self
            .blocks
            .iter()
            .map(|b| (&b.data[at..at + rows], &b.data[at + rows..at + 2 * rows]))
            .collect();
        KvView::chunked(chunks, BLOCK_TOKENS)
    }

    /// Commits `tokens`, written at positions `len..` of every layer, and publishes the blocks
    /// they fill.
    pub(crate) fn commit(&mut self, tokens: &[u32]) {
        self.len += tokens.len();
        self.tokens.extend_from_slice(tokens);
        let Some(key) = self.key else {
            return;
        };
        while (self.hashes.len() + 1) * BLOCK_TOKENS <= self.len {
            let i = self.hashes.len();
            let parent = self.hashes.last().copied().unwrap_or(key.0);
            let hash = PrefixHash::chain(
                parent,
                &self.tokens[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS],
            );
            self.pool.publish(hash, &self.blocks[i]);
            self.hashes.push(hash);
        }
    }

    /// Forgets positions from `len` on (a failed forward, or rejected draft tokens): blocks past
    /// it go back to the pool.
    pub fn truncate(&mut self, len: usize) {
        let len = len.min(self.len);
        self.len = len;
        self.tokens.truncate(len);
        self.hashes.truncate(len / BLOCK_TOKENS);
        self.release_unused();
    }

    /// Drops reserved blocks past the committed positions.
    pub(crate) fn release_unused(&mut self) {
        self.blocks.truncate(self.len.div_ceil(BLOCK_TOKENS));
    }
}
