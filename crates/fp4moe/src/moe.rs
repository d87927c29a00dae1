//! [`MoeLayer`]: one MoE layer bound to a backend — routing, experts, combine.
//!
//! ```text
//! logits = x · Wgate^T (or given)  →  TopK (routing.rs)  →  backend forward  →  y [T, H]
//! ```
//! `forward` writes into a caller-provided output and reuses a caller-kept [`Workspace`]
//! whose size [`MoeLayer::workspace_bytes`] reports.

use crate::backend::{self, Backend, Experts, Workspace};
use crate::error::{Error, Result};
use crate::format::nvfp4::check_finite;
use crate::routing::{self, TopK};
use crate::spec::MoeSpec;
use crate::weights::MoeWeights;
use std::sync::Arc;

/// Which backend a layer runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// The first of [`Backend::AUTO_ORDER`] that supports the layer.
    Auto,
    /// Exactly this one, or an error saying why it cannot.
    Use(Backend),
}

pub struct MoeLayer {
    spec: MoeSpec,
    weights: Arc<MoeWeights>,
    backend: Backend,
    experts: Box<dyn Experts>,
}

impl MoeLayer {
    /// Validates `weights` against `spec`, picks the backend and prepares its weights.
    pub fn new(
        spec: MoeSpec,
        weights: impl Into<Arc<MoeWeights>>,
        choice: BackendChoice,
    ) -> Result<Self> {
        let weights = weights.into();
        weights.validate(&spec)?;
        let backend = match choice {
            BackendChoice::Auto => backend::select(&Backend::AUTO_ORDER, &spec)?,
            BackendChoice::Use(b) => {
                backend::require(b, &spec)?;
                b
            }
        };
        let experts = backend.prepare(&spec, weights.clone())?;
        Ok(Self {
            spec,
            weights,
            backend,
            experts,
        })
    }

    pub fn spec(&self) -> &MoeSpec {
        &self.spec
    }

    pub fn weights(&self) -> &Arc<MoeWeights> {
        &self.weights
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Workspace bytes a forward over `tokens` tokens needs.
    pub fn workspace_bytes(&self, tokens: usize) -> usize {
        self.experts.workspace_bytes(tokens)
    }

    fn tokens_of(&self, x: &[f32]) -> Result<usize> {
        let h = self.spec.shape.hidden;
        if x.len() % h != 0 {
            return Err(Error::arg(
                "x",
                format!("length {} is not a multiple of hidden = {h}", x.len()),
            ));
        }
        check_finite("x", x, h)?;
        Ok(x.len() / h)
    }

    /// Checks `x` and the router inputs: given logits must be `[T, E]` and finite, otherwise
    /// the layer needs a router weight. Returns the token count.
    fn check_router_inputs(&self, x: &[f32], logits: Option<&[f32]>) -> Result<usize> {
        let tokens = self.tokens_of(x)?;
        let e = self.spec.shape.experts;
        match logits {
            Some(l) if l.len() != tokens * e => Err(Error::arg(
                "router_logits",
                format!(
                    "expected {tokens} x {e} = {} values, got {}",
                    tokens * e,
                    l.len()
                ),
            )),
            Some(l) => check_finite("router_logits", l, e)
                .map(|()| tokens)
                .map_err(Error::from),
            None if self.weights.router.is_none() => Err(Error::arg(
                "router_logits",
                "the layer has no router weight: pass router logits",
            )),
            None => Ok(tokens),
        }
    }

    /// Top-k routing of `x` from the given `logits` (`[T, E]`) or from the layer's router weight.
    pub fn route(&self, x: &[f32], logits: Option<&[f32]>) -> Result<TopK> {
        self.check_router_inputs(x, logits)?;
        let e = self.spec.shape.experts;
        let computed;
        let logits = match (logits, &self.weights.router) {
            (Some(l), _) => l,
            (None, Some(r)) => {
                computed = routing::router_logits(x, r, self.spec.shape.hidden, e);
                &computed[..]
            }
            (None, None) => {
                return Err(Error::arg(
                    "router_logits",
                    "the layer has no router weight: pass router logits",
                ))
            }
        };
        Ok(routing::route(
            logits,
            e,
            &self.spec.routing,
            self.weights.e_score_correction_bias.as_deref(),
        ))
    }

    /// Runs the experts for a routing decision: `out` (`[T, H]`) is overwritten.
    pub fn forward(
        &self,
        x: &[f32],
        topk: &TopK,
        out: &mut [f32],
        ws: &mut Workspace,
    ) -> Result<()> {
        let tokens = self.tokens_of(x)?;
        let (h, e) = (self.spec.shape.hidden, self.spec.shape.experts);
        if topk.tokens != tokens || topk.k != self.spec.routing.top_k {
            return Err(Error::arg(
                "topk",
                format!(
                    "routing is for {} tokens x top-{}, the layer expects {tokens} x top-{}",
                    topk.tokens, topk.k, self.spec.routing.top_k
                ),
            ));
        }
        if topk.ids.len() != tokens * topk.k || topk.weights.len() != tokens * topk.k {
            return Err(Error::arg(
                "topk",
                "ids and weights must hold tokens x k values",
            ));
        }
        if let Some(bad) = topk.ids.iter().find(|&&i| i < 0 || i as usize >= e) {
            return Err(Error::arg(
                "topk",
                format!("expert id {bad} is outside 0..{e}"),
            ));
        }
        if out.len() != tokens * h {
            return Err(Error::arg(
                "out",
                format!("expected {} values, got {}", tokens * h, out.len()),
            ));
        }
        self.experts.forward(x, topk, out, ws)
    }

    /// Routes and runs `x`, allocating the output and a workspace. Backends with a device route
    /// there (the GPU computes the router logits too when none are given).
    pub fn run(&self, x: &[f32], logits: Option<&[f32]>) -> Result<(Vec<f32>, TopK)> {
        if self.experts.routes_on_device() {
            self.check_router_inputs(x, logits)?;
            let mut out = vec![0.0f32; x.len()];
            let topk = self.experts.run_routed(x, logits, &mut out)?;
            return Ok((out, topk));
        }
        let topk = self.route(x, logits)?;
        let mut out = vec![0.0f32; x.len()];
        let mut ws = Workspace::default();
        self.forward(x, &topk, &mut out, &mut ws)?;
        Ok((out, topk))
    }
}

/// Relative L2 error `‖got − want‖ / ‖want‖` in f64 (`‖got‖` when `want` is all zero).
pub fn relative_l2(got: &[f32], want: &[f32]) -> f64 {
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (g, w) in got.iter().zip(want) {
        let d = *g as f64 - *w as f64;
        num += d * d;
        den += (*w as f64) * (*w as f64);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}
