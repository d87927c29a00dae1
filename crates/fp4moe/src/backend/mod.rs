//! Backends: what each supports, how one is chosen, and the internal trait they implement.
//!
//! [`Backend`] is the public enum users pick from; every variant declares [`Capabilities`]
//! (device, activations, gated/non-gated, quant modes, shared expert, expert parallelism).
//! [`select`] returns the first candidate whose capabilities cover a [`MoeSpec`], or an error that
//! lists why each candidate was rejected. Asking for a backend that lacks a feature is an error
//! naming both, never a silent fallback.

use crate::error::{Error, Result};
use crate::routing::TopK;
use crate::spec::{Activation, Intermediate, MoeSpec, QuantMode};
use crate::weights::MoeWeights;
use std::fmt;
use std::sync::Arc;

/// Where a backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// A backend users can ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// Float64 accumulation, DESIGN 2 verbatim: the oracle other backends are tested against.
    Reference,
    /// The fast multi-threaded CPU path (f32 accumulation, bf16 intermediates).
    Cpu,
    /// NVIDIA GPUs (Ampere and newer; Hopper sm_90a first) through NVRTC-compiled kernels.
    Cuda,
}

impl Backend {
    /// Candidates of `auto`, best first.
    pub const AUTO_ORDER: [Backend; 3] = [Backend::Cuda, Backend::Cpu, Backend::Reference];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Reference => "reference",
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::AUTO_ORDER.into_iter().find(|b| b.name() == name)
    }

    pub fn capabilities(self) -> Capabilities {
        match self {
            Backend::Reference | Backend::Cpu => Capabilities {
                device: DeviceKind::Cpu,
                activations: &Activation::ALL,
                w4a16: true,
                w4a4_static: true,
                w4a4_dynamic: true,
                shared_expert: true,
                expert_parallel: false,
                max_experts: None,
                max_top_k: None,
                max_groups: None,
            },
            // The CPU's feature set, within the limits of the kernels' shared-memory tables.
            Backend::Cuda => Capabilities {
                device: DeviceKind::Cuda,
                max_experts: Some(crate::cuda::MAX_EXPERTS),
                max_top_k: Some(crate::cuda::MAX_TOP_K),
                max_groups: Some(crate::cuda::MAX_GROUPS),
                ..Backend::Cpu.capabilities()
            },
        }
    }

    /// Whether this backend can run here at all (a driver, a device).
    pub fn availability(self) -> std::result::Result<(), String> {
        match self {
            Backend::Reference | Backend::Cpu => Ok(()),
            Backend::Cuda => crate::cuda::device().map(|_| ()).map_err(|e| match e {
                Error::CudaUnavailable { reason } => reason,
                other => other.to_string(),
            }),
        }
    }

    pub(crate) fn prepare(
        self,
        spec: &MoeSpec,
        weights: Arc<MoeWeights>,
    ) -> Result<Box<dyn Experts>> {
        Ok(match self {
            Backend::Reference => Box::new(crate::reference::ReferenceExperts::new(spec, weights)?),
            Backend::Cpu => Box::new(crate::cpu::CpuExperts::new(spec, weights)?),
            Backend::Cuda => Box::new(crate::cuda::CudaExperts::new(spec, weights)?),
        })
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a backend can run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Capabilities {
    pub device: DeviceKind,
    pub activations: &'static [Activation],
    pub w4a16: bool,
    pub w4a4_static: bool,
    pub w4a4_dynamic: bool,
    pub shared_expert: bool,
    pub expert_parallel: bool,
    /// Largest expert count, top-k and group count the backend's kernels handle.
    pub max_experts: Option<usize>,
    pub max_top_k: Option<usize>,
    pub max_groups: Option<usize>,
}

impl Capabilities {
    /// `Ok` when the spec is covered, else the first missing feature in words.
    pub fn supports(&self, spec: &MoeSpec) -> std::result::Result<(), String> {
        let act = spec.activation;
        if !self.activations.contains(&act) {
            let kind = if act.is_gated() { "gated" } else { "non-gated" };
            return Err(format!("activation `{act}` ({kind}) is not supported"));
        }
        let mode_ok = match spec.quant {
            QuantMode::W4A16 => self.w4a16,
            QuantMode::W4A4 {
                intermediate: Intermediate::Static,
            } => self.w4a4_static,
            QuantMode::W4A4 {
                intermediate: Intermediate::Dynamic,
            } => self.w4a4_dynamic,
        };
        if !mode_ok {
            return Err(format!("quant mode {} is not supported", spec.quant));
        }
        if spec.shared_intermediate.is_some() && !self.shared_expert {
            return Err("shared experts are not supported".into());
        }
        let limits = [
            ("experts", spec.shape.experts, self.max_experts),
            ("top_k", spec.routing.top_k, self.max_top_k),
            ("n_group", spec.routing.n_group, self.max_groups),
        ];
        for (what, value, max) in limits {
            if let Some(m) = max {
                if value > m {
                    return Err(format!("{what} = {value} exceeds its limit of {m}"));
                }
            }
        }
        Ok(())
    }
}

/// The first of `candidates` that is available and supports `spec`.
pub fn select(candidates: &[Backend], spec: &MoeSpec) -> Result<Backend> {
    let mut reasons = Vec::new();
    for &b in candidates {
        match b
            .availability()
            .and_then(|()| b.capabilities().supports(spec))
        {
            Ok(()) => return Ok(b),
            Err(r) => reasons.push((b.name().to_string(), r)),
        }
    }
    Err(Error::NoBackend { reasons })
}

/// Checks one explicitly requested backend, naming it in the error.
pub fn require(backend: Backend, spec: &MoeSpec) -> Result<()> {
    backend
        .availability()
        .and_then(|()| backend.capabilities().supports(spec))
        .map_err(|reason| Error::Unsupported {
            backend: backend.name().to_string(),
            reason,
        })
}

/// Scratch memory a backend's `forward` uses, kept by the caller between calls so the hot path
/// does not allocate once it has grown to the largest batch.
#[derive(Default, Debug)]
pub struct Workspace {
    pub(crate) f32s: Vec<f32>,
    pub(crate) idx: Vec<u32>,
}

impl Workspace {
    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        self.f32s.capacity() * 4 + self.idx.capacity() * 4
    }
}

/// A backend with its weights prepared for one layer.
pub(crate) trait Experts: Send + Sync {
    /// Bytes of [`Workspace`] a `forward` over `tokens` tokens needs.
    fn workspace_bytes(&self, tokens: usize) -> usize;

    /// `out[t] = Σ_j topk.weights[t, j] · expert_{ids[t, j]}(x_t) + shared(x_t)`.
    /// Sizes were checked by the caller.
    fn forward(&self, x: &[f32], topk: &TopK, out: &mut [f32], ws: &mut Workspace) -> Result<()>;

    /// Whether the backend routes on its own device ([`Experts::run_routed`]).
    fn routes_on_device(&self) -> bool {
        false
    }

    /// Routing and experts in one call on the device (only when `routes_on_device`).
    fn run_routed(&self, _x: &[f32], _logits: Option<&[f32]>, _out: &mut [f32]) -> Result<TopK> {
        Err(Error::Unsupported {
            backend: "this backend".into(),
            reason: "routing on the device".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{LayerShape, RoutingConfig};

    fn spec(activation: Activation, quant: QuantMode) -> MoeSpec {
        MoeSpec {
            shape: LayerShape {
                hidden: 32,
                intermediate: 32,
                experts: 4,
            },
            activation,
            quant,
            routing: RoutingConfig::softmax(2),
            shared_intermediate: None,
        }
    }

    #[test]
    fn auto_picks_the_gpu_when_present_else_cpu() {
        let want = if Backend::Cuda.availability().is_ok() {
            Backend::Cuda
        } else {
            Backend::Cpu
        };
        for a in Activation::ALL {
            assert_eq!(
                select(&Backend::AUTO_ORDER, &spec(a, QuantMode::W4A16)).unwrap(),
                want
            );
        }
        // Limits are part of the declaration: 513 experts rule the GPU out.
        let mut big = spec(Activation::Silu, QuantMode::W4A16);
        big.shape.experts = 513;
        let reason = Backend::Cuda.capabilities().supports(&big).unwrap_err();
        assert_eq!(reason, "experts = 513 exceeds its limit of 512");
    }

    #[test]
    fn rejection_lists_every_candidate_and_reason() {
        let narrow = Capabilities {
            activations: &[Activation::Silu],
            w4a4_dynamic: false,
            ..Backend::Cpu.capabilities()
        };
        let s = spec(Activation::Relu2NoMul, QuantMode::W4A16);
        assert_eq!(
            narrow.supports(&s).unwrap_err(),
            "activation `relu2_no_mul` (non-gated) is not supported"
        );
        let s = spec(
            Activation::Silu,
            QuantMode::W4A4 {
                intermediate: Intermediate::Dynamic,
            },
        );
        assert!(narrow
            .supports(&s)
            .unwrap_err()
            .contains("w4a4 (dynamic intermediate)"));
        let e = Error::NoBackend {
            reasons: vec![("a".into(), "x".into()), ("b".into(), "y".into())],
        };
        assert_eq!(
            e.to_string(),
            "no backend supports this layer:\n  - a: x\n  - b: y"
        );
        assert_eq!(
            select(&[], &s).unwrap_err().to_string(),
            "no backend supports this layer:\n"
        );
    }
}
