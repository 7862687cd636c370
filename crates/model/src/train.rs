//! Scoring and LoRA training over packed sequences.
//!
//! The forward runs the serving kernels (the quantized `Linear::forward`, the same norm, rope,
//! attention and activation arithmetic, the same per-row adapter term), so the trainer's logprobs are
//! the server's. The backward is written by hand on f32 slices: gradients reach the input of a
//! frozen linear through its weight (activation quantization in the forward is treated as
//! identity, the usual straight-through choice), as int8 dot products with a transposed Q8_0
//! copy of it and the gradient quantized per block of 32 (`Linear::backward_input`); only the
//! adapters get grads.

use rayon::prelude::*;

use crate::layer::{AttentionTape, BatchLayout, LayerTape, MlpTape, PackedKv, Ropes};
use crate::linear::{GradBlocks, Linear};
use crate::lora::{LoraAdapter, LoraGrads, LoraPair, LoraTarget};
use crate::model::{add_assign, norm_if_backward, AdapterSpan, Decoder, Layer, Mlp};
use crate::ops::{self, MatRef};
use crate::ModelError;

/// Rows of the LM head computed at once: `HEAD_CHUNK x vocab` logits exist at a time
/// (64 x 262,144 x 4 B = 64 MiB on Gemma 3), never the whole sequence's. The training forward
/// turns each chunk's logits into the logprob's gradient to the hidden state right away. Each
/// chunk reads the whole head and its transposed copy from memory: 512 rows of Gemma 3's
/// pair-bound Q8_0 head forward took 0.68-0.69 s in chunks of 64 against 0.69-0.93 s in chunks
/// of 32 (a Q8_0 head widened to 16-bit pairs 1.05 s against 1.26-1.39 s; 96 rows no better),
/// the backward and Qwen3-0.6B's Q6_K head the same either way.
const HEAD_CHUNK: usize = 64;

/// Segments packed into one sequence: each attends only within itself; positions restart at 0.
pub struct PackedSequence<'a> {
    pub tokens: &'a [u32],
    /// Sums to `tokens.len()`.
    pub segment_lens: &'a [usize],
    /// Per token: compute log p(token | earlier tokens of its segment); never a segment's first
    /// token.
    pub scored: &'a [bool],
}

/// One entry per scored token, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenScores {
    pub logprobs: Vec<f32>,
    /// Entropy (nats) of the model's distribution for that token's position.
    pub entropies: Vec<f32>,
}

/// What the backward needs from a training forward.
pub struct TrainTape {
    layout: BatchLayout,
    /// Token range of each segment.
    segments: Vec<std::ops::Range<usize>>,
    layers: Vec<LayerTape>,
    /// The row whose hidden state predicts each scored token (the token before it).
    head_rows: Vec<usize>,
    targets: Vec<u32>,
    /// Hidden states of `head_rows` before the final norm.
    head_in: Vec<f32>,
    head: HeadGrad,
}

/// The LM head's part of the backward, as the forward left it.
enum HeadGrad {
    /// No LM-head pair: d logprob / d (normed hidden state) of each scored token,
    /// `(onehot - softmax)·E`, made while the chunk's logits exist (the backward never computes
    /// them again) and scaled by each token's logprob gradient in the backward.
    PerLogprob(Vec<f32>),
    /// An LM-head pair, the loss's gradient given to the forward
    /// ([`Decoder::train_forward_pointwise`]): the gradient of the normed hidden states and the
    /// pair's grads, made for `dlogprobs`.
    Done {
        d_normed: Vec<f32>,
        grad_a: Vec<f32>,
        grad_b: Vec<f32>,
        dlogprobs: Vec<f32>,
    },
    /// An LM-head pair, the loss's gradient unknown in the forward: the normed hidden states of
    /// `head_rows`, from which the backward computes the chunks' logits again (the pair's `dB`
    /// needs each token's `onehot - softmax` times its logprob's gradient: one more LM-head
    /// product).
    Recompute(Vec<f32>),
}

/// The derivative of a loss with respect to the `i`-th scored token's logprob, from that logprob
/// alone (the Tinker losses are of this kind).
pub type PointwiseLossGrad<'a> = &'a (dyn Fn(usize, f32) -> f32 + Sync);

impl Decoder {
    /// Forward only: the same numbers the serving path returns for these tokens (same kernels).
    pub fn score(
        &self,
        seq: &PackedSequence<'_>,
        adapter: Option<&LoraAdapter>,
    ) -> Result<TokenScores, ModelError> {
        Ok(self.run_packed(seq, adapter, false, None)?.0)
    }

    /// Forward that records what the backward needs. The LM head runs in chunks of rows: the
    /// full-vocabulary logits of the whole sequence never exist at once.
    pub fn train_forward(
        &self,
        seq: &PackedSequence<'_>,
        adapter: &LoraAdapter,
    ) -> Result<(TokenScores, TrainTape), ModelError> {
        let (scores, tape) = self.run_packed(seq, Some(adapter), true, None)?;
        let tape = tape.ok_or_else(|| ModelError::Packing("no tape recorded".into()))?;
        Ok((scores, tape))
    }

    /// [`Decoder::train_forward`] for a loss whose gradient with respect to each scored token's
    /// logprob follows from that logprob (`dlogp(i, logprob)`). With an LM-head pair the head's
    /// backward then runs in the forward, on the logits it has (else the backward computes them
    /// again); [`Decoder::backward`] must get the same gradients. Without one it is
    /// `train_forward`.
    pub fn train_forward_pointwise(
        &self,
        seq: &PackedSequence<'_>,
        adapter: &LoraAdapter,
        dlogp: PointwiseLossGrad<'_>,
    ) -> Result<(TokenScores, TrainTape), ModelError> {
        let (scores, tape) = self.run_packed(seq, Some(adapter), true, Some(dlogp))?;
        let tape = tape.ok_or_else(|| ModelError::Packing("no tape recorded".into()))?;
        Ok((scores, tape))
    }

    /// Bytes of frozen weights kept for training: the backward's transposed Q8_0 copies (about
    /// 0.3 GB on Gemma 3 270M, the tied embedding's 178 MB included; made on the first
    /// training forward) and the training forward's widened copies (`Linear::keep_widened`).
    pub fn training_cache_bytes(&self) -> usize {
        self.lm_head.training_copy_bytes()
            + self
                .layers
                .iter()
                .flat_map(|l| LoraTarget::ALL.map(|t| l.linear(t).training_copy_bytes()))
                .sum::<usize>()
    }

    /// Every weight kept in the layout its batches run on (see [`Linear::keep_widened`]), and
    /// every input gradient's weight that the backward reads (see [`Linear::keep_input_grad`]),
    /// once. All weights side by side: built on each weight's first backward instead, layer
    /// after layer, they took a process's first step at Qwen3-0.6B's shape to twice a steady
    /// one (10.3 s against 5.1 s at 16x30).
    fn keep_training_weights(&self) -> Result<(), ModelError> {
        let head = (&self.lm_head, true);
        let layers = self
            .layers
            .iter()
            .enumerate()
            .flat_map(|(li, l)| LoraTarget::ALL.map(|t| (l.linear(t), input_grad_used(li, t))));
        let linears: Vec<(&Linear, bool)> = std::iter::once(head).chain(layers).collect();
        linears.par_iter().try_for_each(|&(l, input_grad)| {
            l.keep_widened();
            match input_grad {
                true => l.keep_input_grad(),
                false => Ok(()),
            }
        })
    }

    fn validate_packed(&self, seq: &PackedSequence<'_>) -> Result<(), ModelError> {
        let bad = |reason: String| Err(ModelError::Packing(reason));
        let n = seq.tokens.len();
        if n == 0 {
            return bad("no tokens".into());
        }
        if seq.scored.len() != n {
            return bad(format!("{} scored flags for {n} tokens", seq.scored.len()));
        }
        if seq.segment_lens.iter().sum::<usize>() != n {
            return bad(format!("segment lengths do not sum to {n} tokens"));
        }
        let mut start = 0;
        for (i, &len) in seq.segment_lens.iter().enumerate() {
            if len == 0 {
                return bad(format!("segment {i} is empty"));
            }
            if len > self.cfg.context_length {
                return Err(ModelError::ContextOverflow {
                    len,
                    max: self.cfg.context_length,
                });
            }
            if seq.scored[start] {
                return bad(format!("segment {i}'s first token is scored"));
            }
            start += len;
        }
        self.check_tokens(seq.tokens)
    }

    fn run_packed(
        &self,
        seq: &PackedSequence<'_>,
        adapter: Option<&LoraAdapter>,
        record: bool,
        dlogp: Option<PointwiseLossGrad<'_>>,
    ) -> Result<(TokenScores, Option<TrainTape>), ModelError> {
        self.validate_packed(seq)?;
        if adapter.is_some_and(|a| !a.fits(&self.cfg)) {
            return Err(ModelError::AdapterMismatch { index: 0 });
        }
        if record {
            self.keep_training_weights()?;
        }
        let cfg = &self.cfg;
        let n = seq.tokens.len();
        let mut segments = Vec::with_capacity(seq.segment_lens.len());
        let mut layout = BatchLayout {
            seq: Vec::with_capacity(n),
            pos: Vec::with_capacity(n),
        };
        let mut start = 0;
        for (i, &len) in seq.segment_lens.iter().enumerate() {
            segments.push(start..start + len);
            layout.seq.extend(std::iter::repeat_n(i, len));
            layout.pos.extend(0..len);
            start += len;
        }
        let spans: Vec<AdapterSpan> = adapter
            .map(|adapter| AdapterSpan {
                rows: 0..n,
                adapter,
            })
            .into_iter()
            .collect();
        let ropes = Ropes::new(&layout.pos, cfg);
        let mut kv = PackedKv {
            segments: &segments,
        };

        let mut x = self.embed_tokens(seq.tokens)?;
        let mut tapes = Vec::new();
        for li in 0..self.layers.len() {
            let (output, tape) =
                self.layer_forward(li, &x, &layout, &ropes, &spans, &mut kv, record)?;
            x = output;
            tapes.extend(tape);
        }

        let head_rows: Vec<usize> = (0..n).filter(|&t| seq.scored[t]).map(|t| t - 1).collect();
        let targets: Vec<u32> = (0..n)
            .filter(|&t| seq.scored[t])
            .map(|t| seq.tokens[t])
            .collect();
        let hidden = cfg.hidden_size;
        let mut head_in = Vec::with_capacity(head_rows.len() * hidden);
        for &r in &head_rows {
            head_in.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let mut head_normed = head_in.clone();
        self.final_norm.forward(&mut head_normed, cfg.rms_eps);

        let mut scores = TokenScores {
            logprobs: Vec::with_capacity(targets.len()),
            entropies: Vec::with_capacity(targets.len()),
        };
        let head_pair = adapter.filter(|a| a.head().is_some());
        // The backward's first part, made here where it can be: without an LM-head pair,
        // `(onehot - softmax)·E`; with one and the loss's gradient given, all of it.
        let grad_now = record && (head_pair.is_none() || dlogp.is_some());
        let pointwise = dlogp.filter(|_| head_pair.is_some());
        let mut head_grad = Vec::with_capacity(if grad_now { head_normed.len() } else { 0 });
        let mut pair_grads = head_pair.and_then(|a| a.head()).map(|p| LoraGrads {
            grads: vec![vec![0f32; p.a.len()], vec![0f32; p.b.len()]],
        });
        let mut dlogprobs = Vec::new();
        // Without an LM-head pair, on a quantized head: `(onehot - softmax)·E` as
        // `E[target] - (e·E) / Σ e` with `e = exp(z - max)`, each chunk of e quantized while it
        // is in L1 (the logits are read twice, never scaled or copied), and the one-hot row
        // taken from the weight in f32 rather than quantized with the softmax's block.
        // The chunks of exponentials never cross a span of the transposed head.
        const { assert!(crate::linear::INPUT_GRAD_SPAN.is_multiple_of(crate::softmax::CHUNK)) };
        let quantized_head =
            grad_now && head_pair.is_none() && self.lm_head.has_quantized_input_grad();
        let mut exps = GradBlocks::default();
        let vocab = self.lm_head.out_dim();
        // One buffer for every chunk's logits: fresh pages for each chunk's 33 MB made the
        // LM head ~1.7x slower (`kernels::matmul_into`).
        let mut logits = vec![0f32; HEAD_CHUNK.min(targets.len()) * vocab];
        let chunks = head_normed
            .chunks(HEAD_CHUNK * hidden)
            .zip(targets.chunks(HEAD_CHUNK));
        for (c, (rows, tgt)) in chunks.enumerate() {
            let logits = &mut logits[..tgt.len() * vocab];
            self.lm_head.forward_into(rows, logits)?;
            if let Some(adapter) = head_pair {
                adapter.apply_head(rows, logits);
            }
            if quantized_head {
                let stats: Vec<(f32, f32, f64)> = logits
                    .par_chunks(vocab)
                    .zip(tgt.par_iter())
                    .zip(exps.rows_mut(tgt.len(), vocab))
                    .map(|((row, &t), mut out)| {
                        let target_logit = row[t as usize];
                        let s = RowSoftmax::with_exps(row, |at, e| out.write(at, e));
                        let lp = (target_logit as f64 - s.lse) as f32;
                        (lp, s.entropy as f32, s.total)
                    })
                    .collect();
                let exps_e = self.lm_head.backward_input_non_negative(&exps)?;
                let target_rows: Vec<usize> = tgt.iter().map(|&t| t as usize).collect();
                let target_e = self.lm_head.rows(&target_rows)?;
                let per_row = exps_e
                    .chunks_exact(hidden)
                    .zip(target_e.chunks_exact(hidden));
                for ((ee, te), &(lp, h, total)) in per_row.zip(&stats) {
                    scores.logprobs.push(lp);
                    scores.entropies.push(h);
                    let inv = (1.0 / total) as f32;
                    head_grad.extend(te.iter().zip(ee).map(|(w, v)| w - v * inv));
                }
                continue;
            }
            let stats: Vec<(f32, f32, f32)> = logits
                .par_chunks_mut(vocab)
                .zip(tgt.par_iter())
                .enumerate()
                .map(|(j, (row, &t))| {
                    let target_logit = row[t as usize];
                    let s = RowSoftmax::new(row, grad_now);
                    let lp = (target_logit as f64 - s.lse) as f32;
                    let g = pointwise.map_or(1.0, |f| f(c * HEAD_CHUNK + j, lp));
                    if grad_now {
                        // The row (now minus the softmax) becomes g · (onehot(t) - softmax).
                        row[t as usize] += 1.0;
                        if pointwise.is_some() {
                            row.iter_mut().for_each(|v| *v *= g);
                        }
                    }
                    (lp, s.entropy as f32, g)
                })
                .collect();
            for (lp, h, g) in stats {
                scores.logprobs.push(lp);
                scores.entropies.push(h);
                if pointwise.is_some() {
                    dlogprobs.push(g);
                }
            }
            if grad_now {
                head_grad.extend(match (head_pair, &mut pair_grads) {
                    (Some(adapter), Some(grads)) => {
                        self.head_pair_backward(adapter, rows, logits, grads.pair_mut(0))?
                    }
                    _ => self.lm_head.backward_input(logits)?,
                });
            }
        }
        let head = match (head_pair, pair_grads) {
            (Some(_), Some(grads)) if pointwise.is_some() => {
                let [grad_a, grad_b]: [Vec<f32>; 2] = grads
                    .grads
                    .try_into()
                    .map_err(|_| ModelError::AdapterMismatch { index: 0 })?;
                HeadGrad::Done {
                    d_normed: head_grad,
                    grad_a,
                    grad_b,
                    dlogprobs,
                }
            }
            (Some(_), _) => HeadGrad::Recompute(if record { head_normed } else { Vec::new() }),
            (None, _) => HeadGrad::PerLogprob(head_grad),
        };
        let tape = record.then_some(TrainTape {
            layout,
            segments,
            layers: tapes,
            head_rows,
            targets,
            head_in,
            head,
        });
        Ok((scores, tape))
    }

    /// d loss / d adapter parameters from d loss / d logprob of each scored token.
    pub fn backward(
        &self,
        tape: TrainTape,
        adapter: &LoraAdapter,
        dlogprobs: &[f32],
    ) -> Result<LoraGrads, ModelError> {
        if dlogprobs.len() != tape.targets.len() {
            return Err(ModelError::Packing(format!(
                "{} logprob gradients for {} scored tokens",
                dlogprobs.len(),
                tape.targets.len()
            )));
        }
        if !adapter.fits(&self.cfg) || tape.layers.len() != self.cfg.num_layers {
            return Err(ModelError::AdapterMismatch { index: 0 });
        }
        let cfg = &self.cfg;
        let hidden = cfg.hidden_size;
        let n = tape.layout.pos.len();
        let mut grads = LoraGrads {
            grads: adapter
                .params()
                .iter()
                .map(|p| vec![0f32; p.len()])
                .collect(),
        };

        // LM head: d normed hidden = dlogp · (onehot(target) - softmax)·E (plus the LM-head
        // pair's term), from the forward or made now.
        if adapter.head().is_some() == matches!(tape.head, HeadGrad::PerLogprob(_)) {
            return Err(ModelError::Packing(
                "the tape and the adapter differ in their LM-head pair".into(),
            ));
        }
        let d_normed = match &tape.head {
            HeadGrad::PerLogprob(head_grad) => {
                let mut d_normed = head_grad.clone();
                for (row, &g) in d_normed.chunks_exact_mut(hidden).zip(dlogprobs) {
                    for v in row.iter_mut() {
                        *v *= g;
                    }
                }
                d_normed
            }
            HeadGrad::Done {
                d_normed,
                grad_a,
                grad_b,
                dlogprobs: made_for,
            } => {
                if made_for.as_slice() != dlogprobs {
                    return Err(ModelError::Packing(
                        "the logprob gradients differ from those the forward was given".into(),
                    ));
                }
                let (ga, gb) = grads.pair_mut(adapter.head_param_index());
                ga.copy_from_slice(grad_a);
                gb.copy_from_slice(grad_b);
                d_normed.clone()
            }
            HeadGrad::Recompute(normed) => {
                self.head_recompute_backward(normed, &tape.targets, adapter, dlogprobs, &mut grads)?
            }
        };
        let d_head_in = self
            .final_norm
            .backward(&tape.head_in, cfg.rms_eps, &d_normed);
        let mut dx = vec![0f32; n * hidden];
        for (&r, d) in tape.head_rows.iter().zip(d_head_in.chunks_exact(hidden)) {
            add_assign(&mut dx[r * hidden..(r + 1) * hidden], d);
        }

        let ropes = Ropes::new(&tape.layout.pos, cfg);
        for (li, lt) in tape.layers.iter().enumerate().rev() {
            let mut lin = LinearGrads {
                layer: &self.layers[li],
                index: li,
                adapter,
                grads: &mut grads,
            };
            let d_mid = self.layers[li]
                .mlp
                .backward(&lt.mlp, cfg.rms_eps, &mut lin, dx)?;
            let with_input = input_grad_used(li, LoraTarget::Q);
            dx =
                self.attention_backward(li, &lt.attn, &tape, &ropes, &mut lin, d_mid, with_input)?;
        }
        Ok(grads)
    }

    /// The LM head's backward with an LM-head pair, the loss's gradient unknown in the forward:
    /// each chunk's logits again from the normed hidden states `normed` (the forward's bits),
    /// `G = dlogp · (onehot(target) - softmax)`, and from it [`Decoder::head_pair_backward`].
    fn head_recompute_backward(
        &self,
        normed: &[f32],
        targets: &[u32],
        adapter: &LoraAdapter,
        dlogprobs: &[f32],
        grads: &mut LoraGrads,
    ) -> Result<Vec<f32>, ModelError> {
        let hidden = self.cfg.hidden_size;
        let vocab = self.lm_head.out_dim();
        let index = adapter.head_param_index();
        let mut d_normed = Vec::with_capacity(normed.len());
        let mut logits = vec![0f32; HEAD_CHUNK.min(targets.len()) * vocab];
        let chunks = normed
            .chunks(HEAD_CHUNK * hidden)
            .zip(targets.chunks(HEAD_CHUNK))
            .zip(dlogprobs.chunks(HEAD_CHUNK));
        for ((rows, tgt), dlogp) in chunks {
            let logits = &mut logits[..tgt.len() * vocab];
            self.lm_head.forward_into(rows, logits)?;
            adapter.apply_head(rows, logits);
            logits
                .par_chunks_mut(vocab)
                .zip(tgt.par_iter().zip(dlogp))
                .for_each(|(row, (&t, &g))| {
                    RowSoftmax::new(row, true);
                    row[t as usize] += 1.0;
                    row.iter_mut().for_each(|v| *v *= g);
                });
            let pair_grads = grads.pair_mut(index);
            d_normed.extend(self.head_pair_backward(adapter, rows, logits, pair_grads)?);
        }
        Ok(d_normed)
    }

    /// The gradient of the normed hidden states `rows` from that of their logits `dy` with an
    /// LM-head pair (through the frozen head and the pair), adding the pair's grads to
    /// `grad_a` and `grad_b`.
    fn head_pair_backward(
        &self,
        adapter: &LoraAdapter,
        rows: &[f32],
        dy: &[f32],
        (grad_a, grad_b): (&mut [f32], &mut [f32]),
    ) -> Result<Vec<f32>, ModelError> {
        let pair = adapter
            .head()
            .ok_or(ModelError::AdapterMismatch { index: 0 })?;
        let mut dx = self.lm_head.backward_input(dy)?;
        lora_backward(pair, adapter, rows, dy, Some(&mut dx), grad_a, grad_b);
        Ok(dx)
    }

    /// Backward of `attention_forward` (layer `li`) from the gradient of its output `d_out`:
    /// `x_mid = x_in + post_norm(o(attend(rope(q_norm(q)), rope(k_norm(k)), v)))`, the frozen
    /// biases passing gradients through. The gradient reaching `x_in` through q, k, v and the
    /// norm only `with_input`: the first layer's input is the embedding, which trains nothing,
    /// so there its projections' input gradients are not made at all.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        li: usize,
        lt: &AttentionTape,
        tape: &TrainTape,
        ropes: &Ropes,
        lin: &mut LinearGrads<'_>,
        d_out: Vec<f32>,
        with_input: bool,
    ) -> Result<Vec<f32>, ModelError> {
        let cfg = &self.cfg;
        let a = &self.layers[li].attn;
        let eps = cfg.rms_eps;
        let d_o = norm_if_backward(&a.post_norm, &lt.o, eps, &d_out);
        let d_attn = lin.backward(LoraTarget::O, &lt.attn, &d_o)?;
        let global = cfg.is_global(li);
        let window = (!global).then_some(cfg.sliding_window);
        let (mut dq, mut dk, dv) = self.attend_backward(lt, tape, window, &d_attn);
        if let Some(rope) = ropes.get(cfg, li) {
            rope.apply_inverse(&mut dq, cfg.num_heads);
            rope.apply_inverse(&mut dk, cfg.num_kv_heads);
        }
        let dq_pre = norm_if_backward(&a.q_norm, &lt.q_pre, eps, &dq);
        let dk_pre = norm_if_backward(&a.k_norm, &lt.k_pre, eps, &dk);
        let mut dx = d_out;
        if !with_input {
            // The adapters' grads alone: no gradient goes on through the frozen weights.
            for (target, dy) in [
                (LoraTarget::Q, &dq_pre),
                (LoraTarget::K, &dk_pre),
                (LoraTarget::V, &dv),
            ] {
                lin.adapter_only(target, &lt.normed, dy);
            }
            return Ok(dx);
        }
        let d_normed = lin.backward_summed(&[
            (LoraTarget::Q, &lt.normed, &dq_pre),
            (LoraTarget::K, &lt.normed, &dk_pre),
            (LoraTarget::V, &lt.normed, &dv),
        ])?;
        add_assign(&mut dx, &a.norm.backward(&lt.x_in, eps, &d_normed));
        Ok(dx)
    }

    /// [`attention_grads`] of layer's tape `lt` (its queries, keys and values after rope).
    fn attend_backward(
        &self,
        lt: &AttentionTape,
        tape: &TrainTape,
        window: Option<usize>,
        d_attn: &[f32],
    ) -> QkvGrads {
        let cfg = &self.cfg;
        let shape = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.attention_scale,
        );
        let qkv = (&lt.q[..], &lt.k[..], &lt.v[..]);
        attention_grads(
            shape,
            qkv,
            d_attn,
            (&tape.layout.pos, &tape.segments),
            window,
        )
    }
}

/// Whether the backward takes the input gradient through layer `li`'s frozen `target`: all
/// but the first layer's q, k and v, whose input is the embedding, which trains nothing (see
/// `Decoder::attention_backward`).
fn input_grad_used(li: usize, target: LoraTarget) -> bool {
    li > 0 || !matches!(target, LoraTarget::Q | LoraTarget::K | LoraTarget::V)
}

/// Gradients of causal (windowed, segment-isolated) attention to q, k and v. The softmax is
/// recomputed from q and k in f32 (the forward's f16 rounding of keys and values is not
/// differentiated). Per segment and key/value head, as matrix products over the rows of
/// that head's query heads (`S = Q·Kᵀ`, `dP = dO·Vᵀ`, `dQ = dS·K`, `dK = dSᵀ·Q`,
/// `dV = Pᵀ·dO`), in tiles of `QUERY_TILE_ROWS` query rows, so a long sequence's quadratic
/// part runs at gemm speed and skips what the causal mask and the window hide.
///
/// `shape` is (query heads, key/value heads, head size, score scale); `q_in` holds `heads x d`
/// values a token, `k_in` and `v_in` `kv_heads x d`; `pos` is each token's position in its segment
/// of `segments`.
fn attention_grads(
    (h, hkv, d, scale): (usize, usize, usize, f32),
    (q_in, k_in, v_in): (&[f32], &[f32], &[f32]),
    d_attn: &[f32],
    (pos, segments): (&[usize], &[std::ops::Range<usize>]),
    window: Option<usize>,
) -> QkvGrads {
    let group = h / hkv;
    let kv_width = hkv * d;
    // One key/value head of one segment: its rows' gradients, independent of every other
    // pair's, so that pairs run in parallel (many short segments are products too small to
    // split further).
    let head_grads = |seg: &std::ops::Range<usize>, g: usize| {
        let len = seg.len();
        let rows = len * group;
        // Rows (token, head) of this key/value head's query heads, token-major.
        let gather = |m: &[f32]| -> Vec<f32> {
            let mut out = Vec::with_capacity(rows * d);
            for t in seg.clone() {
                let at = (t * h + g * group) * d;
                out.extend_from_slice(&m[at..at + group * d]);
            }
            out
        };
        let kv = |m: &[f32]| -> Vec<f32> {
            let mut out = Vec::with_capacity(len * d);
            for t in seg.clone() {
                out.extend_from_slice(&m[t * kv_width + g * d..][..d]);
            }
            out
        };
        let (q_all, dout_all) = (gather(q_in), gather(d_attn));
        let (k_all, v_all) = (kv(k_in), kv(v_in));
        let mut dq_g = vec![0f32; rows * d];
        let mut dk_g = vec![0f32; len * d];
        let mut dv_g = vec![0f32; len * d];
        // Queries in tiles, each against the keys any of its rows sees (from the first
        // row's window start to the last row): the masked rest is never multiplied. Tiles
        // in parallel (one long segment is all of a step's attention), each with its own
        // part of dK and dV, added in tile order after; scratch kept per thread (fresh
        // pages for each tile's products cost more than their zeroing).
        let tile = (QUERY_TILE_ROWS / group).max(16);
        // Segment-relative: the first key a query at `i` sees.
        let lo = |i: usize| window.map_or(0, |w| (pos[seg.start + i] + 1).saturating_sub(w));
        let key_parts: Vec<(usize, Vec<f32>, Vec<f32>)> = dq_g
            .par_chunks_mut(tile * group * d)
            .enumerate()
            .map_init(Vec::new, |scratch: &mut Vec<f32>, (t, dq_tile)| {
                let (i0, i1) = (t * tile, (t * tile + tile).min(len));
                let k0 = lo(i0);
                let (tile_rows, keys) = ((i1 - i0) * group, i1 - k0);
                let (q, dout) = (
                    MatRef::new(&q_all[i0 * group * d..i1 * group * d], tile_rows, d),
                    MatRef::new(&dout_all[i0 * group * d..i1 * group * d], tile_rows, d),
                );
                let (k, v) = (
                    MatRef::new(&k_all[k0 * d..i1 * d], keys, d),
                    MatRef::new(&v_all[k0 * d..i1 * d], keys, d),
                );
                scratch.resize(3 * tile_rows * keys, 0.0);
                let (p, rest) = scratch[..3 * tile_rows * keys].split_at_mut(tile_rows * keys);
                let (dp, ds) = rest.split_at_mut(tile_rows * keys);
                ops::matmul_f32(p, q, k.t(), scale, false);
                ops::matmul_f32(dp, dout, v.t(), 1.0, false);
                // Row r is query i0 + r / group: it sees keys lo..=i (from k0 on).
                let rows = p
                    .chunks_mut(keys)
                    .zip(dp.chunks(keys))
                    .zip(ds.chunks_mut(keys));
                for (r, ((pr, dpr), dsr)) in rows.enumerate() {
                    let i = i0 + r / group;
                    let (a, b) = (lo(i) - k0, i - k0);
                    pr[..a].fill(0.0);
                    pr[b + 1..].fill(0.0);
                    ops::softmax(&mut pr[a..=b]);
                    let mean = ops::dot(&pr[a..=b], &dpr[a..=b]);
                    dsr[..a].fill(0.0);
                    dsr[b + 1..].fill(0.0);
                    for j in a..=b {
                        dsr[j] = pr[j] * (dpr[j] - mean);
                    }
                }
                let (p, ds) = (
                    MatRef::new(p, tile_rows, keys),
                    MatRef::new(ds, tile_rows, keys),
                );
                ops::matmul_f32(dq_tile, ds, k, scale, false);
                let mut dk_part = vec![0f32; keys * d];
                ops::matmul_f32(&mut dk_part, ds.t(), q, scale, false);
                let mut dv_part = vec![0f32; keys * d];
                ops::matmul_f32(&mut dv_part, p.t(), dout, 1.0, false);
                (k0, dk_part, dv_part)
            })
            .collect();
        for (k0, dk_part, dv_part) in key_parts {
            add_assign(&mut dk_g[k0 * d..k0 * d + dk_part.len()], &dk_part);
            add_assign(&mut dv_g[k0 * d..k0 * d + dv_part.len()], &dv_part);
        }
        (dq_g, dk_g, dv_g)
    };
    let pairs: Vec<(&std::ops::Range<usize>, usize)> = segments
        .iter()
        .flat_map(|seg| (0..hkv).map(move |g| (seg, g)))
        .collect();
    let grads: Vec<QkvGrads> = pairs
        .par_iter()
        .map(|&(seg, g)| head_grads(seg, g))
        .collect();
    // Each token's rows gathered from its segment's heads, tokens in parallel: the segments
    // cover the tokens in order (`run_packed`), so every row is written once.
    let token_at: Vec<(usize, usize)> = segments
        .iter()
        .enumerate()
        .flat_map(|(s, seg)| (0..seg.len()).map(move |i| (s, i)))
        .collect();
    assert_eq!(token_at.len(), pos.len(), "segments cover the tokens");
    let gathered = |width: usize, part: fn(&QkvGrads) -> &[f32]| {
        let head = width / hkv;
        // SAFETY: a chunk is one token's row of `width` values, `hkv` heads of `head` values
        // each, every head's values written.
        unsafe {
            ops::written_in_parallel(pos.len() * width, width, ops::ROWS_PER_TASK, |t, row| {
                let (s, i) = token_at[t];
                for (g, out) in row.chunks_exact_mut(head).enumerate() {
                    out.write_copy_of_slice(&part(&grads[s * hkv + g])[i * head..][..head]);
                }
            })
        }
    };
    (
        gathered(h * d, |g| &g.0),
        gathered(kv_width, |g| &g.1),
        gathered(kv_width, |g| &g.2),
    )
}

/// Query rows (token and head) per tile of the attention backward's matrix products: a tile
/// holds `QUERY_TILE_ROWS / group` tokens of a key/value head's `group` query heads. A tile
/// multiplies its diagonal block whole, so about half a tile's tokens of every row's keys are
/// masked work; 256 rows rather than 256 tokens took the backward of a 1,024-token sequence ~8%
/// faster on the default model (group 4) and held it at Qwen3-0.6B's shape (group 2), where
/// fewer rows made the products too thin.
const QUERY_TILE_ROWS: usize = 256;

impl Mlp {
    /// Backward of `Mlp::forward` from the gradient of its output `d_out`:
    /// `out = x_in + post_norm(down(act(gate) * up))` over `norm(x_in)`.
    fn backward(
        &self,
        lt: &MlpTape,
        eps: f32,
        lin: &mut LinearGrads<'_>,
        d_out: Vec<f32>,
    ) -> Result<Vec<f32>, ModelError> {
        let d_down = norm_if_backward(&self.post_norm, &lt.down, eps, &d_out);
        let d_act = lin.backward(LoraTarget::Down, &lt.act, &d_down)?;
        let (d_gate, d_up) = ops::act_mul_backward(self.activation, &lt.gate, &lt.up, &d_act);
        let d_normed = lin.backward_summed(&[
            (LoraTarget::Gate, &lt.normed, &d_gate),
            (LoraTarget::Up, &lt.normed, &d_up),
        ])?;
        let mut dx = d_out;
        add_assign(&mut dx, &self.norm.backward(&lt.x_in, eps, &d_normed));
        Ok(dx)
    }
}

/// One layer's projections in the backward: where their adapters' gradients go.
struct LinearGrads<'a> {
    layer: &'a Layer,
    index: usize,
    adapter: &'a LoraAdapter,
    grads: &'a mut LoraGrads,
}

impl LinearGrads<'_> {
    /// Backward of projection `target` at input rows `x` with output gradient `dy`: adds the
    /// adapter's grads and returns d x (through the frozen weight and the adapter).
    fn backward(
        &mut self,
        target: LoraTarget,
        x: &[f32],
        dy: &[f32],
    ) -> Result<Vec<f32>, ModelError> {
        self.backward_summed(&[(target, x, dy)])
    }

    /// [`LinearGrads::backward`] of projections of one input (`(target, x, dy)` each), side by
    /// side: while one product's last tasks finish, the other threads take the next one's
    /// instead of waiting at its end. Returns their `dx` summed in the order given.
    fn backward_summed(
        &mut self,
        parts: &[(LoraTarget, &[f32], &[f32])],
    ) -> Result<Vec<f32>, ModelError> {
        let (layer, li, adapter) = (self.layer, self.index, self.adapter);
        let bases: Vec<usize> = parts.iter().map(|&(t, ..)| self.grads_at(t)).collect();
        // Each part's pair of grads, borrowed apart from the others'.
        let mut pairs: Vec<Option<(&mut Vec<f32>, &mut Vec<f32>)>> =
            parts.iter().map(|_| None).collect();
        let mut grads = self.grads.grads.iter_mut().enumerate();
        while let Some((i, a)) = grads.next() {
            if let Some(p) = bases.iter().position(|&b| b == i) {
                let (_, b) = grads.next().expect("B's grads follow A's");
                pairs[p] = Some((a, b));
            }
        }
        let dxs: Vec<Vec<f32>> = parts
            .par_iter()
            .zip(pairs)
            .map(|(&(target, x, dy), pair)| {
                let (ga, gb) = pair.expect("every part's grads");
                let mut dx = layer.linear(target).backward_input(dy)?;
                lora_backward(
                    adapter.pair(li, target),
                    adapter,
                    x,
                    dy,
                    Some(&mut dx),
                    ga,
                    gb,
                );
                Ok(dx)
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(ops::sum_in_order(dxs))
    }

    /// The adapter's grads of projection `target` alone, where no gradient goes on to `x`.
    fn adapter_only(&mut self, target: LoraTarget, x: &[f32], dy: &[f32]) {
        let (li, adapter) = (self.index, self.adapter);
        let (ga, gb) = self.grads.pair_mut(self.grads_at(target));
        lora_backward(adapter.pair(li, target), adapter, x, dy, None, ga, gb);
    }

    /// Where the grads of projection `target`'s pair start (A's, then B's).
    fn grads_at(&self, target: LoraTarget) -> usize {
        (self.index * LoraTarget::ALL.len() + target as usize) * 2
    }
}

/// A LoRA pair's part of its projection's backward at input rows `x` with output gradient
/// `dy`: adds its term to `dx` (where one is wanted) and its grads to `grad_a`, `grad_b`. With
/// `t = x·Aᵀ`, `y += s·t·Bᵀ`: `dB = s·dyᵀ·t`, `dt = s·dy·B`, `dA = dtᵀ·x`, `dx += dt·A`.
fn lora_backward(
    pair: &LoraPair,
    adapter: &LoraAdapter,
    x: &[f32],
    dy: &[f32],
    dx: Option<&mut [f32]>,
    grad_a: &mut [f32],
    grad_b: &mut [f32],
) {
    let rank = adapter.config().rank;
    let s = adapter.scale();
    let (din, dout) = (pair.in_dim, pair.out_dim);
    let rows = x.len() / din;
    let (x, dy) = (MatRef::new(x, rows, din), MatRef::new(dy, rows, dout));
    let (a, b) = (
        MatRef::new(&pair.a, rank, din),
        MatRef::new(&pair.b, dout, rank),
    );
    let mut t = vec![0f32; rows * rank];
    ops::matmul_f32(&mut t, x, a.t(), 1.0, false);
    let mut dt = vec![0f32; rows * rank];
    ops::matmul_f32(&mut dt, dy, b, s, false);
    let (t, dt) = (MatRef::new(&t, rows, rank), MatRef::new(&dt, rows, rank));
    if let Some(dx) = dx {
        ops::matmul_f32(dx, dt, a, 1.0, true);
    }
    ops::matmul_f32(grad_a, dt.t(), x, 1.0, true);
    ops::matmul_f32(grad_b, dy.t(), t, s, true);
}

/// Gradients of the attention's queries, keys and values (row-major, one row per token).
type QkvGrads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Log-sum-exp and entropy of one row of logits. The log-sum-exp is the server's
/// (`softmax::log_sum_exp`), so a trained logprob is the served one's bits.
struct RowSoftmax {
    lse: f64,
    entropy: f64,
    /// `Σ e^(z - max)`.
    total: f64,
}

impl RowSoftmax {
    /// With `keep_probs` the row is overwritten by minus its softmax (in f32), for the gradient.
    fn new(row: &mut [f32], keep_probs: bool) -> Self {
        use crate::softmax::{exp_in_place, max_logit};
        if !keep_probs {
            return Self::with_exps(row, |_, _| {});
        }
        let max = max_logit(row);
        let s = Self::from_sums(max, exp_in_place(row, max));
        let inv = (-1.0 / s.total) as f32;
        for z in row.iter_mut() {
            *z *= inv;
        }
        s
    }

    /// One pass of exponentials, each chunk of them handed to `then` (see
    /// `softmax::exp_then`; the row stays as it is).
    fn with_exps(row: &[f32], then: impl FnMut(usize, &[f32])) -> Self {
        use crate::softmax::{exp_then, max_logit};
        let max = max_logit(row);
        Self::from_sums(max, exp_then(row, max, then))
    }

    /// From the row's largest logit and its exponentials' sums, `Σ e` (the server's, bit for
    /// bit, behind `lse`) and `Σ e·(z - max)`: `H = (lse - max) - Σ e·(z - max) / Σ e`.
    fn from_sums(max: f32, (total, weighted): (f64, f64)) -> Self {
        let lse = max as f64 + total.ln();
        let entropy = if total > 0.0 {
            (lse - max as f64) - weighted / total
        } else {
            0.0
        };
        RowSoftmax {
            lse,
            entropy,
            total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Time of one layer's attention gradients ([`attention_grads`]) at Qwen3-0.6B's heads and
    /// the default model's (one sequence of N tokens, random values; the best of several
    /// trials): `cargo test --release -p temper-model --lib -- --ignored --nocapture
    /// attention_grads_throughput` (`ATTN_BENCH=Qwen3` picks the shapes whose line has that text).
    #[test]
    #[ignore]
    fn attention_grads_throughput() {
        let mut rng = crate::kernels::test_util::Rng::new(11);
        let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.uniform() - 0.5).collect() };
        for (name, h, hkv, d, window) in [
            ("Qwen3-0.6B", 16, 8, 128, None),
            ("Gemma 3 270M", 4, 1, 256, None),
            ("Gemma 3 270M local", 4, 1, 256, Some(512)),
        ] {
            for n in [1024, 2048] {
                let label = format!("{name} N={n}");
                if !label.contains(&std::env::var("ATTN_BENCH").unwrap_or_default()) {
                    continue;
                }
                let (q, k, v, dout) = (
                    random(n * h * d),
                    random(n * hkv * d),
                    random(n * hkv * d),
                    random(n * h * d),
                );
                let pos: Vec<usize> = (0..n).collect();
                let segment = 0..n;
                let shape = (h, hkv, d, 1.0 / (d as f32).sqrt());
                let (mut best, mut best_cpu) = (f64::INFINITY, f64::INFINITY);
                for _ in 0..5 {
                    let (t, cpu) = (
                        std::time::Instant::now(),
                        crate::kernels::test_util::cpu_seconds(),
                    );
                    std::hint::black_box(attention_grads(
                        shape,
                        (&q, &k, &v),
                        &dout,
                        (&pos, std::slice::from_ref(&segment)),
                        window,
                    ));
                    best = best.min(t.elapsed().as_secs_f64());
                    best_cpu = best_cpu.min(crate::kernels::test_util::cpu_seconds() - cpu);
                }
                println!(
                    "{label} ({h} heads, {hkv} kv, d {d}): {:.1} ms (CPU time of all threads \
                     {:.1} ms)",
                    best * 1e3,
                    best_cpu * 1e3
                );
            }
        }
    }
}
