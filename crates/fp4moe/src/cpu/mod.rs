//! The fast CPU backend.
//!
//! Pipeline per call (all f32 accumulation, intermediates rounded like the GPU kernels store them):
//! 1. `a = bf16(x)` (W4A16) or `QDQ(x, gs1)` (W4A4), once per token;
//! 2. token/slot pairs sorted by expert (counting sort, deterministic);
//! 3. GEMM1 per (expert, block of w13 rows): rows dequantized on the fly into a per-thread
//!    buffer, multiplied against the expert's tokens → `h` stored `[row][token]` per expert;
//! 4. `g = act(h)` (gated: `act(gate) · up`), then `bf16(g)` (W4A16) or `QDQ(g, gs2)` (W4A4);
//! 5. GEMM2 the same way → `o`;
//! 6. combine per token in slot order: `y_t = Σ_j w_j · o_j` (+ the shared expert on `bf16(x)`).
//!
//! No float atomics, fixed summation orders: results are bitwise reproducible for any thread count.

mod gemm;

use crate::backend::{Experts, Workspace};
use crate::error::Result;
use crate::format::{activation, nvfp4};
use crate::routing::TopK;
use crate::spec::{Activation, MoeSpec};
use crate::weights::{DenseWeight, ExpertStack, MoeWeights};
use gemm::rows_times_activations;
use half::bf16;
use rayon::prelude::*;
use std::sync::Arc;

/// Tuning knobs of the CPU backend.
#[derive(Clone, Copy, Debug)]
pub struct CpuParams {
    /// Weight rows per parallel task.
    pub rows_per_task: usize,
}

impl Default for CpuParams {
    fn default() -> Self {
        Self { rows_per_task: 32 }
    }
}

pub(crate) struct CpuExperts {
    spec: MoeSpec,
    w: Arc<MoeWeights>,
    gs1: Option<f32>,
    gs2: Option<f32>,
    params: CpuParams,
}

impl CpuExperts {
    pub(crate) fn new(spec: &MoeSpec, w: Arc<MoeWeights>) -> Result<Self> {
        let (gs1, gs2) = w.global_scales(spec.quant);
        Ok(Self {
            spec: *spec,
            w,
            gs1,
            gs2,
            params: CpuParams::default(),
        })
    }

    /// f32 elements of workspace for `tokens` tokens.
    fn workspace_f32s(&self, tokens: usize) -> usize {
        let s = &self.spec.shape;
        let pairs = tokens * self.spec.routing.top_k;
        let rows13 = self.spec.w13_rows();
        let shared = self.spec.shared_intermediate.map_or(0, |w| {
            let s13 = self.spec.activation.w13_shards() * w;
            tokens * (s.hidden + s13 + w + s.hidden)
        });
        tokens * s.hidden + pairs * (rows13 + s.intermediate + s.hidden) + shared
    }

    fn workspace_idx(&self, tokens: usize) -> usize {
        2 * self.spec.shape.experts + 1 + 2 * tokens * self.spec.routing.top_k
    }
}

#[inline]
fn round_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// Dequantizes row `r` of expert `e` of an NVFP4 stack.
#[inline]
fn stack_row(stack: &ExpertStack, e: usize) -> impl Fn(usize, &mut [f32]) + '_ {
    move |r, buf| {
        let (p, s, s2) = stack.row(e, r);
        nvfp4::dequantize_row(p, s, s2, buf);
    }
}

/// `g[j] = act(h)` for token `j` of a `[rows][n]` block; `out` has `inter` values.
#[inline]
fn activate_column(act: Activation, h: &[f32], n: usize, j: usize, inter: usize, out: &mut [f32]) {
    if act.is_gated() {
        for (i, o) in out.iter_mut().enumerate() {
            *o = act.apply_f32(h[i * n + j], h[(inter + i) * n + j]);
        }
    } else {
        for (i, o) in out.iter_mut().enumerate() {
            *o = act.apply_f32(h[i * n + j], 0.0);
        }
    }
}

/// Rounds `g` like the kernels store it: bf16 in W4A16, NVFP4 QDQ in W4A4.
#[inline]
fn store_intermediate(g: &mut [f32], gs2: Option<f32>) {
    match gs2 {
        Some(gs) => activation::qdq_row_in_place(g, gs),
        None => g.iter_mut().for_each(|v| *v = round_bf16(*v)),
    }
}

/// Runs `W · A^T` for every row block of `out` (`[rows][n]`) in parallel.
fn parallel_rows<'a, L, A>(
    load: L,
    act: A,
    n: usize,
    k: usize,
    rows_per_task: usize,
    out: &mut [f32],
) where
    L: Fn(usize, &mut [f32]) + Sync,
    A: Fn(usize) -> &'a [f32] + Sync,
{
    if n == 0 {
        return;
    }
    out.par_chunks_mut(rows_per_task * n)
        .enumerate()
        .for_each_init(
            || vec![0.0f32; 4 * k],
            |buf, (blk, chunk)| {
                rows_times_activations(&load, &act, blk * rows_per_task, n, k, chunk, buf)
            },
        );
}

/// Splits `buf` into consecutive slices of the given lengths.
fn split_many<'a, T>(mut buf: &'a mut [T], lens: &[usize]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(lens.len());
    for &l in lens {
        let (a, b) = buf.split_at_mut(l);
        out.push(a);
        buf = b;
    }
    out
}

fn dense_row(w: &DenseWeight) -> impl Fn(usize, &mut [f32]) + '_ {
    move |r, buf| w.row_f32(r, buf)
}

impl Experts for CpuExperts {
    fn workspace_bytes(&self, tokens: usize) -> usize {
        4 * (self.workspace_f32s(tokens) + self.workspace_idx(tokens))
    }

    fn forward(&self, x: &[f32], topk: &TopK, out: &mut [f32], ws: &mut Workspace) -> Result<()> {
        let (hidden, inter, experts) = (
            self.spec.shape.hidden,
            self.spec.shape.intermediate,
            self.spec.shape.experts,
        );
        let act = self.spec.activation;
        let k = topk.k;
        let tokens = topk.tokens;
        let pairs = tokens * k;
        let rows13 = self.spec.w13_rows();
        let rpt = self.params.rows_per_task.max(1);
        let w = &*self.w;

        ws.f32s.resize(self.workspace_f32s(tokens), 0.0);
        ws.idx.resize(self.workspace_idx(tokens), 0);

        // Sort pairs by expert: offsets, pairs in sorted order, sorted position of each pair.
        let (offsets, rest) = ws.idx.split_at_mut(experts + 1);
        let (cursor, rest) = rest.split_at_mut(experts);
        let (sorted, pos) = rest.split_at_mut(pairs);
        offsets.fill(0);
        for &e in &topk.ids {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..experts {
            offsets[e + 1] += offsets[e];
        }
        cursor.copy_from_slice(&offsets[..experts]);
        for (p, &e) in topk.ids.iter().enumerate() {
            let c = &mut cursor[e as usize];
            sorted[*c as usize] = p as u32;
            pos[p] = *c;
            *c += 1;
        }
        let (offsets, sorted, pos) = (&*offsets, &*sorted, &*pos);
        let count = |e: usize| (offsets[e + 1] - offsets[e]) as usize;

        let shared_w = self.spec.shared_intermediate.unwrap_or(0);
        let shared13 = act.w13_shards() * shared_w;
        let has_shared = w.shared.is_some();
        let lens = [
            tokens * hidden,
            pairs * rows13,
            pairs * inter,
            pairs * hidden,
            if has_shared { tokens * hidden } else { 0 },
            tokens * shared13,
            tokens * shared_w,
            tokens * shared_hidden(has_shared, hidden),
        ];
        let mut parts = split_many(&mut ws.f32s, &lens).into_iter();
        let mut next = || parts.next().unwrap_or_default();
        let (a, h, g, o, xs, hs, gsh, os) = (
            next(),
            next(),
            next(),
            next(),
            next(),
            next(),
            next(),
            next(),
        );

        // 1. Activations.
        a.par_chunks_mut(hidden)
            .zip(x.par_chunks(hidden))
            .for_each(|(at, xt)| match self.gs1 {
                Some(gs) => activation::qdq_row(xt, gs, at),
                None => at.iter_mut().zip(xt).for_each(|(o, v)| *o = round_bf16(*v)),
            });
        let a = &*a;

        // 3. GEMM1 per expert.
        let mut h_parts: Vec<(usize, &mut [f32])> = split_many(
            h,
            &(0..experts).map(|e| count(e) * rows13).collect::<Vec<_>>(),
        )
        .into_iter()
        .enumerate()
        .filter(|(e, _)| count(*e) > 0)
        .collect();
        h_parts.par_iter_mut().for_each(|(e, he)| {
            let e = *e;
            let n = count(e);
            let base = offsets[e] as usize;
            let tok = |j: usize| {
                let t = sorted[base + j] as usize / k;
                &a[t * hidden..(t + 1) * hidden]
            };
            parallel_rows(stack_row(&w.w13, e), tok, n, hidden, rpt, he);
        });
        let h = &*h;

        // 4. Activation, rounded like the stored intermediate.
        g.par_chunks_mut(inter).enumerate().for_each(|(p, gp)| {
            let e = offsets.partition_point(|&o| o as usize <= p) - 1;
            let n = count(e);
            let base = offsets[e] as usize;
            let he = &h[base * rows13..(base + n) * rows13];
            activate_column(act, he, n, p - base, inter, gp);
            store_intermediate(gp, self.gs2);
        });
        let g = &*g;

        // 5. GEMM2 per expert.
        let mut o_parts: Vec<(usize, &mut [f32])> = split_many(
            o,
            &(0..experts).map(|e| count(e) * hidden).collect::<Vec<_>>(),
        )
        .into_iter()
        .enumerate()
        .filter(|(e, _)| count(*e) > 0)
        .collect();
        o_parts.par_iter_mut().for_each(|(e, oe)| {
            let e = *e;
            let n = count(e);
            let base = offsets[e] as usize;
            let gj = |j: usize| &g[(base + j) * inter..(base + j + 1) * inter];
            parallel_rows(stack_row(&w.w2, e), gj, n, inter, rpt, oe);
        });
        let o = &*o;

        // Shared expert on bf16(x).
        if let Some(sh) = &w.shared {
            xs.par_chunks_mut(hidden)
                .zip(x.par_chunks(hidden))
                .for_each(|(o, v)| o.iter_mut().zip(v).for_each(|(o, v)| *o = round_bf16(*v)));
            let xs = &*xs;
            let xt = |t: usize| &xs[t * hidden..(t + 1) * hidden];
            parallel_rows(dense_row(&sh.w13), xt, tokens, hidden, rpt, hs);
            let hs = &*hs;
            gsh.par_chunks_mut(shared_w)
                .enumerate()
                .for_each(|(t, gt)| {
                    activate_column(act, hs, tokens, t, shared_w, gt);
                    gt.iter_mut().for_each(|v| *v = round_bf16(*v));
                });
            let gsh = &*gsh;
            let gt = |t: usize| &gsh[t * shared_w..(t + 1) * shared_w];
            parallel_rows(dense_row(&sh.w2), gt, tokens, shared_w, rpt, os);
        }
        let os = &*os;

        // 6. Combine in slot order.
        out.par_chunks_mut(hidden).enumerate().for_each(|(t, yt)| {
            yt.fill(0.0);
            for j in 0..k {
                let p = t * k + j;
                let e = topk.ids[p] as usize;
                let n = count(e);
                let local = pos[p] as usize - offsets[e] as usize;
                let oe = &o[offsets[e] as usize * hidden..];
                let wt = topk.weights[p];
                for (hh, y) in yt.iter_mut().enumerate() {
                    *y += wt * oe[hh * n + local];
                }
            }
            if has_shared {
                for (hh, y) in yt.iter_mut().enumerate() {
                    *y += os[hh * tokens + t];
                }
            }
        });
        Ok(())
    }
}

fn shared_hidden(has_shared: bool, hidden: usize) -> usize {
    if has_shared {
        hidden
    } else {
        0
    }
}
