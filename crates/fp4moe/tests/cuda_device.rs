//! CUDA-only checks at real model shapes: every batch size of the decode path, expert counts up
//! to 512, widths that are not multiples of 128, CUDA-graph capture and bitwise reproducibility.
//! Full batches run on the GPU; a sample of tokens is checked against the reference backend
//! (tokens are independent, so a sample checks the batch's routing and grouping too).

mod common;

use fp4moe::calibration::calibrate_with_router;
use fp4moe::cuda::CudaLayer;
use fp4moe::moe::relative_l2;
use fp4moe::routing::router_logits;
use fp4moe::spec::{
    Activation, Intermediate, LayerShape, MoeSpec, QuantMode, RoutingConfig, Scoring,
};
use fp4moe::synthetic::{random_tokens, random_weights};
use fp4moe::weights::MoeWeights;
use fp4moe::{Backend, BackendChoice, MoeLayer};

fn spec(h: usize, i: usize, e: usize, k: usize, act: Activation, quant: QuantMode) -> MoeSpec {
    MoeSpec {
        shape: LayerShape {
            hidden: h,
            intermediate: i,
            experts: e,
        },
        activation: act,
        quant,
        routing: RoutingConfig {
            scoring: if act.is_gated() {
                Scoring::Softmax
            } else {
                Scoring::Sigmoid
            },
            top_k: k,
            n_group: 1,
            topk_group: 1,
            renormalize: true,
            routed_scaling_factor: if act.is_gated() { 1.0 } else { 2.5 },
        },
        shared_intermediate: None,
    }
}

fn with_scales(spec: &MoeSpec, mut w: MoeWeights, x: &[f32]) -> MoeWeights {
    if let QuantMode::W4A4 { .. } = spec.quant {
        let h = spec.shape.hidden;
        let calib = &x[..h * 16.min(x.len() / h)];
        calibrate_with_router(spec, &mut w, calib).unwrap();
    }
    w
}

/// Runs `tokens` tokens on CUDA and checks ids against CPU routing on the same logits and a
/// sample of tokens against the reference backend.
fn check(spec: MoeSpec, tokens: usize, seed: u64) {
    let h = spec.shape.hidden;
    let x = random_tokens(tokens, h, seed);
    let w = with_scales(&spec, random_weights(&spec, seed).unwrap(), &x);
    let logits = router_logits(&x, w.router.as_ref().unwrap(), h, spec.shape.experts);
    let gpu = MoeLayer::new(spec, w.clone(), BackendChoice::Use(Backend::Cuda)).unwrap();
    let (out, topk) = gpu.run(&x, Some(&logits)).unwrap();
    assert!(out.iter().all(|v| v.is_finite()), "non-finite output");
    let cpu = MoeLayer::new(spec, w.clone(), BackendChoice::Use(Backend::Cpu)).unwrap();
    let want_topk = cpu.route(&x, Some(&logits)).unwrap();
    assert_eq!(topk.ids, want_topk.ids, "routing ids differ from the CPU's");
    assert!(relative_l2(&topk.weights, &want_topk.weights) < 1e-6);

    let (again, _) = gpu.run(&x, Some(&logits)).unwrap();
    assert!(
        out.iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "not bitwise reproducible"
    );

    let sample: Vec<usize> = (0..tokens).step_by((tokens / 12).max(1)).take(12).collect();
    let xs: Vec<f32> = sample
        .iter()
        .flat_map(|&t| x[t * h..(t + 1) * h].to_vec())
        .collect();
    let ls: Vec<f32> = sample
        .iter()
        .flat_map(|&t| logits[t * spec.shape.experts..(t + 1) * spec.shape.experts].to_vec())
        .collect();
    let reference = MoeLayer::new(spec, w, BackendChoice::Use(Backend::Reference)).unwrap();
    let (want, _) = reference.run(&xs, Some(&ls)).unwrap();
    let got: Vec<f32> = sample
        .iter()
        .flat_map(|&t| out[t * h..(t + 1) * h].to_vec())
        .collect();
    let err = relative_l2(&got, &want);
    println!(
        "{} {} H{} I{} E{} k{} T{tokens}: rel err {err:.3e}",
        spec.activation,
        spec.quant,
        h,
        spec.shape.intermediate,
        spec.shape.experts,
        spec.routing.top_k
    );
    assert!(
        err <= 1e-2,
        "relative error {err:e} against the reference backend"
    );
}

const W4A4: QuantMode = QuantMode::W4A4 {
    intermediate: Intermediate::Static,
};

#[test]
fn nemotron_shape_every_batch_size() {
    if !common::gpu_available() {
        return;
    }
    for quant in [QuantMode::W4A16, W4A4] {
        for t in [1, 7, 64, 300, 2048] {
            check(
                spec(2688, 1856, 128, 6, Activation::Relu2NoMul, quant),
                t,
                1000 + t as u64,
            );
        }
    }
}

#[test]
fn gated_widths_not_multiple_of_128() {
    if !common::gpu_available() {
        return;
    }
    let dynamic = QuantMode::W4A4 {
        intermediate: Intermediate::Dynamic,
    };
    for (act, quant) in [
        (Activation::Silu, QuantMode::W4A16),
        (Activation::GeluTanh, dynamic),
        (Activation::Silu, W4A4),
    ] {
        for t in [1, 64, 300] {
            check(spec(2880, 1856, 16, 4, act, quant), t, 2000 + t as u64);
        }
    }
}

#[test]
fn many_experts_and_top1() {
    if !common::gpu_available() {
        return;
    }
    check(
        spec(256, 128, 512, 8, Activation::Relu2NoMul, QuantMode::W4A16),
        300,
        3,
    );
    check(spec(256, 128, 512, 1, Activation::SiluNoMul, W4A4), 64, 4);
    check(
        spec(2048, 768, 128, 8, Activation::Silu, QuantMode::W4A16),
        64,
        5,
    );
}

#[test]
fn graph_capture_replays_the_layer() {
    if !common::gpu_available() {
        return;
    }
    let s = spec(512, 256, 32, 4, Activation::Silu, QuantMode::W4A16);
    let tokens = 24;
    let w = random_weights(&s, 9).unwrap();
    let layer = CudaLayer::new(&s, &w).unwrap();
    let st = layer.stream().clone();
    let mut ws = layer.workspace(tokens).unwrap();
    let x1 = random_tokens(tokens, 512, 10);
    let x2 = random_tokens(tokens, 512, 11);

    // Eager results for both inputs (router logits computed on the device from the router weight).
    let eager = |ws: &mut fp4moe::cuda::CudaWorkspace, x: &[f32]| {
        st.memcpy_htod(x, &mut ws.x).unwrap();
        layer.forward_device(ws, None).unwrap();
        st.clone_dtoh(&ws.out).unwrap()
    };
    let y1 = eager(&mut ws, &x1);
    let y2 = eager(&mut ws, &x2);

    st.memcpy_htod(&x1, &mut ws.x).unwrap();
    st.synchronize().unwrap();
    st.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    layer.forward_device(&mut ws, None).unwrap();
    let graph = st
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    graph.launch().unwrap();
    assert_eq!(st.clone_dtoh(&ws.out).unwrap(), y1);
    // New input in the same buffer: the replay computes the new routing and output.
    st.memcpy_htod(&x2, &mut ws.x).unwrap();
    graph.launch().unwrap();
    let g2 = st.clone_dtoh(&ws.out).unwrap();
    assert_ne!(y1, y2);
    assert!(
        g2.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()),
        "graph replay differs from eager"
    );
    let cpu = MoeLayer::new(s, w, BackendChoice::Use(Backend::Cpu)).unwrap();
    let (want, _) = cpu.run(&x2, None).unwrap();
    assert!(relative_l2(&g2, &want) < 1e-2);
}
