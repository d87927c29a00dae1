//! Backend weight preparation: gated w13 is interleaved and back, non-gated w13 comes out of
//! every prepare path byte-identical, and scale swizzling round-trips per expert.

use fp4moe::cuda::pack::{pack_nvfp4, unpack_nvfp4};
use fp4moe::format::swizzle::{swizzle_128x4, unswizzle_128x4};
use fp4moe::layout::{deinterleave_gate_up, fold_report, fold_scale_2, prepare_w13_interleaved};
use fp4moe::spec::{Activation, LayerShape, MoeSpec, QuantMode, RoutingConfig};
use fp4moe::synthetic::random_weights;

fn spec(activation: Activation) -> MoeSpec {
    MoeSpec {
        shape: LayerShape {
            hidden: 64,
            // Not a multiple of 64 or 128, like Nemotron's 1856 = 29·64 (here 3·64 + 16).
            intermediate: 208,
            experts: 3,
        },
        activation,
        quant: QuantMode::W4A16,
        routing: RoutingConfig::softmax(2),
        shared_intermediate: None,
    }
}

#[test]
fn non_gated_w13_is_untouched_by_every_prepare_path() {
    for act in [Activation::Relu2NoMul, Activation::SiluNoMul] {
        let s = spec(act);
        let w = random_weights(&s, 3).unwrap();
        let p = prepare_w13_interleaved(&w.w13, act);
        assert!(!p.interleaved);
        assert_eq!(p.packed, w.w13.packed, "{act}: packed bytes changed");
        assert_eq!(p.scales, w.w13.scales, "{act}: scale bytes changed");
        let (rows, kc) = (w.w13.rows, w.w13.scale_cols());
        let sw = swizzle_128x4(&w.w13.scales, s.shape.experts, rows, kc);
        assert_eq!(
            unswizzle_128x4(&sw, s.shape.experts, rows, kc),
            w.w13.scales
        );
        // The CUDA decode layout is a pure permutation within each row group: unpacking gives
        // back the same bytes in the same row order (no gate/up swap, no interleave).
        let (data, scales) = pack_nvfp4(&w.w13);
        let (packed, lin) = unpack_nvfp4(&data, &scales, s.shape.experts, rows, s.shape.hidden);
        assert_eq!(packed, w.w13.packed, "{act}: CUDA layout changed w13 bytes");
        assert_eq!(lin, w.w13.scales, "{act}: CUDA layout changed w13 scales");
    }
}

#[test]
fn gated_w13_interleaves_gate_and_up_and_back() {
    let s = spec(Activation::Silu);
    let w = random_weights(&s, 4).unwrap();
    let p = prepare_w13_interleaved(&w.w13, Activation::Silu);
    assert!(p.interleaved);
    let (i, rb) = (s.shape.intermediate, w.w13.row_bytes());
    // Row 0 of the interleaved expert 1 is up row 0 (source row I); row 64 is gate row 0.
    let e1 = 2 * i * rb;
    assert_eq!(
        &p.packed[e1..e1 + rb],
        &w.w13.packed[e1 + i * rb..e1 + (i + 1) * rb]
    );
    assert_eq!(
        &p.packed[e1 + 64 * rb..e1 + 65 * rb],
        &w.w13.packed[e1..e1 + rb]
    );
    // The last, partial chunk: rows [2·192, 2·192 + 16) are up 192..208, then gate 192..208.
    assert_eq!(
        &p.packed[e1 + 384 * rb..e1 + 385 * rb],
        &w.w13.packed[e1 + (i + 192) * rb..e1 + (i + 193) * rb]
    );
    assert_eq!(
        &p.packed[e1 + 400 * rb..e1 + 401 * rb],
        &w.w13.packed[e1 + 192 * rb..e1 + 193 * rb]
    );
    assert_eq!(deinterleave_gate_up(&p.packed, 3, i, rb), w.w13.packed);
    assert_eq!(
        deinterleave_gate_up(&p.scales, 3, i, w.w13.scale_cols()),
        w.w13.scales
    );
}

#[test]
fn folding_real_weight_scales_is_refused_and_measured() {
    let s = spec(Activation::Relu2NoMul);
    let w = random_weights(&s, 5).unwrap();
    let per = w.w2.rows * w.w2.scale_cols();
    let scales = &w.w2.scales[..per];
    let report = fold_report(scales, w.w2.scale_2[0]);
    assert!(
        report.worst_relative_error > 0.01,
        "{}",
        report.worst_relative_error
    );
    let err = fold_scale_2("w2[0]", scales, w.w2.scale_2[0]).unwrap_err();
    assert_eq!(err.worst_relative_error, report.worst_relative_error);
    // A power-of-two scale_2 that keeps every product normal folds exactly.
    let tame: Vec<u8> = scales.iter().map(|&b| b.clamp(0x40, 0x70)).collect();
    let folded = fold_scale_2("w2[0]", &tame, 0.25).unwrap();
    for (a, b) in tame.iter().zip(&folded) {
        assert_eq!(
            fp4moe::format::e4m3::decode(*a) * 0.25,
            fp4moe::format::e4m3::decode(*b)
        );
    }
}
