//! ModelOpt checkpoints: written from synthetic layers (both families, sharded and not), read
//! back bit-identically, run against the reference backend, and bad checkpoints giving clear
//! errors.

use fp4moe::calibration::calibrate_with_router;
use fp4moe::checkpoint::{write_checkpoint, Checkpoint, Family, ModelConfig, WriteOptions};
use fp4moe::moe::relative_l2;
use fp4moe::spec::{Activation, Intermediate, QuantMode, Scoring};
use fp4moe::synthetic::{random_tokens, random_weights};
use fp4moe::tensor_io::{read_file, write_tensors, OwnedTensor, TensorReader};
use fp4moe::weights::MoeWeights;
use fp4moe::{Backend, BackendChoice, MoeLayer};
use std::path::{Path, PathBuf};

fn nemotron() -> ModelConfig {
    ModelConfig {
        family: Family::NemotronH,
        model_type: "nemotron_h".into(),
        hidden: 64,
        intermediate: 48,
        experts: 8,
        top_k: 2,
        layers: 3,
        renormalize: true,
        routed_scaling_factor: 2.5,
        n_group: 1,
        topk_group: 1,
        scoring: Scoring::Sigmoid,
        activation: Activation::Relu2NoMul,
        shared_intermediate: Some(32),
    }
}

fn qwen() -> ModelConfig {
    ModelConfig {
        family: Family::Qwen3Moe,
        model_type: "qwen3_moe".into(),
        hidden: 64,
        intermediate: 32,
        experts: 6,
        top_k: 2,
        layers: 2,
        renormalize: true,
        routed_scaling_factor: 1.0,
        n_group: 1,
        topk_group: 1,
        scoring: Scoring::Softmax,
        activation: Activation::Silu,
        shared_intermediate: None,
    }
}

fn deepseek() -> ModelConfig {
    ModelConfig {
        family: Family::DeepseekV3,
        model_type: "deepseek_v3".into(),
        hidden: 64,
        intermediate: 32,
        experts: 8,
        top_k: 2,
        layers: 2,
        renormalize: true,
        routed_scaling_factor: 2.5,
        n_group: 4,
        topk_group: 2,
        scoring: Scoring::Sigmoid,
        activation: Activation::Silu,
        shared_intermediate: Some(32),
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fp4moe-ck-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Synthetic W4A4 weights for `cfg` (calibrated input scales), written as layer `layer`.
fn make(
    cfg: &ModelConfig,
    layer: usize,
    dir: &Path,
    shard_bytes: Option<usize>,
    seed: u64,
) -> MoeWeights {
    let stub = Checkpoint::spec_for(cfg, QuantMode::W4A16);
    let mut w = random_weights(&stub, seed).unwrap();
    let x = random_tokens(16, cfg.hidden, seed + 1);
    calibrate_with_router(&stub, &mut w, &x).unwrap();
    let opts = WriteOptions {
        quant_algo: "NVFP4".into(),
        shard_bytes,
    };
    write_checkpoint(dir, cfg, &[(layer, w.clone())], &opts).unwrap();
    w
}

#[test]
fn round_trip_and_run_both_families() {
    for (cfg, layer, shard) in [
        (nemotron(), 1, None),
        (qwen(), 0, Some(20_000)),
        (deepseek(), 1, Some(30_000)),
    ] {
        let dir = tmp(cfg.family.name());
        let w = make(&cfg, layer, &dir, shard, 7);
        let ck = Checkpoint::open(&dir).unwrap();
        assert_eq!(ck.config, cfg);
        assert_eq!(ck.moe_layers, vec![layer]);
        if shard.is_some() {
            assert!(ck.files.shard_paths().len() > 1, "expected several shards");
        }
        let mode = QuantMode::W4A4 {
            intermediate: Intermediate::Static,
        };
        let (spec, loaded) = ck.load_layer(layer, None).unwrap();
        assert_eq!(spec.quant, mode);
        // Bit-identical: packed codes, block scales, per-shard scale_2, input scales, router.
        assert_eq!(loaded.w13, w.w13);
        assert_eq!(loaded.w2, w.w2);
        assert_eq!(loaded.w13_input_scale, w.w13_input_scale);
        assert_eq!(loaded.w2_input_scale, w.w2_input_scale);
        assert_eq!(loaded.router, w.router);
        assert_eq!(loaded.e_score_correction_bias, w.e_score_correction_bias);
        assert_eq!(loaded.shared, w.shared);
        // Running the loaded layer matches the reference backend on the original weights.
        let x = random_tokens(5, cfg.hidden, 99);
        let got = MoeLayer::new(spec, loaded, BackendChoice::Use(Backend::Cpu))
            .unwrap()
            .run(&x, None)
            .unwrap()
            .0;
        let want = MoeLayer::new(spec, w, BackendChoice::Use(Backend::Reference))
            .unwrap()
            .run(&x, None)
            .unwrap()
            .0;
        let err = relative_l2(&got, &want);
        assert!(err < 1e-2, "{}: {err}", cfg.family.name());
        let stats = ck.layer_stats(layer).unwrap();
        assert!(stats.scale_bytes > 0 && stats.missing_or_bad_input_scales.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Rewrites `file` of `dir` through `edit` on its tensor list.
fn rewrite(dir: &Path, file: &str, edit: impl Fn(&mut Vec<(String, OwnedTensor)>)) {
    let path = dir.join(file);
    let bytes = read_file(&path).unwrap();
    let r = TensorReader::new(&path, &bytes).unwrap();
    let mut t = r.owned().unwrap();
    edit(&mut t);
    std::fs::remove_file(&path).unwrap();
    write_tensors(&path, &t, None).unwrap();
}

fn open_err(dir: &Path) -> String {
    match Checkpoint::open(dir) {
        Ok(ck) => ck
            .load_layer(1, None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_checkpoints_give_clear_errors() {
    let cfg = nemotron();
    let base = tmp("bad-base");
    make(&cfg, 1, &base, None, 3);
    let fresh = |name: &str| {
        let d = tmp(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in std::fs::read_dir(&base).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, d.join(f.file_name().unwrap())).unwrap();
        }
        d
    };
    // Truncated shard.
    let d = fresh("truncated");
    let p = d.join("model.safetensors");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - 50]).unwrap();
    let e = open_err(&d);
    assert!(
        e.contains("model.safetensors") && e.contains("not a valid safetensors"),
        "{e}"
    );
    // Missing tensor.
    let d = fresh("missing");
    rewrite(&d, "model.safetensors", |t| {
        t.retain(|(n, _)| n != "backbone.layers.1.mixer.experts.3.down_proj.weight")
    });
    let e = open_err(&d);
    assert!(
        e.contains("experts.3.down_proj.weight") && e.contains("missing"),
        "{e}"
    );
    // Wrong dtype and wrong shape.
    let d = fresh("dtype");
    rewrite(&d, "model.safetensors", |t| {
        for (n, v) in t.iter_mut() {
            if n == "backbone.layers.1.mixer.experts.0.up_proj.weight_scale_2" {
                v.dtype = Dtype::I32;
            }
        }
    });
    let e = open_err(&d);
    assert!(
        e.contains("experts.0.up_proj.weight_scale_2") && e.contains("dtype"),
        "{e}"
    );
    let d = fresh("shape");
    rewrite(&d, "model.safetensors", |t| {
        for (n, v) in t.iter_mut() {
            if n == "backbone.layers.1.mixer.experts.2.up_proj.weight" {
                v.shape = vec![v.shape[0] / 2, v.shape[1] * 2];
            }
        }
    });
    let e = open_err(&d);
    assert!(
        e.contains("experts.2.up_proj.weight") && e.contains("shape"),
        "{e}"
    );
    // NaN block scale byte.
    let d = fresh("nanscale");
    rewrite(&d, "model.safetensors", |t| {
        for (n, v) in t.iter_mut() {
            if n == "backbone.layers.1.mixer.experts.5.down_proj.weight_scale" {
                v.data[3] = 0x7F;
            }
        }
    });
    let e = open_err(&d);
    assert!(
        e.contains("experts.5.down_proj.weight_scale") && e.contains("NaN"),
        "{e}"
    );
    // Zero and missing input scales: errors naming the expert in W4A4, fine as W4A16.
    for (name, value) in [
        ("zero-input", Some(0.0f32)),
        ("negative-input", Some(-1.0)),
        ("nan-input", Some(f32::NAN)),
        ("missing-input", None),
    ] {
        let d = fresh(name);
        rewrite(&d, "model.safetensors", |t| {
            let target = "backbone.layers.1.mixer.experts.4.up_proj.input_scale";
            match value {
                Some(x) => {
                    for (n, v) in t.iter_mut() {
                        if n == target {
                            v.data = x.to_le_bytes().to_vec();
                        }
                    }
                }
                None => t.retain(|(n, _)| n != target),
            }
        });
        let e = open_err(&d);
        assert!(
            e.contains("expert 4") && e.contains("input_scale") && e.contains("--mode w4a16"),
            "{e}"
        );
        let ck = Checkpoint::open(&d).unwrap();
        ck.load_layer(1, Some(QuantMode::W4A16)).unwrap();
    }
    // A layer that is not MoE, and a config without MoE fields.
    let ck = Checkpoint::open(&base).unwrap();
    let e = ck.load_layer(0, None).unwrap_err().to_string();
    assert!(
        e.contains("layer 0 is not an NVFP4 MoE layer") && e.contains("[1]"),
        "{e}"
    );
    let d = fresh("nomoe");
    std::fs::write(
        d.join("config.json"),
        r#"{"model_type": "nemotron_h", "hidden_size": 64, "num_hidden_layers": 3}"#,
    )
    .unwrap();
    let e = open_err(&d);
    assert!(
        e.contains("config.json") && e.contains("moe_intermediate_size"),
        "{e}"
    );
    // An index naming a shard that does not exist.
    let d = tmp("index");
    make(&qwen(), 0, &d, Some(20_000), 4);
    let victim = std::fs::read_dir(&d)
        .unwrap()
        .map(|f| f.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("model-00002")
        })
        .unwrap();
    std::fs::remove_file(&victim).unwrap();
    let e = Checkpoint::open(&d).err().unwrap().to_string();
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains("model-00002")
            && e.contains("does not exist"),
        "{e}"
    );
    // A header that lies about offsets: a tensor's data_offsets point past the data.
    let d = fresh("lying-header");
    let p = d.join("model.safetensors");
    let b = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&header).unwrap();
    let off = &mut v["backbone.layers.1.mixer.experts.0.up_proj.weight"]["data_offsets"];
    let end = off[1].as_u64().unwrap();
    off[1] = serde_json::json!(end + 1_000_000);
    let mut h = serde_json::to_string(&v).unwrap().into_bytes();
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut lied = (h.len() as u64).to_le_bytes().to_vec();
    lied.extend_from_slice(&h);
    lied.extend_from_slice(&b[8 + n..]);
    std::fs::write(&p, lied).unwrap();
    let e = open_err(&d);
    assert!(
        e.contains("model.safetensors") && e.contains("not a valid safetensors"),
        "{e}"
    );
    // Writing over an existing checkpoint is refused.
    let e = write_checkpoint(
        &base,
        &cfg,
        &[],
        &WriteOptions {
            quant_algo: "NVFP4".into(),
            shard_bytes: None,
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("refusing to overwrite"), "{e}");
}

use safetensors::tensor::Dtype;
