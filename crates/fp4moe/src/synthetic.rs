//! Synthetic layers of real model shapes, for the demo, benchmarks and tests.
//!
//! Weights are random normal `N(0, 1/fan_in)` rounded to bf16 (what a bf16 checkpoint holds)
//! and quantized with the ModelOpt recipe, one expert at a time, so no full f32 copy of the
//! layer ever exists. Tokens are random normal rounded to bf16. Everything derives from a seed.

use crate::error::Result;
use crate::spec::{Activation, LayerShape, MoeSpec, QuantMode, RoutingConfig, Scoring};
use crate::weights::{DenseWeight, ExpertStack, MoeWeights, SharedExpert};
use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

/// Model shapes the demo and benchmarks know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// Nemotron-3 Nano 30B-A3B: H 2688, I 1856, E 128, top-6, ReLU², sigmoid + bias,
    /// renormalized, rsf 2.5 (routed experts only; the shared expert is a separate option).
    Nemotron3Nano,
    /// Qwen3-30B-A3B: H 2048, I 768, E 128, top-8, SiLU gated, softmax + renormalize.
    Qwen3_30bA3b,
}

impl Preset {
    pub const ALL: [Preset; 2] = [Preset::Nemotron3Nano, Preset::Qwen3_30bA3b];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Nemotron3Nano => "nemotron3-nano",
            Preset::Qwen3_30bA3b => "qwen3-30b-a3b",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    pub fn spec(self, quant: QuantMode) -> MoeSpec {
        match self {
            Preset::Nemotron3Nano => MoeSpec {
                shape: LayerShape {
                    hidden: 2688,
                    intermediate: 1856,
                    experts: 128,
                },
                activation: Activation::Relu2NoMul,
                quant,
                routing: RoutingConfig {
                    scoring: Scoring::Sigmoid,
                    top_k: 6,
                    n_group: 1,
                    topk_group: 1,
                    renormalize: true,
                    routed_scaling_factor: 2.5,
                },
                shared_intermediate: None,
            },
            Preset::Qwen3_30bA3b => MoeSpec {
                shape: LayerShape {
                    hidden: 2048,
                    intermediate: 768,
                    experts: 128,
                },
                activation: Activation::Silu,
                quant,
                routing: RoutingConfig::softmax(8),
                shared_intermediate: None,
            },
        }
    }
}

fn seeded(seed: u64, stream: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn fill_normal_bf16(rng: &mut SmallRng, std: f32, buf: &mut [f32]) {
    for v in buf.iter_mut() {
        let z: f32 = rng.sample(StandardNormal);
        *v = bf16::from_f32(z * std).to_f32();
    }
}

/// `tokens x hidden` bf16-exact random activations.
pub fn random_tokens(tokens: usize, hidden: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0f32; tokens * hidden];
    fill_normal_bf16(&mut seeded(seed, 1), 1.0, &mut v);
    v
}

/// Random bf16 weights for `spec`, quantized with the ModelOpt recipe. Includes a router gate,
/// a routing bias when the spec scores with sigmoid, and a bf16 shared expert when the spec has
/// one. W4A4 input scales are left to [`crate::calibration`] or the caller. An invalid
/// `spec` is an error.
pub fn random_weights(spec: &MoeSpec, seed: u64) -> Result<MoeWeights> {
    spec.validate()?;
    let s = spec.shape;
    let shards = spec.activation.w13_shards();
    let rows13 = shards * s.intermediate;
    let std1 = (1.0 / s.hidden as f32).sqrt();
    let std2 = (1.0 / s.intermediate as f32).sqrt();
    let w13 = ExpertStack::quantize_with("w13", s.experts, rows13, s.hidden, shards, |e, buf| {
        fill_normal_bf16(&mut seeded(seed, 1000 + e as u64), std1, buf)
    })?;
    let w2 = ExpertStack::quantize_with("w2", s.experts, s.hidden, s.intermediate, 1, |e, buf| {
        fill_normal_bf16(&mut seeded(seed, 1_000_000 + e as u64), std2, buf)
    })?;
    let mut router = vec![0.0f32; s.experts * s.hidden];
    fill_normal_bf16(&mut seeded(seed, 2), std1, &mut router);
    let bias = (spec.routing.scoring == Scoring::Sigmoid).then(|| {
        let mut b = vec![0.0f32; s.experts];
        fill_normal_bf16(&mut seeded(seed, 3), 0.05, &mut b);
        b
    });
    let shared = spec.shared_intermediate.map(|w| {
        let mut a = vec![0.0f32; shards * w * s.hidden];
        let mut b = vec![0.0f32; s.hidden * w];
        fill_normal_bf16(&mut seeded(seed, 4), std1, &mut a);
        fill_normal_bf16(&mut seeded(seed, 5), (1.0 / w as f32).sqrt(), &mut b);
        let bf = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect();
        SharedExpert {
            w13: DenseWeight::Bf16 {
                rows: shards * w,
                cols: s.hidden,
                data: bf(a),
            },
            w2: DenseWeight::Bf16 {
                rows: s.hidden,
                cols: w,
                data: bf(b),
            },
        }
    });
    Ok(MoeWeights {
        w13,
        w2,
        w13_input_scale: None,
        w2_input_scale: None,
        e_score_correction_bias: bias,
        router: Some(router),
        shared,
    })
}
