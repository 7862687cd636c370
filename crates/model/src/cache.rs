/// Keys and values of one sequence, per layer, row-major `[len, kv_heads * head_dim]` (keys
/// already normed and rotated). `Clone` forks a prefilled prompt.
#[derive(Debug, Clone)]
pub struct SeqCache {
    len: usize,
    kv_width: usize,
    layers: Vec<LayerKv>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct LayerKv {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

impl SeqCache {
    pub(crate) fn new(num_layers: usize, kv_width: usize) -> Self {
        Self {
            len: 0,
            kv_width,
            layers: vec![LayerKv::default(); num_layers],
        }
    }

    /// Number of tokens cached (the position the next token takes).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn fits(&self, num_layers: usize, kv_width: usize) -> bool {
        self.layers.len() == num_layers && self.kv_width == kv_width
    }

    /// Appends rows to one layer; `Vec`'s doubling keeps growth amortised O(1) per token.
    pub(crate) fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let l = &mut self.layers[layer];
        l.k.extend_from_slice(k);
        l.v.extend_from_slice(v);
    }

    pub(crate) fn layer(&self, layer: usize) -> &LayerKv {
        &self.layers[layer]
    }

    /// Commits `n` tokens appended to every layer.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Drops rows appended past `len` (a forward that failed half way).
    pub(crate) fn rollback(&mut self) {
        let keep = self.len * self.kv_width;
        for l in &mut self.layers {
            l.k.truncate(keep);
            l.v.truncate(keep);
        }
    }
}
