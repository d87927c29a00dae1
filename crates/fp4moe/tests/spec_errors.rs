//! Typed errors for layers that cannot run as specified or whose weights are invalid.

use fp4moe::format::FormatError;
use fp4moe::spec::{
    Activation, Intermediate, LayerShape, MoeSpec, QuantMode, RoutingConfig, SpecError,
};
use fp4moe::synthetic::{random_tokens, random_weights};
use fp4moe::weights::{DenseWeight, ExpertStack, MoeWeights, SharedExpert};
use fp4moe::{BackendChoice, Error, MoeLayer};

fn spec(quant: QuantMode) -> MoeSpec {
    MoeSpec {
        shape: LayerShape {
            hidden: 32,
            intermediate: 32,
            experts: 4,
        },
        activation: Activation::Silu,
        quant,
        routing: RoutingConfig::softmax(2),
        shared_intermediate: None,
    }
}

#[test]
fn w4a4_without_input_scales_is_refused() {
    let w16 = spec(QuantMode::W4A16);
    let w = random_weights(&w16, 1).unwrap();
    let s = spec(QuantMode::W4A4 {
        intermediate: Intermediate::Static,
    });
    let e = MoeLayer::new(s, w.clone(), BackendChoice::Auto)
        .err()
        .unwrap();
    assert!(
        matches!(
            e,
            Error::Spec(SpecError::MissingInputScales {
                tensor: "w13_input_scale"
            })
        ),
        "{e}"
    );
    let mut w2 = w.clone();
    w2.w13_input_scale = Some(vec![0.01; 4]);
    let e = MoeLayer::new(s, w2.clone(), BackendChoice::Auto)
        .err()
        .unwrap();
    assert!(
        matches!(
            e,
            Error::Spec(SpecError::MissingInputScales {
                tensor: "w2_input_scale"
            })
        ),
        "{e}"
    );
    // Dynamic intermediate needs only the w13 scales.
    let dynamic = spec(QuantMode::W4A4 {
        intermediate: Intermediate::Dynamic,
    });
    MoeLayer::new(dynamic, w2.clone(), BackendChoice::Auto).unwrap();
    // Zero, negative and non-finite scales name the expert.
    for bad in [0.0, -1.0, f32::NAN] {
        let mut w3 = w2.clone();
        w3.w13_input_scale = Some(vec![0.01, 0.01, bad, 0.01]);
        let e = MoeLayer::new(dynamic, w3, BackendChoice::Auto)
            .err()
            .unwrap();
        assert!(
            matches!(e, Error::Spec(SpecError::BadInputScale { expert: 2, .. })),
            "{e}"
        );
    }
}

#[test]
fn shape_mismatches_and_bad_arguments_are_named() {
    let s = spec(QuantMode::W4A16);
    let w = random_weights(&s, 2).unwrap();
    let mut wide = s;
    wide.shape.intermediate = 48;
    let e = MoeLayer::new(wide, w.clone(), BackendChoice::Auto)
        .err()
        .unwrap();
    assert!(e.to_string().contains("w13_weight"), "{e}");
    // A non-gated spec over gated weights: w13 has twice the rows it expects.
    let mut relu = s;
    relu.activation = Activation::Relu2NoMul;
    let e = MoeLayer::new(relu, w.clone(), BackendChoice::Auto)
        .err()
        .unwrap();
    assert!(e.to_string().contains("w13_weight"), "{e}");

    let layer = MoeLayer::new(s, w, BackendChoice::Auto).unwrap();
    let x = random_tokens(3, 32, 3);
    let e = layer.route(&x[..40], None).unwrap_err();
    assert!(e.to_string().contains("argument `x`"), "{e}");
    let e = layer.route(&x, Some(&[0.0; 5])).unwrap_err();
    assert!(e.to_string().contains("router_logits"), "{e}");
    let mut topk = layer.route(&x, None).unwrap();
    let mut out = vec![0.0; 96];
    topk.ids[1] = 9;
    let e = layer
        .forward(&x, &topk, &mut out, &mut Default::default())
        .unwrap_err();
    assert!(e.to_string().contains("expert id 9"), "{e}");
    let mut short = vec![0.0; 95];
    topk.ids[1] = 1;
    let e = layer
        .forward(&x, &topk, &mut short, &mut Default::default())
        .unwrap_err();
    assert!(e.to_string().contains("argument `out`"), "{e}");
    let mut nan = x.clone();
    nan[40] = f32::INFINITY;
    let e = layer.route(&nan, None).unwrap_err();
    assert!(e.to_string().contains("[1, 8]"), "{e}");
}

/// A gated layer with an NVFP4 shared expert of width 32.
fn nvfp4_shared(w13_shards: usize, w2_shards: usize) -> (MoeSpec, MoeWeights) {
    let mut s = spec(QuantMode::W4A16);
    s.shared_intermediate = Some(32);
    let mut w = random_weights(&s, 4).unwrap();
    let fill = |_: usize, buf: &mut [f32]| {
        for (i, v) in buf.iter_mut().enumerate() {
            *v = (i % 7) as f32 - 3.0;
        }
    };
    w.shared = Some(SharedExpert {
        w13: DenseWeight::Nvfp4(
            ExpertStack::quantize_with("shared_experts.w13", 1, 64, 32, w13_shards, fill).unwrap(),
        ),
        w2: DenseWeight::Nvfp4(
            ExpertStack::quantize_with("shared_experts.w2", 1, 32, 32, w2_shards, fill).unwrap(),
        ),
    });
    (s, w)
}

fn stack(d: &mut DenseWeight) -> &mut ExpertStack {
    match d {
        DenseWeight::Nvfp4(st) => st,
        DenseWeight::Bf16 { .. } => unreachable!("an NVFP4 shared expert"),
    }
}

#[test]
fn nvfp4_shared_expert_is_validated() {
    let (s, w) = nvfp4_shared(2, 1);
    w.validate(&s).unwrap();
    // A NaN block scale byte.
    let mut bad = w.clone();
    let sh = bad.shared.as_mut().unwrap();
    stack(&mut sh.w13).scales[5] = 0x7F;
    let e = bad.validate(&s).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Format(FormatError::BadScaleByte { tensor, .. })
                if tensor == "shared_experts.w13_weight_scale"
        ),
        "{e}"
    );
    // A negative scale_2.
    let mut bad = w.clone();
    let sh = bad.shared.as_mut().unwrap();
    stack(&mut sh.w2).scale_2[0] = -1.0;
    let e = bad.validate(&s).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Format(FormatError::BadScale { tensor, .. })
                if tensor == "shared_experts.w2_weight_scale_2"
        ),
        "{e}"
    );
    // Truncated packed bytes.
    let mut bad = w.clone();
    let sh = bad.shared.as_mut().unwrap();
    stack(&mut sh.w2).packed.pop();
    let e = bad.validate(&s).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Format(FormatError::Shape { tensor, .. }) if tensor == "shared_experts.w2_weight"
        ),
        "{e}"
    );
    // Gated w13 needs gate and up shards, w2 one.
    for (w13_shards, w2_shards, tensor) in [
        (1, 1, "shared_experts.w13_weight_scale_2"),
        (2, 2, "shared_experts.w2_weight_scale_2"),
    ] {
        let (s, w) = nvfp4_shared(w13_shards, w2_shards);
        let e = w.validate(&s).unwrap_err();
        assert!(
            matches!(&e, Error::Spec(SpecError::Shape { tensor: t, .. }) if t == tensor),
            "{e}"
        );
    }
}

#[test]
fn non_finite_bias_and_router_are_refused() {
    let s = spec(QuantMode::W4A16);
    let w = random_weights(&s, 5).unwrap();
    let mut b = w.clone();
    b.e_score_correction_bias = Some(vec![0.0, f32::NAN, 0.0, 0.0]);
    let e = b.validate(&s).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Format(FormatError::NonFinite { tensor, row: 0, col: 1, .. })
                if tensor == "e_score_correction_bias"
        ),
        "{e}"
    );
    let mut r = w.clone();
    r.router.as_mut().unwrap()[40] = f32::NEG_INFINITY;
    let e = MoeLayer::new(s, r, BackendChoice::Auto).err().unwrap();
    assert!(
        matches!(
            &e,
            Error::Format(FormatError::NonFinite { tensor, row: 1, col: 8, .. })
                if tensor == "router"
        ),
        "{e}"
    );
}

#[test]
fn empty_stacks_and_invalid_specs_are_errors() {
    let none = |_: usize, _: &mut [f32]| {};
    for (experts, rows) in [(0, 32), (2, 0)] {
        let e = ExpertStack::quantize_with("w13", experts, rows, 32, 1, none).unwrap_err();
        assert!(
            matches!(&e, FormatError::Shape { tensor, .. } if tensor == "w13"),
            "{e}"
        );
    }
    let e = ExpertStack::quantize_with("w13", 2, 0, 32, 2, none).unwrap_err();
    assert!(matches!(e, FormatError::Shape { .. }), "{e}");

    let mut s = spec(QuantMode::W4A16);
    s.shape.intermediate = 0;
    let e = random_weights(&s, 1).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Spec(SpecError::NotMultipleOf16 {
                what: "intermediate",
                value: 0
            })
        ),
        "{e}"
    );
    let mut s = spec(QuantMode::W4A16);
    s.routing.top_k = 5;
    let e = random_weights(&s, 1).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Spec(SpecError::TopKTooLarge {
                top_k: 5,
                experts: 4
            })
        ),
        "{e}"
    );
}
