//! KV block storage: keys and values live in fixed blocks of `BLOCK_TOKENS` positions, and a
//! sequence's cache is a table of shared blocks. Forks (n choices, beams) share them and copy
//! only the partly filled block they write to (copy on write). Which blocks a cache gets, how many
//! may exist and which are shared between requests is a block manager's policy (the engine's):
//! storage has none.
//!
//! Every row of the forward is computed the same way whatever else is in the batch, so a block
//! holding a prefix computed for one sequence holds exactly the bits a recomputation would write.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::ModelConfig;

/// Positions per KV block.
pub const BLOCK_TOKENS: usize = 16;

/// One block: for each layer, `BLOCK_TOKENS` key rows then as many value rows, each
/// `kv_width` f16 values. Shared as `Arc<KvBlock>`; it is freed when its last holder drops it.
pub struct KvBlock {
    data: Box<[f16]>,
    live: Arc<AtomicUsize>,
}

impl Drop for KvBlock {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a model's blocks come from: their shape and a count of those alive (cheap to clone: a
/// handle). It allocates whatever it is asked for; budgets are the caller's.
#[derive(Clone)]
pub struct KvArena(Arc<Arena>);

struct Arena {
    num_layers: usize,
    kv_width: usize,
    /// Blocks allocated here and not yet dropped.
    live: Arc<AtomicUsize>,
}

impl KvArena {
    /// An arena for the caches of a model of this shape.
    pub fn new(cfg: &ModelConfig) -> KvArena {
        KvArena(Arc::new(Arena {
            num_layers: cfg.num_layers,
            kv_width: cfg.num_kv_heads * cfg.head_dim,
            live: Arc::new(AtomicUsize::new(0)),
        }))
    }

    /// Bytes of one block (all layers' keys and values for `BLOCK_TOKENS` positions).
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * 2
    }

    fn block_elems(&self) -> usize {
        self.0.num_layers * 2 * BLOCK_TOKENS * self.0.kv_width
    }

    /// Blocks allocated here that some cache (or block manager) still holds.
    pub fn live_blocks(&self) -> usize {
        self.0.live.load(Ordering::Relaxed)
    }

    /// `n` new zeroed blocks.
    pub fn allocate(&self, n: usize) -> Vec<Arc<KvBlock>> {
        let elems = self.block_elems();
        (0..n)
            .map(|_| {
                self.0.live.fetch_add(1, Ordering::Relaxed);
                Arc::new(KvBlock {
                    data: vec![f16::ZERO; elems].into_boxed_slice(),
                    live: self.0.live.clone(),
                })
            })
            .collect()
    }

    fn fits(&self, cfg: &ModelConfig) -> bool {
        self.0.num_layers == cfg.num_layers && self.0.kv_width == cfg.num_kv_heads * cfg.head_dim
    }
}

/// One sequence's keys and values: a table of blocks (keys already normed and rotated, in
/// f16). `Clone` forks it: the clone shares every block and copies the last one only when it
/// writes to it.
#[derive(Clone)]
pub struct SeqCache {
    arena: KvArena,
    blocks: Vec<Arc<KvBlock>>,
    len: usize,
    /// The tokens at positions `0..len`.
    tokens: Vec<u32>,
    /// Whether `Decoder::forward` allocates the blocks an append lacks; a managed cache gets its
    /// blocks only through `SeqCache::reserve`, so its manager's budget holds.
    grows: bool,
}

impl std::fmt::Debug for SeqCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqCache")
            .field("len", &self.len)
            .field("blocks", &self.blocks.len())
            .field("grows", &self.grows)
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
    /// An empty cache that takes what blocks it needs from `arena` as it grows.
    pub fn new(arena: KvArena) -> Self {
        Self::with_growth(arena, true)
    }

    /// An empty cache whose blocks come only from `SeqCache::reserve` (a block manager's).
    pub fn managed(arena: KvArena) -> Self {
        Self::with_growth(arena, false)
    }

    fn with_growth(arena: KvArena, grows: bool) -> Self {
        Self {
            arena,
            blocks: Vec::new(),
            len: 0,
            tokens: Vec::new(),
            grows,
        }
    }

    /// The arena this cache's blocks come from.
    pub fn arena(&self) -> &KvArena {
        &self.arena
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

    /// The full blocks, each with the tokens it holds, in order.
    pub fn full_blocks(&self) -> impl Iterator<Item = (&[u32], &Arc<KvBlock>)> {
        self.tokens.chunks_exact(BLOCK_TOKENS).zip(&self.blocks)
    }

    /// Appends a full block computed before (found by its prefix) holding `tokens`, the next
    /// `BLOCK_TOKENS` tokens of this cache, which must end on a block boundary with nothing
    /// reserved past it.
    pub fn push_full_block(&mut self, block: Arc<KvBlock>, tokens: &[u32]) {
        assert!(
            tokens.len() == BLOCK_TOKENS && self.blocks.len() * BLOCK_TOKENS == self.len,
            "a full block appended at a block boundary"
        );
        self.blocks.push(block);
        self.tokens.extend_from_slice(tokens);
        self.len += BLOCK_TOKENS;
    }

    /// Blocks an append of `n` tokens needs (new blocks, and a copy of a shared last block it
    /// writes into).
    pub fn blocks_needed(&self, n: usize) -> usize {
        let new = (self.len + n)
            .div_ceil(BLOCK_TOKENS)
            .saturating_sub(self.blocks.len());
        let partial_shared = !self.len.is_multiple_of(BLOCK_TOKENS)
            && self.blocks.last().is_some_and(|b| Arc::strong_count(b) > 1);
        new + usize::from(n > 0 && partial_shared)
    }

    /// Most tokens an append can take with `blocks` more blocks (the free slots of its last
    /// block, unless that block is shared and must be copied first).
    pub fn room_in(&self, blocks: usize) -> usize {
        let free_slots = self.blocks.len() * BLOCK_TOKENS - self.len;
        let shared = free_slots > 0 && self.blocks.last().is_some_and(|b| Arc::strong_count(b) > 1);
        match (shared, blocks) {
            (true, 0) => 0,
            (true, b) => free_slots + (b - 1) * BLOCK_TOKENS,
            (false, b) => free_slots + b * BLOCK_TOKENS,
        }
    }

    /// Makes room for `n` more positions with `fresh`, `blocks_needed(n)` blocks of this cache's
    /// arena: new blocks, and a private copy of a shared last block.
    pub fn reserve(&mut self, n: usize, mut fresh: Vec<Arc<KvBlock>>) {
        assert_eq!(
            fresh.len(),
            self.blocks_needed(n),
            "blocks for the reservation"
        );
        if n > 0 && !self.len.is_multiple_of(BLOCK_TOKENS) {
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
    }

    /// Makes sure `n` more positions are reserved: a growing cache allocates what it lacks.
    /// `false`: a managed cache without that room.
    pub(crate) fn ensure_room(&mut self, n: usize) -> bool {
        let needed = self.blocks_needed(n);
        if needed == 0 {
            return true;
        }
        if !self.grows {
            return false;
        }
        let fresh = self.arena.allocate(needed);
        self.reserve(n, fresh);
        true
    }

    pub(crate) fn fits(&self, cfg: &ModelConfig) -> bool {
        self.arena.fits(cfg)
    }

    /// Writes rows of one layer at positions `start..` (reserved): `k` and `v` hold whole rows.
    pub(crate) fn write(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        let width = self.arena.0.kv_width;
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
        let width = self.arena.0.kv_width;
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

    /// Commits `tokens`, written at positions `len..` of every layer.
    pub(crate) fn commit(&mut self, tokens: &[u32]) {
        self.len += tokens.len();
        self.tokens.extend_from_slice(tokens);
    }

    /// Forgets positions from `len` on (a failed forward, or rejected draft tokens): blocks past
    /// it are dropped.
    pub fn truncate(&mut self, len: usize) {
        let len = len.min(self.len);
        self.len = len;
        self.tokens.truncate(len);
        self.release_unused();
    }

    /// Drops reserved blocks past the committed positions.
    pub(crate) fn release_unused(&mut self) {
        self.blocks.truncate(self.len.div_ceil(BLOCK_TOKENS));
    }
}
