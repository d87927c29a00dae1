//! Top-k routing (DESIGN 2), in f32.
//!
//! `scores = softmax(logits)` or `sigmoid(logits)`; selection ranks `scores + bias` (when the
//! layer has an `e_score_correction_bias`); with `n_group > 1` experts are split into contiguous
//! groups ranked by the sum of their two best biased scores (their max without a bias) and only
//! the `topk_group` best groups compete. Weights are the **unbiased** scores of the chosen ids,
//! divided by their sum when `renormalize` (a zero sum counts as 1), then multiplied by
//! `routed_scaling_factor`. Ties go to the lower expert (or group) id. Ids come out in rank order.

use crate::spec::{RoutingConfig, Scoring};

/// Routing decision for a batch: `ids[t·k + j]` is the j-th expert of token t.
#[derive(Clone, Debug, PartialEq)]
pub struct TopK {
    pub tokens: usize,
    pub k: usize,
    pub ids: Vec<i32>,
    /// Router weights with `routed_scaling_factor` applied.
    pub weights: Vec<f32>,
}

/// `logits = x · Wgate^T` in f32 (`x`: `[T, H]`, `router`: `[E, H]`), tokens in parallel, each
/// logit a sequential sum (the same bits whatever the thread count).
pub fn router_logits(x: &[f32], router: &[f32], hidden: usize, experts: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let tokens = x.len() / hidden.max(1);
    let mut out = vec![0.0f32; tokens * experts];
    if hidden == 0 || experts == 0 {
        return out;
    }
    x.par_chunks_exact(hidden)
        .zip(out.par_chunks_exact_mut(experts))
        .for_each(|(xt, lt)| {
            for (l, w) in lt.iter_mut().zip(router.chunks_exact(hidden)) {
                *l = xt.iter().zip(w).map(|(a, b)| a * b).sum();
            }
        });
    out
}

/// Indices of the `k` largest values, best first; ties go to the lower index.
fn top_indices(values: &[f32], k: usize, out: &mut Vec<usize>) {
    out.clear();
    out.extend(0..values.len());
    // total_cmp ranks NaN above everything; scores are finite for finite logits.
    out.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    out.truncate(k);
}

/// Routes every token of `logits` (`[T, E]`).
pub fn route(logits: &[f32], experts: usize, cfg: &RoutingConfig, bias: Option<&[f32]>) -> TopK {
    let tokens = logits.len() / experts.max(1);
    let k = cfg.top_k;
    let mut ids = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    let mut scores = vec![0.0f32; experts];
    let mut biased = vec![0.0f32; experts];
    let mut order = Vec::with_capacity(experts);
    let mut group_order = Vec::with_capacity(cfg.n_group);
    let mut group_scores = vec![0.0f32; cfg.n_group];
    for l in logits.chunks_exact(experts) {
        match cfg.scoring {
            Scoring::Softmax => {
                let m = l.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let mut sum = 0.0f32;
                for (s, &v) in scores.iter_mut().zip(l) {
                    *s = (v - m).exp();
                    sum += *s;
                }
                for s in scores.iter_mut() {
                    *s /= sum;
                }
            }
            Scoring::Sigmoid => {
                for (s, &v) in scores.iter_mut().zip(l) {
                    *s = 1.0 / (1.0 + (-v).exp());
                }
            }
        }
        for (i, b) in biased.iter_mut().enumerate() {
            *b = scores[i] + bias.map_or(0.0, |b| b[i]);
        }
        if cfg.n_group > 1 {
            let per = experts / cfg.n_group;
            for (g, gs) in group_scores.iter_mut().enumerate() {
                let grp = &biased[g * per..(g + 1) * per];
                *gs = if bias.is_some() {
                    top_indices(grp, 2, &mut order);
                    order.iter().map(|&i| grp[i]).sum()
                } else {
                    grp.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
                };
            }
            top_indices(&group_scores, cfg.topk_group, &mut group_order);
            for (g, _) in group_scores.iter().enumerate() {
                if !group_order.contains(&g) {
                    biased[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
                }
            }
        }
        top_indices(&biased, k, &mut order);
        let sum: f32 = order.iter().map(|&e| scores[e]).sum();
        let sum = if cfg.renormalize && sum != 0.0 {
            sum
        } else {
            1.0
        };
        for &e in &order {
            ids.push(e as i32);
            weights.push(scores[e] / sum * cfg.routed_scaling_factor);
        }
    }
    TopK {
        tokens,
        k,
        ids,
        weights,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_top2_renormalized() {
        let cfg = RoutingConfig::softmax(2);
        let r = route(&[0.0, 2.0, 1.0, 2.0], 4, &cfg, None);
        // Tie between experts 1 and 3: lower id first.
        assert_eq!(r.ids, vec![1, 3]);
        assert!((r.weights[0] - 0.5).abs() < 1e-7 && (r.weights[1] - 0.5).abs() < 1e-7);
    }

    #[test]
    fn bias_selects_but_does_not_weight() {
        let cfg = RoutingConfig {
            scoring: Scoring::Sigmoid,
            top_k: 1,
            n_group: 1,
            topk_group: 1,
            renormalize: false,
            routed_scaling_factor: 2.0,
        };
        let bias = [0.0, 1.0];
        let r = route(&[1.0, 0.0], 2, &cfg, Some(&bias));
        assert_eq!(r.ids, vec![1]);
        assert!((r.weights[0] - 2.0 * 0.5).abs() < 1e-7);
    }

    #[test]
    fn groups_restrict_selection() {
        // 2 groups of 2; group 0 = {0.9, 0.0}, group 1 = {0.5, 0.5}. With top-2-sum scoring
        // (bias present, zero) group 1 wins (1.0 > 0.9), so expert 0 is excluded.
        let cfg = RoutingConfig {
            scoring: Scoring::Sigmoid,
            top_k: 1,
            n_group: 2,
            topk_group: 1,
            renormalize: true,
            routed_scaling_factor: 1.0,
        };
        let logit = |p: f32| (p / (1.0 - p)).ln();
        let l = [logit(0.9), -40.0, logit(0.5), logit(0.5)];
        let r = route(&l, 4, &cfg, Some(&[0.0; 4]));
        assert_eq!(r.ids, vec![2]);
        // Without a bias groups rank by their max: group 0 wins.
        let r = route(&l, 4, &cfg, None);
        assert_eq!(r.ids, vec![0]);
    }

    #[test]
    fn zero_sum_renormalization_counts_as_one() {
        let cfg = RoutingConfig {
            scoring: Scoring::Sigmoid,
            top_k: 2,
            n_group: 1,
            topk_group: 1,
            renormalize: true,
            routed_scaling_factor: 1.0,
        };
        let r = route(&[-200.0, -200.0, -200.0], 3, &cfg, None);
        assert_eq!(r.ids, vec![0, 1]);
        assert_eq!(r.weights, vec![0.0, 0.0]);
    }
}
