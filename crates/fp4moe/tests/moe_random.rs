//! Fresh random layers on every backend: every activation and mode, grouped routing, shared
//! experts, top-1, experts no token reaches, all tokens on one expert. Each backend is checked
//! against an independent dense float64 computation from the dequantized weights (DESIGN 2
//! written out once more, naively) and, for fast backends, against the reference backend.

mod common;

use fp4moe::calibration::calibrate_with_router;
use fp4moe::format::activation::qdq_row;
use fp4moe::moe::relative_l2;
use fp4moe::routing::TopK;
use fp4moe::spec::{
    Activation, Intermediate, LayerShape, MoeSpec, QuantMode, RoutingConfig, Scoring,
};
use fp4moe::synthetic::{random_tokens, random_weights};
use fp4moe::weights::MoeWeights;
use fp4moe::{Backend, BackendChoice, MoeLayer, Workspace};

const MODES: [QuantMode; 3] = [
    QuantMode::W4A16,
    QuantMode::W4A4 {
        intermediate: Intermediate::Static,
    },
    QuantMode::W4A4 {
        intermediate: Intermediate::Dynamic,
    },
];

fn spec(activation: Activation, quant: QuantMode, experts: usize, top_k: usize) -> MoeSpec {
    MoeSpec {
        shape: LayerShape {
            hidden: 96,
            intermediate: 80,
            experts,
        },
        activation,
        quant,
        routing: RoutingConfig {
            scoring: Scoring::Sigmoid,
            top_k,
            n_group: 1,
            topk_group: 1,
            renormalize: true,
            routed_scaling_factor: 2.5,
        },
        shared_intermediate: None,
    }
}

/// Random weights with W4A4 input scales calibrated on `x` (unquantized pass, ModelOpt-style).
fn layer_weights(spec: &MoeSpec, seed: u64, x: &[f32]) -> MoeWeights {
    let mut w = random_weights(spec, seed).unwrap();
    if matches!(spec.quant, QuantMode::W4A4 { .. }) {
        calibrate_with_router(spec, &mut w, x).unwrap();
    }
    w
}

/// DESIGN 2 from dense f64 matrices of the dequantized weights: `y_t = Σ w · o + shared(x_t)`
/// (the routed weights include rsf; the shared expert runs on the unquantized token).
fn dense_oracle(spec: &MoeSpec, w: &MoeWeights, x: &[f32], topk: &TopK) -> Vec<f32> {
    let (h, i) = (spec.shape.hidden, spec.shape.intermediate);
    let act = spec.activation;
    let gs1 = w.input_global_scale();
    let gs2 = match spec.quant {
        QuantMode::W4A4 { intermediate } => w.intermediate_global_scale(intermediate),
        QuantMode::W4A16 => None,
    };
    let mut out = vec![0.0f32; x.len()];
    for t in 0..topk.tokens {
        let xt = &x[t * h..(t + 1) * h];
        let a: Vec<f32> = match (spec.quant, gs1) {
            (QuantMode::W4A4 { .. }, Some(gs)) => {
                let mut q = vec![0.0; h];
                qdq_row(xt, gs, &mut q);
                q
            }
            _ => xt.to_vec(),
        };
        let mut y = vec![0.0f64; h];
        for j in 0..topk.k {
            let e = topk.ids[t * topk.k + j] as usize;
            let wt = topk.weights[t * topk.k + j] as f64;
            let w13 = w.w13.dequantize_expert(e);
            let w2 = w.w2.dequantize_expert(e);
            let hv: Vec<f64> = w13
                .chunks_exact(h)
                .map(|row| row.iter().zip(&a).map(|(p, q)| *p as f64 * *q as f64).sum())
                .collect();
            let mut g: Vec<f32> = (0..i)
                .map(|c| {
                    if act.is_gated() {
                        act.apply_f64(hv[c], hv[i + c]) as f32
                    } else {
                        act.apply_f64(hv[c], 0.0) as f32
                    }
                })
                .collect();
            if let Some(gs) = gs2 {
                let src = g.clone();
                qdq_row(&src, gs, &mut g);
            }
            for (r, yr) in y.iter_mut().enumerate() {
                let o: f64 = w2[r * i..(r + 1) * i]
                    .iter()
                    .zip(&g)
                    .map(|(p, q)| *p as f64 * *q as f64)
                    .sum();
                *yr += wt * o;
            }
        }
        if let Some(sh) = &w.shared {
            // Dense MLP on the unquantized token, added after the routed sum.
            let width = sh.w2.cols();
            let mut row = vec![0.0f32; h.max(width)];
            let hv: Vec<f64> = (0..sh.w13.rows())
                .map(|r| {
                    sh.w13.row_f32(r, &mut row[..h]);
                    row[..h]
                        .iter()
                        .zip(xt)
                        .map(|(p, q)| *p as f64 * *q as f64)
                        .sum()
                })
                .collect();
            let g: Vec<f64> = (0..width)
                .map(|c| {
                    if act.is_gated() {
                        act.apply_f64(hv[c], hv[width + c])
                    } else {
                        act.apply_f64(hv[c], 0.0)
                    }
                })
                .collect();
            for (r, yr) in y.iter_mut().enumerate() {
                sh.w2.row_f32(r, &mut row[..width]);
                *yr += row[..width]
                    .iter()
                    .zip(&g)
                    .map(|(p, q)| *p as f64 * q)
                    .sum::<f64>();
            }
        }
        for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(&y) {
            *o = *v as f32;
        }
    }
    out
}

fn tolerance(backend: Backend, quant: QuantMode) -> f64 {
    match (backend, quant) {
        (Backend::Reference, QuantMode::W4A16) => 1e-5,
        (Backend::Reference, _) => 5e-3,
        _ => 1e-2,
    }
}

/// Runs `spec` on `backend`, checks it against the dense oracle and the reference backend, and
/// that a second run is bitwise identical.
fn check(
    backend: Backend,
    spec: MoeSpec,
    w: MoeWeights,
    x: &[f32],
    topk: Option<TopK>,
    what: &str,
) {
    let layer = MoeLayer::new(spec, w.clone(), BackendChoice::Use(backend)).unwrap();
    let topk = match topk {
        Some(t) => t,
        None => layer.route(x, None).unwrap(),
    };
    let mut out = vec![f32::NAN; x.len()];
    let mut ws = Workspace::default();
    layer.forward(x, &topk, &mut out, &mut ws).unwrap();
    assert!(
        out.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    assert!(out.iter().any(|v| *v != 0.0), "{what}: all-zero output");
    let mut again = vec![0.0f32; x.len()];
    layer.forward(x, &topk, &mut again, &mut ws).unwrap();
    assert!(
        out.iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}: not reproducible"
    );

    let oracle = dense_oracle(&spec, &w, x, &topk);
    let err = relative_l2(&out, &oracle);
    let tol = tolerance(backend, spec.quant);
    assert!(
        err <= tol,
        "{what} on {backend}: {err:e} from the dense oracle (tolerance {tol:e})"
    );
    if backend != Backend::Reference {
        let reference = MoeLayer::new(spec, w, BackendChoice::Use(Backend::Reference)).unwrap();
        let mut want = vec![0.0f32; x.len()];
        reference
            .forward(x, &topk, &mut want, &mut Workspace::default())
            .unwrap();
        let err = relative_l2(&out, &want);
        assert!(
            err <= 1e-2,
            "{what} on {backend}: {err:e} from the reference backend"
        );
    }
}

fn every_activation_and_mode(backend: Backend) {
    for (n, act) in Activation::ALL.into_iter().enumerate() {
        for (m, quant) in MODES.into_iter().enumerate() {
            let seed = 100 + 10 * n as u64 + m as u64;
            let s = spec(act, quant, 8, 2);
            let x = random_tokens(7, s.shape.hidden, seed);
            let w = layer_weights(&s, seed, &x);
            check(backend, s, w, &x, None, &format!("{act} {quant}"));
        }
    }
}

fn grouped_softmax_top1_and_shared(backend: Backend) {
    // Grouped sigmoid + bias routing (DeepSeek-style) with a shared expert, gated SiLU.
    let mut s = spec(Activation::Silu, QuantMode::W4A16, 16, 3);
    s.routing.n_group = 4;
    s.routing.topk_group = 2;
    s.shared_intermediate = Some(48);
    let x = random_tokens(9, s.shape.hidden, 7);
    let w = layer_weights(&s, 7, &x);
    check(backend, s, w, &x, None, "grouped + shared");

    // Softmax top-1 without renormalization, non-gated ReLU², shared expert, W4A4.
    let mut s = spec(
        Activation::Relu2NoMul,
        QuantMode::W4A4 {
            intermediate: Intermediate::Static,
        },
        8,
        1,
    );
    s.routing.scoring = Scoring::Softmax;
    s.routing.renormalize = false;
    s.routing.routed_scaling_factor = 1.0;
    s.shared_intermediate = Some(32);
    let x = random_tokens(5, s.shape.hidden, 8);
    let w = layer_weights(&s, 8, &x);
    check(backend, s, w, &x, None, "top-1 softmax + shared");
}

fn skewed_routing(backend: Backend) {
    let s = spec(Activation::GeluTanh, QuantMode::W4A16, 8, 2);
    let tokens = 6;
    let x = random_tokens(tokens, s.shape.hidden, 9);
    let w = layer_weights(&s, 9, &x);
    // Every token on experts 3 and 5 (the others get nothing), with uneven weights.
    let topk = TopK {
        tokens,
        k: 2,
        ids: (0..tokens).flat_map(|_| [3, 5]).collect(),
        weights: (0..tokens)
            .flat_map(|t| [0.25 + 0.1 * t as f32, 0.5])
            .collect(),
    };
    check(backend, s, w.clone(), &x, Some(topk), "two hot experts");
    // All tokens on one expert (top-1).
    let mut s1 = s;
    s1.routing.top_k = 1;
    let topk = TopK {
        tokens,
        k: 1,
        ids: vec![6; tokens],
        weights: vec![1.0; tokens],
    };
    check(backend, s1, w, &x, Some(topk), "one expert");
}

fn batch_independence(backend: Backend) {
    // A token's output does not depend on which other tokens share its batch, bit for bit, as
    // long as both batches take the same kernels. On CUDA, 8 gated experts x top-2 run the
    // decode GEMMs below 29 tokens (7.25 per expert) and the prefill GEMMs from there, which sum
    // in another order; the second pair crosses that threshold (40 tokens prefill, 16 decode)
    // and has passed on the H200 since the threshold moved above 16 tokens: with K of 96 and 80
    // (two 64-wide k chunks at most) both paths give the same bits. README's limits say where
    // the last bits can move.
    let s = spec(Activation::Silu, QuantMode::W4A16, 8, 2);
    let x = random_tokens(40, s.shape.hidden, 11);
    let w = layer_weights(&s, 11, &x);
    let layer = MoeLayer::new(s, w, BackendChoice::Use(backend)).unwrap();
    let h = s.shape.hidden;
    for (full, part) in [(0..11, 5..8), (0..40, 12..28)] {
        let (all, _) = layer.run(&x[full.start * h..full.end * h], None).unwrap();
        let (some, _) = layer.run(&x[part.start * h..part.end * h], None).unwrap();
        let at = (part.start - full.start) * h;
        assert_eq!(
            &all[at..at + part.len() * h],
            &some[..],
            "{full:?} / {part:?}"
        );
    }
}

per_backend!(
    every_activation_and_mode,
    grouped_softmax_top1_and_shared,
    skewed_routing,
    batch_independence
);
