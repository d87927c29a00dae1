//! Every golden MoE case on every backend: routing ids exact, weights close, output within the
//! DESIGN tolerances (reference: 1e-5 W4A16 / 5e-3 W4A4 against the float64 oracle; fast
//! backends: 1e-2 against the reference backend and the oracle).

mod common;

use fp4moe::layer_file;
use fp4moe::moe::relative_l2;
use fp4moe::spec::QuantMode;
use fp4moe::{Backend, BackendChoice, MoeLayer};

fn golden_cases(backend: Backend) {
    for path in common::moe_cases() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let lf = layer_file::read(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        let layer =
            MoeLayer::new(lf.spec, lf.weights.clone(), BackendChoice::Use(backend)).unwrap();
        let (out, topk) = layer.run(&lf.x, lf.router_logits.as_deref()).unwrap();
        assert!(
            out.iter().all(|v| v.is_finite()),
            "{name}: non-finite output"
        );

        let want_ids = lf
            .expected
            .topk_ids
            .as_ref()
            .expect("golden case has expected_topk_ids");
        assert_eq!(&topk.ids, want_ids, "{name}: routing ids");
        let want_w = lf
            .expected
            .topk_weights
            .as_ref()
            .expect("golden case has expected_topk_weights");
        let werr = relative_l2(&topk.weights, want_w);
        assert!(
            werr < 1e-6,
            "{name}: routing weights relative error {werr:e}"
        );

        let want = lf
            .expected
            .output
            .as_ref()
            .expect("golden case has expected_output");
        let err = relative_l2(&out, want);
        let tol = match (backend, lf.spec.quant) {
            (Backend::Reference, QuantMode::W4A16) => 1e-5,
            (Backend::Reference, QuantMode::W4A4 { .. }) => 5e-3,
            _ => 1e-2,
        };
        println!("{name} on {backend}: relative error {err:.3e} (tolerance {tol:e})");
        assert!(
            err <= tol,
            "{name} on {backend}: relative error {err:e} > {tol:e}"
        );

        if backend != Backend::Reference {
            let reference = MoeLayer::new(
                lf.spec,
                lf.weights.clone(),
                BackendChoice::Use(Backend::Reference),
            )
            .unwrap();
            let (ref_out, _) = reference.run(&lf.x, lf.router_logits.as_deref()).unwrap();
            let e = relative_l2(&out, &ref_out);
            assert!(
                e <= 1e-2,
                "{name} on {backend}: {e:e} from the reference backend"
            );
        }
    }
}

per_backend!(golden_cases);
