//! What a MoE layer computes: shapes, expert activation, quantization mode and routing
//! (DESIGN 2). [`MoeSpec::validate`] gives typed errors for every inconsistent combination.

use std::fmt;

/// Expert activation. Gated ones read `w13 = [gate; up]` (2·I rows) and compute `act(gate) · up`;
/// non-gated ones read `w13 = up` (I rows) and compute `act(h)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `silu(gate) · up` (SwiGLU: Qwen3-MoE, DeepSeek-V3, Mixtral).
    Silu,
    /// `gelu_tanh(gate) · up` (GeGLU).
    GeluTanh,
    /// `max(h, 0)²` (Nemotron-3).
    Relu2NoMul,
    /// `silu(h)`.
    SiluNoMul,
}

impl Activation {
    pub const ALL: [Activation; 4] = [
        Activation::Silu,
        Activation::GeluTanh,
        Activation::Relu2NoMul,
        Activation::SiluNoMul,
    ];

    /// Whether w13 holds gate and up (two shards) rather than up alone.
    pub fn is_gated(self) -> bool {
        matches!(self, Activation::Silu | Activation::GeluTanh)
    }

    /// Rows of w13 per unit of intermediate width (2 gated, 1 non-gated).
    pub fn w13_shards(self) -> usize {
        if self.is_gated() {
            2
        } else {
            1
        }
    }

    /// The name used in vLLM and in the golden files.
    pub fn name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::Relu2NoMul => "relu2_no_mul",
            Activation::SiluNoMul => "silu_no_mul",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// `g` from the GEMM1 outputs in f64 (`up` is ignored for non-gated activations).
    #[inline]
    pub fn apply_f64(self, h: f64, up: f64) -> f64 {
        match self {
            Activation::Silu => silu_f64(h) * up,
            Activation::GeluTanh => gelu_tanh_f64(h) * up,
            Activation::Relu2NoMul => {
                let r = h.max(0.0);
                r * r
            }
            Activation::SiluNoMul => silu_f64(h),
        }
    }

    /// The same in f32.
    #[inline]
    pub fn apply_f32(self, h: f32, up: f32) -> f32 {
        match self {
            Activation::Silu => silu_f32(h) * up,
            Activation::GeluTanh => gelu_tanh_f32(h) * up,
            Activation::Relu2NoMul => {
                let r = h.max(0.0);
                r * r
            }
            Activation::SiluNoMul => silu_f32(h),
        }
    }
}

fn silu_f64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}
fn silu_f32(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}
fn gelu_tanh_f64(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}
fn gelu_tanh_f32(x: f32) -> f32 {
    let c = (2.0f32 / std::f32::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the intermediate activation `g` is quantized in W4A4.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Intermediate {
    /// `gs2 = 1 / max_e input_scale(w2)` from calibration.
    Static,
    /// `gs2 = 1`: per-block scales only, as FlashInfer's B12x does.
    Dynamic,
}

/// Weight/activation precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantMode {
    /// NVFP4 weights, bf16/f32 activations.
    W4A16,
    /// NVFP4 weights and activations: inputs QDQ'd with the calibrated w13 input scale, the
    /// intermediate with the static or dynamic scale.
    W4A4 { intermediate: Intermediate },
}

impl fmt::Display for QuantMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantMode::W4A16 => f.write_str("w4a16"),
            QuantMode::W4A4 {
                intermediate: Intermediate::Static,
            } => f.write_str("w4a4 (static intermediate)"),
            QuantMode::W4A4 {
                intermediate: Intermediate::Dynamic,
            } => f.write_str("w4a4 (dynamic intermediate)"),
        }
    }
}

/// Router score function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scoring {
    Softmax,
    Sigmoid,
}

/// Top-k routing (DESIGN 2). The optional `e_score_correction_bias` lives with the weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoutingConfig {
    pub scoring: Scoring,
    pub top_k: usize,
    /// Expert groups (1 = no grouping).
    pub n_group: usize,
    /// Groups kept when `n_group > 1`.
    pub topk_group: usize,
    pub renormalize: bool,
    /// Multiplies the routed sum (`rsf`).
    pub routed_scaling_factor: f32,
}

impl RoutingConfig {
    /// Plain softmax top-k with renormalization (Qwen3-MoE, Mixtral).
    pub fn softmax(top_k: usize) -> Self {
        Self {
            scoring: Scoring::Softmax,
            top_k,
            n_group: 1,
            topk_group: 1,
            renormalize: true,
            routed_scaling_factor: 1.0,
        }
    }
}

/// Layer dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    /// H: model width, the K of GEMM1.
    pub hidden: usize,
    /// I: expert width, the K of GEMM2.
    pub intermediate: usize,
    /// E: routed experts.
    pub experts: usize,
}

/// Everything that defines the computation of one MoE layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSpec {
    pub shape: LayerShape,
    pub activation: Activation,
    pub quant: QuantMode,
    pub routing: RoutingConfig,
    /// Width of the shared expert, when the layer has one.
    pub shared_intermediate: Option<usize>,
}

/// An inconsistent [`MoeSpec`] or weights that do not match it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error("{what} = {value} must be a positive multiple of 16 (the NVFP4 block size)")]
    NotMultipleOf16 { what: &'static str, value: usize },
    #[error("{what} must be positive")]
    Zero { what: &'static str },
    #[error("top_k = {top_k} exceeds the number of experts ({experts})")]
    TopKTooLarge { top_k: usize, experts: usize },
    #[error("n_group = {n_group} does not divide the number of experts ({experts})")]
    GroupsDoNotDivide { n_group: usize, experts: usize },
    #[error("topk_group = {topk_group} exceeds n_group = {n_group}")]
    TopkGroupTooLarge { topk_group: usize, n_group: usize },
    #[error("top_k = {top_k} exceeds the {available} experts of the {topk_group} kept groups")]
    TopKExceedsKeptGroups {
        top_k: usize,
        topk_group: usize,
        available: usize,
    },
    #[error("routed_scaling_factor = {0} must be finite and positive")]
    BadScalingFactor(f32),
    #[error("W4A4 needs `{tensor}`: without calibrated input scales the activations cannot be quantized (run as W4A16 instead)")]
    MissingInputScales { tensor: &'static str },
    #[error("`{tensor}`: input scale {value} of expert {expert} must be finite and positive")]
    BadInputScale {
        tensor: &'static str,
        expert: usize,
        value: f32,
    },
    #[error("`{tensor}`: expected shape {expected:?}, got {got:?}")]
    Shape {
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("the layer has a shared expert of width {0} but no shared weights were given")]
    MissingShared(usize),
    #[error("shared expert weights were given but the spec has no shared expert")]
    UnexpectedShared,
}

impl MoeSpec {
    /// Checks the spec on its own (weights are checked by `MoeWeights::validate`).
    pub fn validate(&self) -> Result<(), SpecError> {
        let s = &self.shape;
        let r = &self.routing;
        for (what, v) in [("hidden", s.hidden), ("intermediate", s.intermediate)] {
            if v == 0 || v % 16 != 0 {
                return Err(SpecError::NotMultipleOf16 { what, value: v });
            }
        }
        if s.experts == 0 {
            return Err(SpecError::Zero { what: "experts" });
        }
        if r.top_k == 0 {
            return Err(SpecError::Zero { what: "top_k" });
        }
        if r.top_k > s.experts {
            return Err(SpecError::TopKTooLarge {
                top_k: r.top_k,
                experts: s.experts,
            });
        }
        if r.n_group == 0 {
            return Err(SpecError::Zero { what: "n_group" });
        }
        if r.topk_group == 0 {
            return Err(SpecError::Zero { what: "topk_group" });
        }
        if s.experts % r.n_group != 0 {
            return Err(SpecError::GroupsDoNotDivide {
                n_group: r.n_group,
                experts: s.experts,
            });
        }
        if r.topk_group > r.n_group {
            return Err(SpecError::TopkGroupTooLarge {
                topk_group: r.topk_group,
                n_group: r.n_group,
            });
        }
        if r.n_group > 1 {
            let available = r.topk_group * (s.experts / r.n_group);
            if r.top_k > available {
                return Err(SpecError::TopKExceedsKeptGroups {
                    top_k: r.top_k,
                    topk_group: r.topk_group,
                    available,
                });
            }
        }
        if !(r.routed_scaling_factor.is_finite() && r.routed_scaling_factor > 0.0) {
            return Err(SpecError::BadScalingFactor(r.routed_scaling_factor));
        }
        if let Some(w) = self.shared_intermediate {
            if w == 0 || w % 16 != 0 {
                return Err(SpecError::NotMultipleOf16 {
                    what: "shared_intermediate",
                    value: w,
                });
            }
        }
        Ok(())
    }

    /// Rows of one expert's w13.
    pub fn w13_rows(&self) -> usize {
        self.activation.w13_shards() * self.shape.intermediate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> MoeSpec {
        MoeSpec {
            shape: LayerShape {
                hidden: 64,
                intermediate: 32,
                experts: 8,
            },
            activation: Activation::Silu,
            quant: QuantMode::W4A16,
            routing: RoutingConfig::softmax(2),
            shared_intermediate: None,
        }
    }

    #[test]
    fn valid_spec_passes() {
        spec().validate().unwrap();
    }

    #[test]
    fn typed_errors() {
        let mut s = spec();
        s.shape.hidden = 40;
        assert!(matches!(
            s.validate(),
            Err(SpecError::NotMultipleOf16 {
                what: "hidden",
                value: 40
            })
        ));
        let mut s = spec();
        s.routing.top_k = 9;
        assert!(matches!(
            s.validate(),
            Err(SpecError::TopKTooLarge {
                top_k: 9,
                experts: 8
            })
        ));
        let mut s = spec();
        s.routing.n_group = 3;
        assert!(matches!(
            s.validate(),
            Err(SpecError::GroupsDoNotDivide { .. })
        ));
        let mut s = spec();
        s.routing.n_group = 2;
        s.routing.topk_group = 3;
        assert!(matches!(
            s.validate(),
            Err(SpecError::TopkGroupTooLarge { .. })
        ));
        let mut s = spec();
        s.routing.n_group = 4;
        s.routing.topk_group = 1;
        s.routing.top_k = 3;
        assert!(matches!(
            s.validate(),
            Err(SpecError::TopKExceedsKeptGroups { available: 2, .. })
        ));
        let mut s = spec();
        s.routing.routed_scaling_factor = f32::NAN;
        assert!(matches!(s.validate(), Err(SpecError::BadScalingFactor(_))));
    }

    #[test]
    fn gatedness() {
        assert!(Activation::Silu.is_gated() && Activation::GeluTanh.is_gated());
        assert!(!Activation::Relu2NoMul.is_gated() && !Activation::SiluNoMul.is_gated());
        for a in Activation::ALL {
            assert_eq!(Activation::from_name(a.name()), Some(a));
        }
        // ReLU² squares after the clamp: negative pre-activations give exactly 0.
        assert_eq!(Activation::Relu2NoMul.apply_f64(-3.0, 7.0), 0.0);
        assert_eq!(Activation::Relu2NoMul.apply_f64(3.0, 7.0), 9.0);
    }
}
