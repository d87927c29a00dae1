//! `fp4moe quantize`: a bf16 Hugging Face checkpoint → a ModelOpt-layout NVFP4 checkpoint.
//!
//! Every routed expert projection (and, unless disabled, every shared-expert projection) of
//! every MoE layer is quantized with the ModelOpt recipe, bit-exact per tensor
//! ([`Nvfp4Tensor::quantize`]); every other tensor is copied unchanged, shard by shard (output
//! shards mirror the input's, so memory holds one shard at a time). Without calibration the
//! result is `W4A16_NVFP4`. With calibration tokens `x` `[T, H]` the bf16 layer is run on them
//! and each expert gets `input_scale = amax / 2688` of the tokens routed to it (gate and up
//! share it) and of its intermediate activation (down); an expert no token reached gets the
//! layer's maximum and is reported. The result is written to a temporary folder and renamed.

use super::config::{parse_model_config, ModelConfig};
use super::shards::CheckpointFiles;
use super::write::{hf_quant_config, projection_tensors};
use crate::error::{Error, Result};
use crate::format::nvfp4::NVFP4_RANGE;
use crate::format::Nvfp4Tensor;
use crate::routing::{route, router_logits};
use crate::spec::QuantMode;
use crate::tensor_io::{self, OwnedTensor};
use rayon::prelude::*;
use serde_json::json;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

/// What to quantize and how.
#[derive(Clone, Debug, Default)]
pub struct QuantizeOptions {
    /// Quantize shared experts too (ModelOpt does).
    pub shared: bool,
    /// Calibration tokens `[T, H]`; `None` writes a weight-only (W4A16) checkpoint.
    pub calib: Option<Vec<f32>>,
    /// Replace an existing output folder.
    pub force: bool,
}

/// What `quantize_checkpoint` did.
#[derive(Clone, Debug, Default)]
pub struct QuantizeReport {
    pub family: String,
    pub moe_layers: Vec<usize>,
    pub tensors_quantized: usize,
    pub tensors_copied: usize,
    pub quant_algo: String,
    /// Per layer, the experts no calibration token reached.
    pub uncalibrated: Vec<(usize, Vec<usize>)>,
}

fn projections(gated: bool) -> &'static [&'static str] {
    if gated {
        &["gate_proj", "up_proj"]
    } else {
        &["up_proj"]
    }
}

/// A 2-D F32/BF16 weight as f32 `[rows, cols]`.
fn dense(files: &CheckpointFiles, name: &str) -> Result<(Vec<f32>, usize, usize)> {
    let t = files.tensor(name)?;
    if t.shape.len() != 2 {
        return Err(t.err(format!("expected a 2-D weight, got shape {:?}", t.shape)));
    }
    Ok((t.to_f32()?, t.shape[0], t.shape[1]))
}

/// Per-expert calibrated input scales `(w13, w2)` of one layer, and the uncalibrated experts.
fn calibrate_layer(
    files: &CheckpointFiles,
    cfg: &ModelConfig,
    layer: usize,
    x: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<usize>)> {
    let prefix = cfg.family.moe_prefix(layer);
    let spec = super::Checkpoint::spec_for(cfg, QuantMode::W4A16);
    let (h, e) = (cfg.hidden, cfg.experts);
    let (router, re, rh) = dense(files, &format!("{prefix}.gate.weight"))?;
    if (re, rh) != (e, h) {
        return Err(files
            .tensor(&format!("{prefix}.gate.weight"))?
            .err(format!("expected shape [{e}, {h}], got [{re}, {rh}]")));
    }
    let bias_name = format!("{prefix}.gate.e_score_correction_bias");
    let bias = if files.contains(&bias_name) {
        Some(files.tensor(&bias_name)?.to_f32()?)
    } else {
        None
    };
    let logits = router_logits(x, &router, h, e);
    let topk = route(&logits, e, &spec.routing, bias.as_deref());
    let gated = cfg.activation.is_gated();
    let per_expert: Vec<Result<(f32, f32, usize)>> = (0..e)
        .into_par_iter()
        .map(|ex| {
            let tokens: Vec<usize> = (0..topk.tokens)
                .filter(|&t| topk.ids[t * topk.k..(t + 1) * topk.k].contains(&(ex as i32)))
                .collect();
            if tokens.is_empty() {
                return Ok((0.0, 0.0, 0));
            }
            let mut w13 = Vec::new();
            for p in projections(gated) {
                w13.extend(dense(files, &format!("{prefix}.experts.{ex}.{p}.weight"))?.0);
            }
            let inter = cfg.intermediate;
            let (mut ax, mut ag) = (0.0f32, 0.0f64);
            for &t in &tokens {
                let xt = &x[t * h..(t + 1) * h];
                ax = ax.max(xt.iter().fold(0.0f32, |m, v| m.max(v.abs())));
                let hv: Vec<f64> = w13
                    .chunks_exact(h)
                    .map(|row| row.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum())
                    .collect();
                for c in 0..inter {
                    let up = if gated { hv[inter + c] } else { 0.0 };
                    ag = ag.max(cfg.activation.apply_f64(hv[c], up).abs());
                }
            }
            Ok((ax, ag as f32, tokens.len()))
        })
        .collect();
    let mut a13 = Vec::with_capacity(e);
    let mut a2 = Vec::with_capacity(e);
    let mut missing = Vec::new();
    for (ex, r) in per_expert.into_iter().enumerate() {
        let (ax, ag, n) = r?;
        if n == 0 {
            missing.push(ex);
        }
        a13.push(ax);
        a2.push(ag);
    }
    let fill = |v: &[f32]| {
        let m = v.iter().fold(0.0f32, |m, x| m.max(*x));
        v.iter()
            .enumerate()
            .map(|(i, &a)| if missing.contains(&i) { m } else { a } / NVFP4_RANGE)
            .collect::<Vec<f32>>()
    };
    Ok((fill(&a13), fill(&a2), missing))
}

/// Quantizes the bf16 checkpoint in `input` into `output`.
pub fn quantize_checkpoint(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<QuantizeReport> {
    if output.exists() && !opts.force {
        return Err(Error::arg(
            "output",
            format!("{} exists; pass --force to replace it", output.display()),
        ));
    }
    if output == input
        || (output.exists()
            && std::fs::canonicalize(output).ok() == std::fs::canonicalize(input).ok())
    {
        return Err(Error::arg(
            "output",
            "the output is the input checkpoint; inputs are never modified",
        ));
    }
    let cfg_path = input.join("config.json");
    let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
    let cfg_json: serde_json::Value = serde_json::from_str(&cfg_text)
        .map_err(|e| Error::file(&cfg_path, format!("not valid JSON: {e}")))?;
    let cfg = parse_model_config(&cfg_json).map_err(|m| Error::file(&cfg_path, m))?;
    let files = CheckpointFiles::open(input)?;
    let gated = cfg.activation.is_gated();
    let first = projections(gated)[0];
    let moe_layers: Vec<usize> = (0..cfg.layers)
        .filter(|&l| {
            files.contains(&format!(
                "{}.experts.0.{first}.weight",
                cfg.family.moe_prefix(l)
            ))
        })
        .collect();
    if moe_layers.is_empty() {
        return Err(Error::file(
            input,
            "no MoE expert weights found (nothing to quantize)",
        ));
    }
    if let Some(x) = &opts.calib {
        if x.is_empty() || x.len() % cfg.hidden != 0 {
            return Err(Error::arg(
                "calib",
                format!("`x` must be [T, {}] with T >= 1", cfg.hidden),
            ));
        }
        crate::format::nvfp4::check_finite("x", x, cfg.hidden)?;
    }

    // Base names to quantize, and calibrated input scales per base name.
    let mut targets: HashSet<String> = HashSet::new();
    let mut input_scales: HashMap<String, f32> = HashMap::new();
    let mut report = QuantizeReport {
        family: cfg.family.name().to_string(),
        moe_layers: moe_layers.clone(),
        quant_algo: if opts.calib.is_some() {
            "NVFP4"
        } else {
            "W4A16_NVFP4"
        }
        .to_string(),
        ..Default::default()
    };
    let mut exclude = vec!["lm_head".to_string()];
    for &l in &moe_layers {
        let prefix = cfg.family.moe_prefix(l);
        for e in 0..cfg.experts {
            for p in projections(gated).iter().chain(&["down_proj"]) {
                targets.insert(format!("{prefix}.experts.{e}.{p}"));
            }
        }
        let shared_base = format!("{prefix}.shared_experts");
        for p in projections(gated).iter().chain(&["down_proj"]) {
            let n = format!("{shared_base}.{p}");
            if files.contains(&format!("{n}.weight")) {
                if opts.shared {
                    targets.insert(n);
                } else {
                    exclude.push(n);
                }
            }
        }
        exclude.push(cfg.family.router_module(l));
        if let Some(x) = &opts.calib {
            progress(&format!("calibrating layer {l}"));
            let (s13, s2, missing) = calibrate_layer(&files, &cfg, l, x)?;
            for e in 0..cfg.experts {
                for p in projections(gated) {
                    input_scales.insert(format!("{prefix}.experts.{e}.{p}"), s13[e]);
                }
                input_scales.insert(format!("{prefix}.experts.{e}.down_proj"), s2[e]);
            }
            if !missing.is_empty() {
                report.uncalibrated.push((l, missing));
            }
        }
    }

    // The up-front check above refused an existing output unless --force.
    tensor_io::write_dir_atomic(output, true, |tmp| {
        let shards = files.shard_contents();
        let mut weight_map = BTreeMap::new();
        for (k, (path, names)) in shards.iter().enumerate() {
            progress(&format!("shard {}/{}", k + 1, shards.len()));
            let file = path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model.safetensors".into());
            let jobs: Vec<Result<Vec<(String, OwnedTensor)>>> = names
                .par_iter()
                .map(|n| {
                    let base = n.strip_suffix(".weight").filter(|b| targets.contains(*b));
                    let t = files.tensor(n)?;
                    match base {
                        Some(b) => {
                            let (data, rows, cols) = dense(&files, n)?;
                            let q = Nvfp4Tensor::quantize(n, &data, rows, cols)
                                .map_err(|e| t.err(e))?;
                            let input_scale = input_scales.get(b).copied();
                            Ok(projection_tensors(
                                b,
                                rows,
                                cols,
                                q.packed,
                                q.scales,
                                q.scale_2,
                                input_scale,
                            ))
                        }
                        None => Ok(vec![(
                            n.to_string(),
                            OwnedTensor::bytes(t.dtype, t.shape.clone(), t.data.to_vec()),
                        )]),
                    }
                })
                .collect();
            let mut out = Vec::new();
            for j in jobs {
                let v = j?;
                if v.len() > 1 {
                    report.tensors_quantized += 1;
                } else {
                    report.tensors_copied += 1;
                }
                out.extend(v);
            }
            for (n, _) in &out {
                weight_map.insert(n.clone(), file.clone());
            }
            tensor_io::write_tensors(&tmp.join(&file), &out, None)?;
        }
        // Always an index (also over a single file), as ModelOpt exports have it.
        tensor_io::write_json(
            &tmp.join("model.safetensors.index.json"),
            &json!({"metadata": {}, "weight_map": weight_map}),
        )?;
        tensor_io::write_atomic(&tmp.join("config.json"), cfg_text.as_bytes())?;
        tensor_io::write_json(
            &tmp.join("hf_quant_config.json"),
            &hf_quant_config(&report.quant_algo, &exclude),
        )
    })?;
    Ok(report)
}
