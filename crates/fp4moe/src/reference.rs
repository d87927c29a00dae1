//! The reference backend: DESIGN 2 verbatim with float64 accumulation.
//!
//! Per token t and selected expert e with routed weight w (rsf included):
//! `a = x_t` (W4A4: `QDQ(x_t, gs1)` in f32), `h = a · deq(w13_e)^T`, `g = act(h)` (gated:
//! `act(h[..I]) · h[I..]`), W4A4: `g = QDQ(f32(g), gs2)`, `o = g · deq(w2_e)^T`,
//! `y_t = Σ w · o + shared(x_t)`. Dequantized weights are exact in f64 (`e2m1 · S · scale_2`).
//! Tokens run in parallel; each token's sum is computed in one fixed order.

use crate::backend::{Experts, Workspace};
use crate::error::Result;
use crate::format::{activation, e2m1, e4m3, BLOCK};
use crate::routing::TopK;
use crate::spec::{Activation, MoeSpec};
use crate::weights::{DenseWeight, MoeWeights};
use rayon::prelude::*;
use std::sync::Arc;

pub(crate) struct ReferenceExperts {
    spec: MoeSpec,
    w: Arc<MoeWeights>,
    gs1: Option<f32>,
    gs2: Option<f32>,
}

impl ReferenceExperts {
    pub(crate) fn new(spec: &MoeSpec, w: Arc<MoeWeights>) -> Result<Self> {
        let (gs1, gs2) = w.global_scales(spec.quant);
        Ok(Self {
            spec: *spec,
            w,
            gs1,
            gs2,
        })
    }
}

/// `e2m1 · S · scale_2` of one packed row, exactly, in f64.
fn dequantize_row_f64(packed: &[u8], scales: &[u8], scale_2: f32, out: &mut [f64]) {
    for ((p, &s), o) in packed
        .chunks_exact(BLOCK / 2)
        .zip(scales)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        let f = e4m3::decode(s) as f64 * scale_2 as f64;
        for (b, pair) in p.iter().zip(o.chunks_exact_mut(2)) {
            pair[0] = e2m1::decode(b & 0xF) as f64 * f;
            pair[1] = e2m1::decode(b >> 4) as f64 * f;
        }
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `g` from `h` (`[S·I]`, gate rows first when gated).
fn activate(act: Activation, h: &[f64], inter: usize) -> Vec<f64> {
    if act.is_gated() {
        (0..inter)
            .map(|i| act.apply_f64(h[i], h[inter + i]))
            .collect()
    } else {
        h.iter().map(|&v| act.apply_f64(v, 0.0)).collect()
    }
}

fn dense_row_f64(w: &DenseWeight, r: usize, f32buf: &mut [f32], out: &mut [f64]) {
    w.row_f32(r, f32buf);
    for (o, v) in out.iter_mut().zip(f32buf.iter()) {
        *o = *v as f64;
    }
}

/// `g = act(a · deq(w13_e)^T)` in f64, before any intermediate quantization.
pub(crate) fn expert_intermediate(
    w: &MoeWeights,
    act: Activation,
    e: usize,
    a: &[f64],
) -> Vec<f64> {
    let w13 = &w.w13;
    let mut row = vec![0.0f64; w13.cols];
    let h: Vec<f64> = (0..w13.rows)
        .map(|r| {
            let (p, s, s2) = w13.row(e, r);
            dequantize_row_f64(p, s, s2, &mut row);
            dot(a, &row)
        })
        .collect();
    activate(act, &h, w13.rows / act.w13_shards())
}

impl ReferenceExperts {
    fn token(&self, x: &[f32], ids: &[i32], weights: &[f32], out: &mut [f32]) {
        let hidden = self.spec.shape.hidden;
        let inter = self.spec.shape.intermediate;
        let act = self.spec.activation;
        let w2 = &self.w.w2;
        let a: Vec<f64> = match self.gs1 {
            Some(gs) => {
                let mut q = vec![0.0f32; hidden];
                activation::qdq_row(x, gs, &mut q);
                q.iter().map(|&v| v as f64).collect()
            }
            None => x.iter().map(|&v| v as f64).collect(),
        };
        let mut row = vec![0.0f64; hidden.max(inter)];
        let mut y = vec![0.0f64; hidden];
        for (&e, &wt) in ids.iter().zip(weights) {
            let e = e as usize;
            let mut g = expert_intermediate(&self.w, act, e, &a);
            if let Some(gs) = self.gs2 {
                let g32: Vec<f32> = g.iter().map(|&v| v as f32).collect();
                let mut q = vec![0.0f32; inter];
                activation::qdq_row(&g32, gs, &mut q);
                g = q.iter().map(|&v| v as f64).collect();
            }
            for (r, yr) in y.iter_mut().enumerate() {
                let (p, s, s2) = w2.row(e, r);
                dequantize_row_f64(p, s, s2, &mut row[..inter]);
                *yr += wt as f64 * dot(&g, &row[..inter]);
            }
        }
        if let Some(sh) = &self.w.shared {
            let xs: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let width = sh.w2.cols();
            let mut buf = vec![0.0f32; hidden.max(width)];
            let mut row = vec![0.0f64; hidden.max(width)];
            let hs: Vec<f64> = (0..sh.w13.rows())
                .map(|r| {
                    dense_row_f64(&sh.w13, r, &mut buf[..hidden], &mut row[..hidden]);
                    dot(&xs, &row[..hidden])
                })
                .collect();
            let g = activate(act, &hs, width);
            for (r, yr) in y.iter_mut().enumerate() {
                dense_row_f64(&sh.w2, r, &mut buf[..width], &mut row[..width]);
                *yr += dot(&g, &row[..width]);
            }
        }
        for (o, v) in out.iter_mut().zip(&y) {
            *o = *v as f32;
        }
    }
}

impl Experts for ReferenceExperts {
    fn workspace_bytes(&self, _tokens: usize) -> usize {
        0
    }

    fn forward(&self, x: &[f32], topk: &TopK, out: &mut [f32], _ws: &mut Workspace) -> Result<()> {
        let hidden = self.spec.shape.hidden;
        let k = topk.k;
        out.par_chunks_mut(hidden)
            .zip(x.par_chunks(hidden))
            .enumerate()
            .for_each(|(t, (o, xt))| {
                self.token(
                    xt,
                    &topk.ids[t * k..(t + 1) * k],
                    &topk.weights[t * k..(t + 1) * k],
                    o,
                )
            });
        Ok(())
    }
}
