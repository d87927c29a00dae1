//! Writing a ModelOpt-layout NVFP4 checkpoint: `config.json`, `hf_quant_config.json`, and the
//! tensors in one file or in shards with `model.safetensors.index.json`. Everything goes to a
//! temporary folder beside the destination, renamed at the end, so an interrupted write leaves
//! nothing half-written; an existing destination is refused.

use super::config::{Family, ModelConfig};
use crate::error::{Error, Result};
use crate::spec::Scoring;
use crate::tensor_io::{self, OwnedTensor};
use crate::weights::{DenseWeight, ExpertStack, MoeWeights};
use safetensors::tensor::Dtype;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

/// How to write.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// `NVFP4` (with input scales) or `W4A16_NVFP4`.
    pub quant_algo: String,
    /// Start a new shard past this many bytes (`None`: one `model.safetensors`).
    pub shard_bytes: Option<usize>,
}

fn push_projection(
    out: &mut Vec<(String, OwnedTensor)>,
    name: &str,
    s: &ExpertStack,
    e: usize,
    shard: usize,
    input_scale: Option<f32>,
) {
    let rows = s.rows / s.shards;
    let (rb, sc) = (s.row_bytes(), s.scale_cols());
    let r0 = e * s.rows + shard * rows;
    out.push((
        format!("{name}.weight"),
        OwnedTensor::bytes(
            Dtype::U8,
            vec![rows, s.cols / 2],
            s.packed[r0 * rb..(r0 + rows) * rb].to_vec(),
        ),
    ));
    out.push((
        format!("{name}.weight_scale"),
        OwnedTensor::bytes(
            Dtype::F8_E4M3,
            vec![rows, s.cols / 16],
            s.scales[r0 * sc..(r0 + rows) * sc].to_vec(),
        ),
    ));
    out.push((
        format!("{name}.weight_scale_2"),
        OwnedTensor::f32(vec![], &[s.scale_2[e * s.shards + shard]]),
    ));
    if let Some(v) = input_scale {
        out.push((
            format!("{name}.input_scale"),
            OwnedTensor::f32(vec![], &[v]),
        ));
    }
}

fn push_dense(out: &mut Vec<(String, OwnedTensor)>, names: &[String], w: &DenseWeight) {
    match w {
        DenseWeight::Bf16 { rows, cols, data } => {
            let per = rows / names.len();
            for (k, n) in names.iter().enumerate() {
                out.push((
                    format!("{n}.weight"),
                    OwnedTensor::bf16(
                        vec![per, *cols],
                        &data[k * per * cols..(k + 1) * per * cols],
                    ),
                ));
            }
        }
        DenseWeight::Nvfp4(s) => {
            for (k, n) in names.iter().enumerate() {
                push_projection(out, n, s, 0, k, None);
            }
        }
    }
}

/// The `config.json` written for `cfg`.
fn config_json(cfg: &ModelConfig) -> serde_json::Value {
    let (arch, act_key, act) = match cfg.family {
        Family::NemotronH => ("NemotronHForCausalLM", "mlp_hidden_act", cfg_act(cfg)),
        Family::Qwen3Moe => ("Qwen3MoeForCausalLM", "hidden_act", cfg_act(cfg)),
        Family::DeepseekV3 => ("DeepseekV3ForCausalLM", "hidden_act", cfg_act(cfg)),
    };
    let mut v = json!({
        "architectures": [arch],
        "model_type": cfg.family.name(),
        "hidden_size": cfg.hidden,
        "moe_intermediate_size": cfg.intermediate,
        "n_routed_experts": cfg.experts,
        "num_experts": cfg.experts,
        "num_experts_per_tok": cfg.top_k,
        "num_hidden_layers": cfg.layers,
        "norm_topk_prob": cfg.renormalize,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "scoring_func": if cfg.scoring == Scoring::Sigmoid { "sigmoid" } else { "softmax" },
    });
    v[act_key] = json!(act);
    if let Some(w) = cfg.shared_intermediate {
        v["n_shared_experts"] = json!(1);
        v["moe_shared_expert_intermediate_size"] = json!(w);
    }
    v
}

fn cfg_act(cfg: &ModelConfig) -> &'static str {
    use crate::spec::Activation::*;
    match cfg.activation {
        Silu | SiluNoMul => "silu",
        GeluTanh => "gelu_pytorch_tanh",
        Relu2NoMul => "relu2",
    }
}

/// Writes `layers` (layer index, weights) of a model described by `cfg` into `dir`.
pub fn write_checkpoint(
    dir: &Path,
    cfg: &ModelConfig,
    layers: &[(usize, MoeWeights)],
    opts: &WriteOptions,
) -> Result<()> {
    if dir.exists() {
        return Err(Error::arg(
            "output",
            format!("{} exists; refusing to overwrite it", dir.display()),
        ));
    }
    let gated = cfg.activation.is_gated();
    let mut tensors: Vec<(String, OwnedTensor)> = Vec::new();
    let mut exclude = vec!["lm_head".to_string()];
    for (l, w) in layers {
        let p = cfg.family.moe_prefix(*l);
        for e in 0..w.w13.experts {
            let a13 = w.w13_input_scale.as_ref().map(|v| v[e]);
            let names: &[&str] = if gated {
                &["gate_proj", "up_proj"]
            } else {
                &["up_proj"]
            };
            for (k, proj) in names.iter().enumerate() {
                push_projection(
                    &mut tensors,
                    &format!("{p}.experts.{e}.{proj}"),
                    &w.w13,
                    e,
                    k,
                    a13,
                );
            }
            push_projection(
                &mut tensors,
                &format!("{p}.experts.{e}.down_proj"),
                &w.w2,
                e,
                0,
                w.w2_input_scale.as_ref().map(|v| v[e]),
            );
        }
        if let Some(r) = &w.router {
            tensors.push((
                format!("{p}.gate.weight"),
                OwnedTensor::f32(vec![w.w13.experts, w.w13.cols], r),
            ));
        }
        if let Some(b) = &w.e_score_correction_bias {
            tensors.push((
                format!("{p}.gate.e_score_correction_bias"),
                OwnedTensor::f32(vec![b.len()], b),
            ));
        }
        if let Some(sh) = &w.shared {
            let names: Vec<String> = if gated {
                vec!["gate_proj", "up_proj"]
            } else {
                vec!["up_proj"]
            }
            .into_iter()
            .map(|n| format!("{p}.shared_experts.{n}"))
            .collect();
            push_dense(&mut tensors, &names, &sh.w13);
            push_dense(
                &mut tensors,
                &[format!("{p}.shared_experts.down_proj")],
                &sh.w2,
            );
        }
        exclude.push(cfg.family.router_module(*l));
    }
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| -> Result<()> {
        std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let write_json = |file: &str, v: &serde_json::Value| -> Result<()> {
            let text =
                serde_json::to_string_pretty(v).map_err(|e| Error::arg("output", e.to_string()))?;
            tensor_io::write_atomic(&tmp.join(file), text.as_bytes())
        };
        write_json("config.json", &config_json(cfg))?;
        write_json(
            "hf_quant_config.json",
            &json!({"producer": {"name": "fp4moe", "version": env!("CARGO_PKG_VERSION")},
                    "quantization": {"quant_algo": opts.quant_algo, "group_size": 16,
                                     "kv_cache_quant_algo": null, "exclude_modules": exclude}}),
        )?;
        match opts.shard_bytes {
            None => tensor_io::write_tensors(&tmp.join("model.safetensors"), &tensors, None)?,
            Some(limit) => {
                let mut groups: Vec<Vec<(String, OwnedTensor)>> = vec![Vec::new()];
                let mut size = 0;
                for t in tensors {
                    if size > 0 && size + t.1.data.len() > limit {
                        groups.push(Vec::new());
                        size = 0;
                    }
                    size += t.1.data.len();
                    if let Some(g) = groups.last_mut() {
                        g.push(t);
                    }
                }
                let n = groups.len();
                let mut map = BTreeMap::new();
                for (k, g) in groups.iter().enumerate() {
                    let file = format!("model-{:05}-of-{:05}.safetensors", k + 1, n);
                    for (tn, _) in g {
                        map.insert(tn.clone(), file.clone());
                    }
                    tensor_io::write_tensors(&tmp.join(&file), g, None)?;
                }
                write_json(
                    "model.safetensors.index.json",
                    &json!({"metadata": {}, "weight_map": map}),
                )?;
            }
        }
        std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}
