//! Typed errors for layers that cannot run as specified.

use fp4moe::spec::{
    Activation, Intermediate, LayerShape, MoeSpec, QuantMode, RoutingConfig, SpecError,
};
use fp4moe::synthetic::{random_tokens, random_weights};
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
