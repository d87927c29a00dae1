//! Writes a small synthetic ModelOpt NVFP4 checkpoint (random bf16 weights quantized with the
//! ModelOpt recipe, input scales calibrated on random tokens) to try `fp4moe inspect` and
//! `fp4moe run` without downloading a model.
//!
//! usage: cargo run --release --example synthetic_checkpoint -- OUT_DIR [nemotron|qwen]

use fp4moe::calibration::calibrate_with_router;
use fp4moe::checkpoint::{write_checkpoint, Checkpoint, Family, ModelConfig, WriteOptions};
use fp4moe::spec::{Activation, QuantMode, Scoring};
use fp4moe::synthetic::{random_tokens, random_weights};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .ok_or("usage: synthetic_checkpoint OUT_DIR [nemotron|qwen]")?;
    let nemotron = args.next().as_deref() != Some("qwen");
    let cfg = ModelConfig {
        family: if nemotron {
            Family::NemotronH
        } else {
            Family::Qwen3Moe
        },
        model_type: if nemotron { "nemotron_h" } else { "qwen3_moe" }.into(),
        hidden: 256,
        intermediate: 128,
        experts: 16,
        top_k: if nemotron { 6 } else { 8 },
        layers: 4,
        renormalize: true,
        routed_scaling_factor: if nemotron { 2.5 } else { 1.0 },
        n_group: 1,
        topk_group: 1,
        scoring: if nemotron {
            Scoring::Sigmoid
        } else {
            Scoring::Softmax
        },
        activation: if nemotron {
            Activation::Relu2NoMul
        } else {
            Activation::Silu
        },
        shared_intermediate: nemotron.then_some(64),
    };
    let spec = Checkpoint::spec_for(&cfg, QuantMode::W4A16);
    let mut layers = Vec::new();
    for (n, layer) in [1usize, 3].into_iter().enumerate() {
        let mut w = random_weights(&spec, 10 + n as u64)?;
        let x = random_tokens(64, cfg.hidden, 20 + n as u64);
        calibrate_with_router(&spec, &mut w, &x)?;
        layers.push((layer, w));
    }
    let opts = WriteOptions {
        quant_algo: "NVFP4".into(),
        shard_bytes: Some(1 << 20),
    };
    write_checkpoint(std::path::Path::new(&out), &cfg, &layers, &opts)?;
    println!("wrote {out}");
    Ok(())
}
