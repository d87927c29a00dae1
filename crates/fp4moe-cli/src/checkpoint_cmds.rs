//! `fp4moe run` and `fp4moe inspect` on ModelOpt checkpoint directories.

use crate::progress::step;
use crate::BackendArg;
use anyhow::{bail, Context, Result};
use fp4moe::checkpoint::{Checkpoint, LayerStats};
use fp4moe::spec::{Intermediate, QuantMode};
use fp4moe::tensor_io::{read_file, TensorReader};
use fp4moe::{layer_file, MoeLayer};
use std::path::Path;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum RunMode {
    W4a16,
    W4a4,
}

pub(crate) fn run(
    dir: &Path,
    layer: usize,
    input: &Path,
    output: &Path,
    backend: BackendArg,
    mode: Option<RunMode>,
    force: bool,
) -> Result<()> {
    crate::check_output(Some(input), output, force)?;
    let ck = Checkpoint::open(dir)?;
    let mode = mode.map(|m| match m {
        RunMode::W4a16 => QuantMode::W4A16,
        RunMode::W4a4 => QuantMode::W4A4 {
            intermediate: Intermediate::Static,
        },
    });
    let (spec, weights) = step(&format!("loading layer {layer}"), || {
        ck.load_layer(layer, mode)
    })?;
    let bytes = read_file(input)?;
    let r = TensorReader::new(input, &bytes)?;
    let (x, shape) = r.f32_any("x")?;
    if shape.len() != 2 || shape[1] != spec.shape.hidden {
        bail!(
            "{}: tensor `x`: expected shape [T, {}], got {:?}",
            input.display(),
            spec.shape.hidden,
            shape
        );
    }
    let moe = MoeLayer::new(spec, weights, backend.choice())
        .with_context(|| format!("{}: layer {layer}", dir.display()))?;
    let t0 = std::time::Instant::now();
    let (out, topk) = moe
        .run(&x, None)
        .with_context(|| format!("{}: running layer {layer}", input.display()))?;
    println!(
        "{} layer {layer}: {} tokens, {} ({}), {} on {} in {:.3} ms",
        ck.config.family.name(),
        shape[0],
        spec.activation,
        if spec.activation.is_gated() {
            "gated"
        } else {
            "non-gated"
        },
        spec.quant,
        moe.backend(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    layer_file::write_outputs(output, &out, &topk, spec.shape.hidden)?;
    println!("wrote {}", output.display());
    Ok(())
}

pub(crate) fn quantize(
    input: &Path,
    output: &Path,
    calib: Option<&Path>,
    no_shared: bool,
    force: bool,
) -> Result<()> {
    let calib = match calib {
        Some(p) => {
            let bytes = read_file(p)?;
            let r = TensorReader::new(p, &bytes)?;
            Some(r.f32_any("x")?.0)
        }
        None => None,
    };
    let opts = fp4moe::checkpoint::QuantizeOptions {
        shared: !no_shared,
        calib,
        force,
    };
    let pb = indicatif::ProgressBar::new_spinner();
    pb.enable_steady_tick(std::time::Duration::from_millis(100));
    let report = fp4moe::checkpoint::quantize_checkpoint(input, output, &opts, &mut |m| {
        pb.set_message(m.to_string())
    });
    pb.finish_and_clear();
    let r = report.with_context(|| format!("quantizing {}", input.display()))?;
    println!(
        "{} ({}): MoE layers {:?}, {} projections quantized, {} tensors copied, quant_algo {}",
        output.display(),
        r.family,
        r.moe_layers,
        r.tensors_quantized,
        r.tensors_copied,
        r.quant_algo
    );
    for (l, experts) in &r.uncalibrated {
        println!("layer {l}: no calibration token reached experts {experts:?}; they got the layer's maximum input scale");
    }
    Ok(())
}

fn pct(n: usize, d: usize) -> f64 {
    100.0 * n as f64 / d.max(1) as f64
}

pub(crate) fn inspect(dir: &Path, json: bool) -> Result<()> {
    let ck = Checkpoint::open(dir)?;
    let c = &ck.config;
    let stats: Vec<LayerStats> = step("reading MoE layers", || {
        ck.moe_layers
            .iter()
            .map(|&l| ck.layer_stats(l))
            .collect::<fp4moe::Result<_>>()
    })?;
    let algo = format!("{:?}", ck.quant.algo);
    if json {
        let doc = serde_json::json!({
            "dir": dir.display().to_string(), "family": c.family.name(), "model_type": c.model_type,
            "layers": c.layers, "moe_layers": ck.moe_layers, "hidden": c.hidden, "intermediate": c.intermediate,
            "experts": c.experts, "top_k": c.top_k, "activation": c.activation.name(), "gated": c.activation.is_gated(),
            "scoring": format!("{:?}", c.scoring), "renormalize": c.renormalize, "routed_scaling_factor": c.routed_scaling_factor,
            "n_group": c.n_group, "topk_group": c.topk_group, "shared_intermediate": c.shared_intermediate,
            "quant_algo": algo, "group_size": ck.quant.group_size, "exclude_modules": ck.quant.exclude_modules,
            "shards": ck.files.shard_paths().len(), "layer_stats": stats,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!("{}", dir.display());
    println!(
        "  family {} ({}), {} layers, MoE layers {:?}",
        c.family.name(),
        c.model_type,
        c.layers,
        ck.moe_layers
    );
    println!(
        "  experts {} x (H {}, I {}), top-{}, activation {} ({}), {:?} routing{}, rsf {}, groups {}/{}{}",
        c.experts,
        c.hidden,
        c.intermediate,
        c.top_k,
        c.activation,
        if c.activation.is_gated() { "gated" } else { "non-gated" },
        c.scoring,
        if c.renormalize { ", renormalized" } else { "" },
        c.routed_scaling_factor,
        c.n_group,
        c.topk_group,
        c.shared_intermediate.map(|w| format!(", shared expert {w}")).unwrap_or_default()
    );
    println!(
        "  quant_algo {algo}, group_size {}, {} shard file(s), exclude_modules {:?}",
        ck.quant.group_size,
        ck.files.shard_paths().len(),
        ck.quant.exclude_modules
    );
    println!("\n  layer  scale bytes   zero%  subnormal%  at 2^-9 %   scale_2 range           gate/up scale_2 mismatches  missing/bad input scales");
    for s in &stats {
        println!(
            "  {:>5} {:>12} {:>7.3} {:>11.3} {:>10.3}   [{:.3e}, {:.3e}]   {:>26}  {}",
            s.layer,
            s.scale_bytes,
            pct(s.zero, s.scale_bytes),
            pct(s.subnormal, s.scale_bytes),
            pct(s.at_floor, s.scale_bytes),
            s.scale_2_min,
            s.scale_2_max,
            s.shard_scale_2_mismatches,
            if s.missing_or_bad_input_scales.is_empty() {
                "none".to_string()
            } else {
                format!(
                    "{} (first: {})",
                    s.missing_or_bad_input_scales.len(),
                    s.missing_or_bad_input_scales[0]
                )
            }
        );
    }
    Ok(())
}
