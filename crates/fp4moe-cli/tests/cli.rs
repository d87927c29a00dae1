//! The `fp4moe` binary end to end: successful runs and bad input (clear message naming the
//! file and tensor, non-zero exit, no panic, nothing half-written).

use fp4moe::format::Nvfp4Tensor;
use fp4moe::tensor_io::{read_file, write_tensors, OwnedTensor, TensorReader};
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn golden(name: &str) -> PathBuf {
    let dir = match std::env::var_os("FP4MOE_GOLDEN_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden"),
    };
    let p = dir.join(name);
    assert!(
        p.is_file(),
        "golden file {} missing (set FP4MOE_GOLDEN_DIR)",
        p.display()
    );
    p
}

/// The binary under test: `FP4MOE_BIN` when set (staged test runs on another machine), else
/// the one cargo built.
fn fp4moe(args: &[&str]) -> Output {
    let exe = std::env::var_os("FP4MOE_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_fp4moe")),
        PathBuf::from,
    );
    Command::new(exe).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Fails on a non-zero exit with a message, and on any sign of a panic.
fn expect_error(o: &Output, needles: &[&str]) {
    let t = text(o);
    assert!(!o.status.success(), "expected failure, got success:\n{t}");
    assert_eq!(o.status.code(), Some(1), "exit code:\n{t}");
    assert!(!t.contains("panicked"), "panic:\n{t}");
    for n in needles {
        assert!(t.contains(n), "message lacks `{n}`:\n{t}");
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn run_layer_on_a_golden_case_writes_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let case = golden("moe_relu2_w4a4_sigmoid_bias.safetensors");
    let o = fp4moe(&[
        "run-layer",
        "--file",
        s(&case),
        "--backend",
        "cpu",
        "--output",
        s(&out),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("routing ids: match expected_topk_ids"), "{t}");
    assert!(t.contains("relu2_no_mul (non-gated)"), "{t}");
    let bytes = read_file(&out).unwrap();
    let r = TensorReader::new(&out, &bytes).unwrap();
    let got = r.f32("output", &[5, 64]).unwrap();
    let ids = r.i32("topk_ids", &[5, 2]).unwrap();
    let cb = read_file(&case).unwrap();
    let c = TensorReader::new(&case, &cb).unwrap();
    assert_eq!(ids, c.i32("expected_topk_ids", &[5, 2]).unwrap());
    let want = c.f32("expected_output", &[5, 64]).unwrap();
    assert!(fp4moe::moe::relative_l2(&got, &want) < 1e-2);
    // Refuses to overwrite without --force.
    let o = fp4moe(&["run-layer", "--file", s(&case), "--output", s(&out)]);
    expect_error(&o, &["exists", "--force"]);
}

#[test]
fn run_layer_bad_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.safetensors");
    expect_error(
        &fp4moe(&["run-layer", "--file", s(&missing)]),
        &["nope.safetensors"],
    );

    let good = std::fs::read(golden("moe_silu_w4a16_softmax.safetensors")).unwrap();
    let cut = dir.path().join("truncated.safetensors");
    std::fs::write(&cut, &good[..good.len() - 100]).unwrap();
    expect_error(
        &fp4moe(&["run-layer", "--file", s(&cut)]),
        &["truncated.safetensors", "not a valid safetensors"],
    );

    // Wrong dtype and wrong shape, each naming the tensor.
    let bytes = read_file(&golden("moe_silu_w4a16_softmax.safetensors")).unwrap();
    let path = golden("moe_silu_w4a16_softmax.safetensors");
    let r = TensorReader::new(&path, &bytes).unwrap();
    let mut tensors = r.owned().unwrap();
    let meta = Some(std::collections::HashMap::from([(
        "case".to_string(),
        r.metadata("case").unwrap().to_string(),
    )]));
    let edit = |name: &str,
                f: &dyn Fn(&mut OwnedTensor),
                file: &str,
                tensors: &mut Vec<(String, OwnedTensor)>| {
        let mut t2 = tensors.clone();
        let t = t2.iter_mut().find(|(n, _)| n == name).unwrap();
        f(&mut t.1);
        let p = dir.path().join(file);
        write_tensors(&p, &t2, meta.clone()).unwrap();
        p
    };
    let p = edit(
        "w2_weight_scale_2",
        &|t| {
            t.dtype = Dtype::I32;
        },
        "dtype.safetensors",
        &mut tensors,
    );
    expect_error(
        &fp4moe(&["run-layer", "--file", s(&p)]),
        &["dtype.safetensors", "w2_weight_scale_2", "dtype"],
    );
    let p = edit(
        "x",
        &|t| {
            t.shape = vec![t.shape[0] * 2, t.shape[1] / 2];
        },
        "shape.safetensors",
        &mut tensors,
    );
    expect_error(
        &fp4moe(&["run-layer", "--file", s(&p)]),
        &["shape.safetensors", "`x`", "shape"],
    );
    let p = edit(
        "x",
        &|t| {
            t.data[0..4].copy_from_slice(&f32::NAN.to_le_bytes());
        },
        "nan.safetensors",
        &mut tensors,
    );
    expect_error(
        &fp4moe(&["run-layer", "--file", s(&p)]),
        &["`x`", "non-finite"],
    );
    let p = edit(
        "w13_weight_scale",
        &|t| {
            t.data[5] = 0x7F;
        },
        "nanscale.safetensors",
        &mut tensors,
    );
    expect_error(
        &fp4moe(&["run-layer", "--file", s(&p)]),
        &["w13_weight_scale", "0x7f"],
    );
    // A wrong expectation: reported always, an error only with --check.
    let p = edit(
        "expected_output",
        &|t| {
            t.data[0..4].copy_from_slice(&1000.0f32.to_le_bytes());
        },
        "wrong_expected.safetensors",
        &mut tensors,
    );
    let o = fp4moe(&["run-layer", "--file", s(&p), "--backend", "reference"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("relative L2 error vs expected_output"));
    expect_error(
        &fp4moe(&[
            "run-layer",
            "--file",
            s(&p),
            "--backend",
            "reference",
            "--check",
        ]),
        &["wrong_expected.safetensors", "exceeds 1e-5"],
    );
    let good = golden("moe_silu_w4a16_softmax.safetensors");
    let o = fp4moe(&[
        "run-layer",
        "--file",
        s(&good),
        "--backend",
        "cpu",
        "--check",
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

fn write_input(path: &Path, tensors: Vec<(String, OwnedTensor)>) {
    write_tensors(path, &tensors, None).unwrap();
}

fn matrix(rows: usize, cols: usize, seed: u32) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| {
            half::bf16::from_f32(
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 500.0
                    - 2.0,
            )
            .to_f32()
        })
        .collect()
}

#[test]
fn quantize_tensors_matches_the_library_quantizer() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    let output = dir.path().join("out.safetensors");
    let a = matrix(8, 64, 1);
    let b = matrix(4, 32, 2);
    let a_bf16: Vec<half::bf16> = a.iter().map(|&v| half::bf16::from_f32(v)).collect();
    write_input(
        &input,
        vec![
            (
                "layers.0.up_proj.weight".into(),
                OwnedTensor::bf16(vec![8, 64], &a_bf16),
            ),
            ("layers.0.down".into(), OwnedTensor::f32(vec![4, 32], &b)),
        ],
    );
    let before = std::fs::read(&input).unwrap();
    let o = fp4moe(&[
        "quantize-tensors",
        "--input",
        s(&input),
        "--output",
        s(&output),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read(&input).unwrap(), before, "input modified");
    let bytes = read_file(&output).unwrap();
    let r = TensorReader::new(&output, &bytes).unwrap();
    for (name, data, rows, cols) in [
        ("layers.0.up_proj", &a, 8, 64),
        ("layers.0.down", &b, 4, 32),
    ] {
        let t = Nvfp4Tensor::quantize(name, data, rows, cols).unwrap();
        assert_eq!(
            r.bytes(&format!("{name}.weight"), &[rows, cols / 2], &[Dtype::U8])
                .unwrap(),
            t.packed
        );
        assert_eq!(
            r.bytes(
                &format!("{name}.weight_scale"),
                &[rows, cols / 16],
                &[Dtype::F8_E4M3]
            )
            .unwrap(),
            t.scales
        );
        assert_eq!(
            r.shape(&format!("{name}.weight_scale_2")).unwrap(),
            Vec::<usize>::new()
        );
        assert_eq!(
            r.scalar_f32(&format!("{name}.weight_scale_2")).unwrap(),
            t.scale_2
        );
    }
}

#[test]
fn quantize_tensors_bad_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out.safetensors");
    // A 1-D tensor is named in the error and nothing is written.
    let input = dir.path().join("bias.safetensors");
    write_input(
        &input,
        vec![
            ("w".into(), OwnedTensor::f32(vec![2, 16], &matrix(2, 16, 3))),
            ("b".into(), OwnedTensor::f32(vec![16], &matrix(1, 16, 4))),
        ],
    );
    expect_error(
        &fp4moe(&[
            "quantize-tensors",
            "--input",
            s(&input),
            "--output",
            s(&output),
        ]),
        &["`b`", "bias.safetensors"],
    );
    assert!(!output.exists());
    // NaN: tensor and index named.
    let mut m = matrix(2, 32, 5);
    m[40] = f32::NAN;
    let input = dir.path().join("nan.safetensors");
    write_input(
        &input,
        vec![("w".into(), OwnedTensor::f32(vec![2, 32], &m))],
    );
    expect_error(
        &fp4moe(&[
            "quantize-tensors",
            "--input",
            s(&input),
            "--output",
            s(&output),
        ]),
        &["`w`", "[1, 8]", "non-finite"],
    );
    // Columns not a multiple of 16.
    let input = dir.path().join("cols.safetensors");
    write_input(
        &input,
        vec![("w".into(), OwnedTensor::f32(vec![2, 24], &matrix(2, 24, 6)))],
    );
    expect_error(
        &fp4moe(&[
            "quantize-tensors",
            "--input",
            s(&input),
            "--output",
            s(&output),
        ]),
        &["`w`", "multiple of 16"],
    );
    assert!(!output.exists());
    // The input itself as output.
    expect_error(
        &fp4moe(&[
            "quantize-tensors",
            "--input",
            s(&input),
            "--output",
            s(&input),
        ]),
        &["is the input file"],
    );
    // Missing input.
    expect_error(
        &fp4moe(&[
            "quantize-tensors",
            "--input",
            "/nonexistent/x.safetensors",
            "--output",
            s(&output),
        ]),
        &["/nonexistent/x.safetensors"],
    );
}

#[test]
fn demo_rejects_bad_arguments() {
    let o = fp4moe(&["demo", "--tokens", "0"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--tokens"));
    let o = fp4moe(&["demo", "--preset", "llama"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("nemotron3-nano"));
}

#[test]
fn bench_rejects_bad_arguments() {
    let o = fp4moe(&["bench", "--tokens", "0", "--backend", "cpu"]);
    expect_error(&o, &["--tokens"]);
    // Stage times come from CUDA graphs; on the CPU backend the flag is an error, not ignored.
    let o = fp4moe(&["bench", "--tokens", "1", "--backend", "cpu", "--stages"]);
    expect_error(&o, &["--stages", "cuda"]);
    for flag in ["--warmup-ms", "--settle-ms", "--min-time-ms"] {
        for bad in ["-1", "nan", "inf"] {
            let arg = format!("{flag}={bad}");
            let o = fp4moe(&["bench", "--tokens", "1", "--backend", "cpu", &arg]);
            expect_error(&o, &[flag]);
        }
    }
    let o = fp4moe(&[
        "bench",
        "--tokens",
        "1",
        "--backend",
        "cpu",
        "--inputs",
        "0",
    ]);
    expect_error(&o, &["--inputs"]);
}

/// `bench` on the CPU backend: the memory floor from this host's copy bandwidth, no compute
/// floor (DESIGN 5's is the H200's), time/floor against memory, a plot that draws it. The
/// heaviest CPU-only test (~5 s in release): `bench` has only the real models' shapes, and
/// Qwen3-30B-A3B's is the smaller one to quantize.
#[test]
fn bench_on_the_cpu_reports_the_host_memory_floor() {
    let dir = tempfile::tempdir().unwrap();
    let (json, svg) = (dir.path().join("b.json"), dir.path().join("b.svg"));
    let o = fp4moe(&[
        "bench",
        "--backend",
        "cpu",
        "--preset",
        "qwen3-30b-a3b",
        "--tokens",
        "1,2",
        "--iterations",
        "1",
        "--inputs",
        "1",
        "--json",
        s(&json),
        "--plot",
        s(&svg),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(doc["bf16_tflops"].is_null(), "{doc}");
    // The GPU warm-up does not apply to host backends.
    assert!(doc["warmup_ms"].is_null(), "{doc}");
    assert!(
        doc["settle_ms"].is_null() && doc["min_time_ms"].is_null(),
        "{doc}"
    );
    assert_eq!(doc["inputs"], 1, "{doc}");
    assert!(doc["copy_bandwidth_gbs"].as_f64().unwrap() > 0.0, "{doc}");
    let rows = doc["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        let mem = r["memory_floor_us"].as_f64().unwrap();
        let median = r["median_us"].as_f64().unwrap();
        assert!(mem > 0.0 && median >= r["min_us"].as_f64().unwrap(), "{r}");
        assert!(r["compute_floor_us"].is_null(), "{r}");
        let ratio = r["time_over_floor"].as_f64().unwrap();
        assert!((ratio - median / mem).abs() <= 1e-9 * ratio, "{r}");
    }
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(picture.matches("<polyline").count(), 1, "{picture}");
}

#[test]
fn inspect_and_run_a_checkpoint() {
    use fp4moe::checkpoint::{write_checkpoint, Checkpoint, Family, ModelConfig, WriteOptions};
    use fp4moe::spec::{Activation, QuantMode, Scoring};
    let dir = tempfile::tempdir().unwrap();
    let ck_dir = dir.path().join("ck");
    let cfg = ModelConfig {
        family: Family::Qwen3Moe,
        model_type: "qwen3_moe".into(),
        hidden: 64,
        intermediate: 32,
        experts: 4,
        top_k: 2,
        layers: 2,
        renormalize: true,
        routed_scaling_factor: 1.0,
        n_group: 1,
        topk_group: 1,
        scoring: Scoring::Softmax,
        activation: Activation::Silu,
        shared_intermediate: None,
    };
    let spec = Checkpoint::spec_for(&cfg, QuantMode::W4A16);
    let w = fp4moe::synthetic::random_weights(&spec, 5).unwrap();
    let opts = WriteOptions {
        quant_algo: "W4A16_NVFP4".into(),
        shard_bytes: None,
    };
    write_checkpoint(&ck_dir, &cfg, &[(1, w)], &opts).unwrap();

    let o = fp4moe(&["inspect", s(&ck_dir)]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("qwen3_moe") && t.contains("MoE layers [1]") && t.contains("W4A16Nvfp4"),
        "{t}"
    );
    let o = fp4moe(&["inspect", s(&ck_dir), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["moe_layers"], serde_json::json!([1]));
    assert_eq!(
        v["layer_stats"][0]["shard_scale_2_mismatches"],
        serde_json::json!(4)
    );

    let input = dir.path().join("x.safetensors");
    let x = fp4moe::synthetic::random_tokens(3, 64, 6);
    write_tensors(
        &input,
        &[("x".to_string(), OwnedTensor::f32(vec![3, 64], &x))],
        None,
    )
    .unwrap();
    let out = dir.path().join("y.safetensors");
    let o = fp4moe(&[
        "run",
        "--checkpoint",
        s(&ck_dir),
        "--layer",
        "1",
        "--input",
        s(&input),
        "--output",
        s(&out),
        "--backend",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let bytes = read_file(&out).unwrap();
    let r = TensorReader::new(&out, &bytes).unwrap();
    assert!(r.f32("output", &[3, 64]).unwrap().iter().any(|v| *v != 0.0));
    expect_error(
        &fp4moe(&[
            "run",
            "--checkpoint",
            s(&ck_dir),
            "--layer",
            "0",
            "--input",
            s(&input),
            "--output",
            s(&dir.path().join("z.safetensors")),
        ]),
        &["layer 0 is not an NVFP4 MoE layer"],
    );
    expect_error(&fp4moe(&["inspect", s(dir.path())]), &["config.json"]);
}

#[test]
fn quantize_a_bf16_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("bf16");
    std::fs::create_dir_all(&src).unwrap();
    let cfg = serde_json::json!({"model_type": "nemotron_h", "hidden_size": 32, "moe_intermediate_size": 16,
        "n_routed_experts": 2, "num_experts_per_tok": 1, "num_hidden_layers": 1, "mlp_hidden_act": "relu2"});
    std::fs::write(src.join("config.json"), cfg.to_string()).unwrap();
    let bf = |rows: usize, cols: usize, seed: u32| {
        let v: Vec<half::bf16> = matrix(rows, cols, seed)
            .iter()
            .map(|&x| half::bf16::from_f32(x))
            .collect();
        OwnedTensor::bf16(vec![rows, cols], &v)
    };
    let mut t = vec![(
        "backbone.layers.0.mixer.gate.weight".to_string(),
        bf(2, 32, 1),
    )];
    for e in 0..2u32 {
        t.push((
            format!("backbone.layers.0.mixer.experts.{e}.up_proj.weight"),
            bf(16, 32, 10 + e),
        ));
        t.push((
            format!("backbone.layers.0.mixer.experts.{e}.down_proj.weight"),
            bf(32, 16, 20 + e),
        ));
    }
    write_tensors(&src.join("model.safetensors"), &t, None).unwrap();
    let calib = dir.path().join("calib.safetensors");
    write_tensors(
        &calib,
        &[(
            "x".to_string(),
            OwnedTensor::f32(vec![4, 32], &matrix(4, 32, 7)),
        )],
        None,
    )
    .unwrap();
    let out = dir.path().join("nvfp4");
    let o = fp4moe(&[
        "quantize",
        "--input",
        s(&src),
        "--output",
        s(&out),
        "--calib",
        s(&calib),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("quant_algo NVFP4"), "{}", text(&o));
    let o = fp4moe(&["inspect", s(&out)]);
    assert!(
        o.status.success() && text(&o).contains("nemotron_h"),
        "{}",
        text(&o)
    );
    expect_error(
        &fp4moe(&["quantize", "--input", s(&src), "--output", s(&out)]),
        &["exists", "--force"],
    );
    let o = fp4moe(&[
        "quantize",
        "--input",
        s(&src),
        "--output",
        s(&out),
        "--force",
    ]);
    assert!(
        o.status.success() && text(&o).contains("W4A16_NVFP4"),
        "{}",
        text(&o)
    );
}
