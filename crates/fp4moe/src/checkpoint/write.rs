//! Writing a ModelOpt-layout NVFP4 checkpoint: `config.json`, `hf_quant_config.json`, and the
//! tensors in one file or in shards with `model.safetensors.index.json`. Everything goes to a
//! temporary folder beside the destination, renamed at the end, so an interrupted write leaves
//! nothing half-written; an existing destination is refused.

use super::config::{Family, ModelConfig};
use crate::error::Result;
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

/// The ModelOpt tensors of one NVFP4 projection `base` (`[rows, cols]`): `.weight` U8,
/// `.weight_scale` F8_E4M3, `.weight_scale_2` F32 0-d, and `.input_scale` F32 0-d when given.
pub(crate) fn projection_tensors(
    base: &str,
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    scales: Vec<u8>,
    scale_2: f32,
    input_scale: Option<f32>,
) -> Vec<(String, OwnedTensor)> {
    let mut v = vec![
        (
            format!("{base}.weight"),
            OwnedTensor::bytes(Dtype::U8, vec![rows, cols / 2], packed),
        ),
        (
            format!("{base}.weight_scale"),
            OwnedTensor::bytes(Dtype::F8_E4M3, vec![rows, cols / 16], scales),
        ),
        (
            format!("{base}.weight_scale_2"),
            OwnedTensor::f32(vec![], &[scale_2]),
        ),
    ];
    if let Some(s) = input_scale {
        v.push((
            format!("{base}.input_scale"),
            OwnedTensor::f32(vec![], &[s]),
        ));
    }
    v
}

/// `hf_quant_config.json` as ModelOpt writes it (the fields vLLM requires).
pub(crate) fn hf_quant_config(quant_algo: &str, exclude: &[String]) -> serde_json::Value {
    json!({"producer": {"name": "fp4moe", "version": env!("CARGO_PKG_VERSION")},
           "quantization": {"quant_algo": quant_algo, "group_size": 16,
                            "kv_cache_quant_algo": null, "exclude_modules": exclude}})
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
    out.extend(projection_tensors(
        name,
        rows,
        s.cols,
        s.packed[r0 * rb..(r0 + rows) * rb].to_vec(),
        s.scales[r0 * sc..(r0 + rows) * sc].to_vec(),
        s.scale_2[e * s.shards + shard],
        input_scale,
    ));
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
    tensor_io::write_dir_atomic(dir, false, |tmp| {
        tensor_io::write_json(&tmp.join("config.json"), &config_json(cfg))?;
        tensor_io::write_json(
            &tmp.join("hf_quant_config.json"),
            &hf_quant_config(&opts.quant_algo, &exclude),
        )?;
        match opts.shard_bytes {
            None => tensor_io::write_tensors(&tmp.join("model.safetensors"), &tensors, None),
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
                tensor_io::write_json(
                    &tmp.join("model.safetensors.index.json"),
                    &json!({"metadata": {}, "weight_map": map}),
                )
            }
        }
    })
}
