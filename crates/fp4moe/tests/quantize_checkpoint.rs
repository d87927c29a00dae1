//! `quantize_checkpoint`: a bf16 checkpoint (written here) → NVFP4, bit-exact per tensor with
//! the library quantizer, other tensors copied, calibration giving input scales, and the result
//! loadable and runnable.

use fp4moe::checkpoint::{quantize_checkpoint, Checkpoint, QuantAlgo, QuantizeOptions};
use fp4moe::format::Nvfp4Tensor;
use fp4moe::spec::QuantMode;
use fp4moe::synthetic::random_tokens;
use fp4moe::tensor_io::{write_atomic, write_tensors, OwnedTensor};
use fp4moe::{BackendChoice, MoeLayer};
use half::bf16;
use std::path::{Path, PathBuf};

const H: usize = 64;
const I: usize = 32;
const E: usize = 4;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fp4moe-q-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn bf16_matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    random_tokens(rows, cols, seed)
        .iter()
        .map(|v| bf16::from_f32(v * 0.05).to_f32())
        .collect()
}

fn bf16_tensor(v: &[f32], rows: usize, cols: usize) -> OwnedTensor {
    let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    OwnedTensor::bf16(vec![rows, cols], &b)
}

/// A two-layer Qwen3-MoE-shaped bf16 checkpoint; layer 1 is MoE. Returns the expert weights.
fn write_bf16(dir: &Path, sharded: bool) -> Vec<(String, Vec<f32>, usize, usize)> {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = serde_json::json!({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": H,
        "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": 2, "norm_topk_prob": true});
    write_atomic(&dir.join("config.json"), cfg.to_string().as_bytes()).unwrap();
    let mut experts = Vec::new();
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        bf16_tensor(&bf16_matrix(10, H, 1), 10, H),
    )];
    t.push((
        "model.layers.1.mlp.gate.weight".into(),
        bf16_tensor(&bf16_matrix(E, H, 2), E, H),
    ));
    for e in 0..E {
        for (k, (p, rows, cols)) in [("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)]
            .into_iter()
            .enumerate()
        {
            let name = format!("model.layers.1.mlp.experts.{e}.{p}");
            let w = bf16_matrix(rows, cols, 100 + 10 * e as u64 + k as u64);
            t.push((format!("{name}.weight"), bf16_tensor(&w, rows, cols)));
            experts.push((name, w, rows, cols));
        }
    }
    if sharded {
        let (a, b) = t.split_at(t.len() / 2);
        write_tensors(&dir.join("model-00001-of-00002.safetensors"), a, None).unwrap();
        write_tensors(&dir.join("model-00002-of-00002.safetensors"), b, None).unwrap();
        let mut map = serde_json::Map::new();
        for (n, _) in a {
            map.insert(n.clone(), "model-00001-of-00002.safetensors".into());
        }
        for (n, _) in b {
            map.insert(n.clone(), "model-00002-of-00002.safetensors".into());
        }
        let idx = serde_json::json!({"metadata": {}, "weight_map": map});
        write_atomic(
            &dir.join("model.safetensors.index.json"),
            idx.to_string().as_bytes(),
        )
        .unwrap();
    } else {
        write_tensors(&dir.join("model.safetensors"), &t, None).unwrap();
    }
    experts
}

#[test]
fn quantize_weight_only_and_calibrated() {
    for sharded in [false, true] {
        let src = tmp(&format!("src-{sharded}"));
        let experts = write_bf16(&src, sharded);
        let before = std::fs::read(src.join("config.json")).unwrap();

        // Weight-only.
        let out = tmp(&format!("w4a16-{sharded}"));
        let mut log = Vec::new();
        let r = quantize_checkpoint(
            &src,
            &out,
            &QuantizeOptions {
                shared: true,
                ..Default::default()
            },
            &mut |m| log.push(m.to_string()),
        )
        .unwrap();
        assert_eq!(
            (r.quant_algo.as_str(), r.moe_layers.clone()),
            ("W4A16_NVFP4", vec![1])
        );
        assert_eq!((r.tensors_quantized, r.tensors_copied), (3 * E, 2));
        let ck = Checkpoint::open(&out).unwrap();
        assert_eq!(ck.quant.algo, QuantAlgo::W4A16Nvfp4);
        assert!(ck
            .quant
            .exclude_modules
            .contains(&"model.layers.1.mlp.gate".to_string()));
        for (name, w, rows, cols) in &experts {
            let q = Nvfp4Tensor::quantize(name, w, *rows, *cols).unwrap();
            let t = ck.files.tensor(&format!("{name}.weight")).unwrap();
            assert_eq!(t.data, &q.packed[..], "{name}");
            assert_eq!(
                ck.files
                    .tensor(&format!("{name}.weight_scale"))
                    .unwrap()
                    .data,
                &q.scales[..]
            );
            assert_eq!(
                ck.files
                    .tensor(&format!("{name}.weight_scale_2"))
                    .unwrap()
                    .scalar()
                    .unwrap(),
                q.scale_2
            );
        }
        let emb = ck.files.tensor("model.embed_tokens.weight").unwrap();
        assert_eq!(
            (emb.dtype, emb.shape.clone()),
            (safetensors::tensor::Dtype::BF16, vec![10, H])
        );
        let (spec, w) = ck.load_layer(1, None).unwrap();
        assert_eq!(spec.quant, QuantMode::W4A16);
        MoeLayer::new(spec, w, BackendChoice::Auto)
            .unwrap()
            .run(&random_tokens(3, H, 5), None)
            .unwrap();

        // Calibrated: NVFP4 with input scales; refuses to overwrite without force.
        let calib = random_tokens(2, H, 9);
        let opts = QuantizeOptions {
            shared: true,
            calib: Some(calib),
            force: false,
        };
        let e = quantize_checkpoint(&src, &out, &opts, &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("--force"), "{e}");
        let out2 = tmp(&format!("w4a4-{sharded}"));
        let r = quantize_checkpoint(&src, &out2, &opts, &mut |_| {}).unwrap();
        assert_eq!(r.quant_algo, "NVFP4");
        // Two tokens, top-2 of 4 experts: at most 4 slots, so at least... report the ones missed.
        let ck = Checkpoint::open(&out2).unwrap();
        let (spec, w) = ck.load_layer(1, None).unwrap();
        assert!(matches!(spec.quant, QuantMode::W4A4 { .. }));
        let s13 = w.w13_input_scale.clone().unwrap();
        assert!(s13.iter().all(|v| v.is_finite() && *v > 0.0));
        for (l, missing) in &r.uncalibrated {
            assert_eq!(*l, 1);
            let max = s13.iter().fold(0.0f32, |m, v| m.max(*v));
            for &e in missing {
                assert_eq!(
                    s13[e], max,
                    "uncalibrated expert {e} takes the layer maximum"
                );
            }
        }
        MoeLayer::new(spec, w, BackendChoice::Auto)
            .unwrap()
            .run(&random_tokens(3, H, 6), None)
            .unwrap();
        assert_eq!(
            std::fs::read(src.join("config.json")).unwrap(),
            before,
            "input modified"
        );
        for d in [src, out, out2] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}
