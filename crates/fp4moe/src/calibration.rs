//! Calibration of W4A4 input scales, ModelOpt-style: run the layer unquantized (f64, like the
//! reference backend) and record per expert the absolute max of the tokens routed to it (w13
//! input) and of its intermediate activation `g` (w2 input). `input_scale = amax / 2688`.

use crate::error::{Error, Result};
use crate::format::nvfp4::NVFP4_RANGE;
use crate::reference::expert_intermediate;
use crate::routing::{route, router_logits, TopK};
use crate::spec::MoeSpec;
use crate::weights::MoeWeights;
use rayon::prelude::*;

/// Per-expert absolute maxima seen during calibration.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    pub w13_amax: Vec<f32>,
    pub w2_amax: Vec<f32>,
    /// Token-slots routed to each expert.
    pub tokens_per_expert: Vec<usize>,
}

/// Calibrated input scales; experts no token reached get the layer's maximum.
#[derive(Clone, Debug, PartialEq)]
pub struct InputScales {
    pub w13: Vec<f32>,
    pub w2: Vec<f32>,
    /// Experts that received no calibration token.
    pub uncalibrated: Vec<usize>,
}

/// Runs `x` (`[T, H]`) routed by `topk` through the unquantized layer and records maxima.
pub fn calibrate(spec: &MoeSpec, w: &MoeWeights, x: &[f32], topk: &TopK) -> Calibration {
    let e_n = spec.shape.experts;
    let hidden = spec.shape.hidden;
    let per_token: Vec<Vec<(usize, f32, f32)>> = x
        .par_chunks(hidden)
        .enumerate()
        .map(|(t, xt)| {
            let a: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
            let xmax = xt.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            topk.ids[t * topk.k..(t + 1) * topk.k]
                .iter()
                .map(|&e| {
                    let g = expert_intermediate(w, spec.activation, e as usize, &a);
                    let gmax = g.iter().fold(0.0f64, |m, v| m.max(v.abs())) as f32;
                    (e as usize, xmax, gmax)
                })
                .collect()
        })
        .collect();
    let mut c = Calibration {
        w13_amax: vec![0.0; e_n],
        w2_amax: vec![0.0; e_n],
        tokens_per_expert: vec![0; e_n],
    };
    for (e, xm, gm) in per_token.into_iter().flatten() {
        c.w13_amax[e] = c.w13_amax[e].max(xm);
        c.w2_amax[e] = c.w2_amax[e].max(gm);
        c.tokens_per_expert[e] += 1;
    }
    c
}

/// Routes `x` (`[T, H]`) with the layer's own router weight and bias, calibrates on it and
/// stores the resulting input scales in `w`. Errors when `w` has no router weight.
pub fn calibrate_with_router(spec: &MoeSpec, w: &mut MoeWeights, x: &[f32]) -> Result<InputScales> {
    let router = w.router.as_deref().ok_or_else(|| {
        Error::arg(
            "router",
            "calibration routes with the layer's router weight, and there is none",
        )
    })?;
    let (h, e) = (spec.shape.hidden, spec.shape.experts);
    let logits = router_logits(x, router, h, e);
    let topk = route(
        &logits,
        e,
        &spec.routing,
        w.e_score_correction_bias.as_deref(),
    );
    let scales = calibrate(spec, w, x, &topk).input_scales();
    w.w13_input_scale = Some(scales.w13.clone());
    w.w2_input_scale = Some(scales.w2.clone());
    Ok(scales)
}

impl Calibration {
    /// `amax / 2688` per expert; uncalibrated experts take the layer's maximum.
    pub fn input_scales(&self) -> InputScales {
        let uncalibrated: Vec<usize> = (0..self.tokens_per_expert.len())
            .filter(|&e| self.tokens_per_expert[e] == 0)
            .collect();
        let fill = |v: &[f32]| {
            let m = v.iter().fold(0.0f32, |m, x| m.max(*x));
            v.iter()
                .zip(&self.tokens_per_expert)
                .map(|(&a, &n)| if n == 0 { m } else { a } / NVFP4_RANGE)
                .collect()
        };
        InputScales {
            w13: fill(&self.w13_amax),
            w2: fill(&self.w2_amax),
            uncalibrated,
        }
    }
}
