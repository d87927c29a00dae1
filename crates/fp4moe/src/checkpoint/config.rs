//! `config.json` and `hf_quant_config.json` (or `config.json["quantization_config"]`) of a
//! ModelOpt checkpoint: the fields DESIGN 3 lists, per model family.

use crate::spec::{Activation, Scoring};
use serde_json::Value;

/// Model families whose MoE layers fp4moe reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Nemotron-H (Nemotron-3 Nano/Super): `backbone.layers.{L}.mixer.*`, non-gated ReLU².
    NemotronH,
    /// Qwen3-MoE: `model.layers.{L}.mlp.*`, gated SiLU, softmax routing.
    Qwen3Moe,
    /// DeepSeek-V3/R1: `model.layers.{L}.mlp.*`, gated SiLU, grouped sigmoid + bias routing.
    DeepseekV3,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::NemotronH => "nemotron_h",
            Family::Qwen3Moe => "qwen3_moe",
            Family::DeepseekV3 => "deepseek_v3",
        }
    }

    /// Router module name of layer `l` (always excluded from quantization).
    pub fn router_module(self, l: usize) -> String {
        format!("{}.gate", self.moe_prefix(l))
    }

    /// Prefix of layer `l`'s MoE block.
    pub fn moe_prefix(self, l: usize) -> String {
        match self {
            Family::NemotronH => format!("backbone.layers.{l}.mixer"),
            Family::Qwen3Moe | Family::DeepseekV3 => format!("model.layers.{l}.mlp"),
        }
    }
}

/// The MoE-relevant part of `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub model_type: String,
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    pub layers: usize,
    pub renormalize: bool,
    pub routed_scaling_factor: f32,
    pub n_group: usize,
    pub topk_group: usize,
    pub scoring: Scoring,
    pub activation: Activation,
    /// Width of the shared expert (`moe_shared_expert_intermediate_size · n_shared_experts`).
    pub shared_intermediate: Option<usize>,
}

/// `quant_algo` of `hf_quant_config.json`.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantAlgo {
    /// W4A4 with calibrated input scales.
    Nvfp4,
    /// Weight-only NVFP4.
    W4A16Nvfp4,
    Other(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct QuantConfig {
    pub algo: QuantAlgo,
    pub group_size: usize,
    pub exclude_modules: Vec<String>,
    pub producer: Option<String>,
}

fn get_usize(v: &Value, key: &str) -> Option<usize> {
    v.get(key).and_then(Value::as_u64).map(|x| x as usize)
}

/// Parses `config.json`; `Err` names the missing or invalid field.
pub fn parse_model_config(v: &Value) -> Result<ModelConfig, String> {
    let model_type = v
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let arch = v
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .unwrap_or("");
    let family = match (model_type.as_str(), arch) {
        ("nemotron_h", _) | (_, "NemotronHForCausalLM") => Family::NemotronH,
        ("qwen3_moe", _) | (_, "Qwen3MoeForCausalLM") => Family::Qwen3Moe,
        ("deepseek_v3", _) | (_, "DeepseekV3ForCausalLM") => Family::DeepseekV3,
        _ => {
            return Err(format!(
                "model_type `{model_type}` / architecture `{arch}` is not a supported MoE family (nemotron_h, qwen3_moe, deepseek_v3)"
            ))
        }
    };
    let need = |key: &str| {
        get_usize(v, key)
            .filter(|&x| x > 0)
            .ok_or_else(|| format!("field `{key}` is missing or not a positive integer"))
    };
    let hidden = need("hidden_size")?;
    let intermediate = need("moe_intermediate_size")?;
    let experts = get_usize(v, "n_routed_experts")
        .or_else(|| get_usize(v, "num_experts"))
        .filter(|&x| x > 0)
        .ok_or(
            "field `n_routed_experts` (or `num_experts`) is missing or not a positive integer",
        )?;
    let top_k = need("num_experts_per_tok")?;
    let layers = need("num_hidden_layers")?;
    let renormalize = v
        .get("norm_topk_prob")
        .and_then(Value::as_bool)
        .unwrap_or(family != Family::DeepseekV3);
    let routed_scaling_factor = v
        .get("routed_scaling_factor")
        .and_then(Value::as_f64)
        .unwrap_or(1.0) as f32;
    let n_group = get_usize(v, "n_group").unwrap_or(1).max(1);
    let topk_group = get_usize(v, "topk_group").unwrap_or(n_group).max(1);
    let scoring = match (family, v.get("scoring_func").and_then(Value::as_str)) {
        (_, Some("sigmoid")) | (Family::NemotronH, None) | (Family::DeepseekV3, None) => {
            Scoring::Sigmoid
        }
        (_, Some("softmax")) | (Family::Qwen3Moe, None) => Scoring::Softmax,
        (_, Some(other)) => {
            return Err(format!(
                "field `scoring_func` = `{other}` is not softmax or sigmoid"
            ))
        }
    };
    let activation = match family {
        Family::NemotronH => match v
            .get("mlp_hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("relu2")
        {
            "relu2" => Activation::Relu2NoMul,
            "silu" => Activation::SiluNoMul,
            other => {
                return Err(format!(
                    "field `mlp_hidden_act` = `{other}` is not relu2 or silu"
                ))
            }
        },
        _ => match v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu")
        {
            "silu" => Activation::Silu,
            "gelu_pytorch_tanh" | "gelu_tanh" => Activation::GeluTanh,
            other => {
                return Err(format!(
                    "field `hidden_act` = `{other}` is not silu or gelu_tanh"
                ))
            }
        },
    };
    let n_shared = get_usize(v, "n_shared_experts").unwrap_or(0);
    let shared_width = get_usize(v, "moe_shared_expert_intermediate_size").unwrap_or(intermediate);
    let shared_intermediate = (n_shared > 0).then(|| shared_width * n_shared);
    Ok(ModelConfig {
        family,
        model_type,
        hidden,
        intermediate,
        experts,
        top_k,
        layers,
        renormalize,
        routed_scaling_factor,
        n_group,
        topk_group,
        scoring,
        activation,
        shared_intermediate,
    })
}

/// Parses `hf_quant_config.json` (`{"quantization": {...}}`) or a `quantization_config` object.
pub fn parse_quant_config(v: &Value) -> Result<QuantConfig, String> {
    let q = v.get("quantization").unwrap_or(v);
    let algo = match q.get("quant_algo").and_then(Value::as_str) {
        Some("NVFP4") => QuantAlgo::Nvfp4,
        Some("W4A16_NVFP4") => QuantAlgo::W4A16Nvfp4,
        Some(other) => QuantAlgo::Other(other.to_string()),
        None => return Err("field `quant_algo` is missing".into()),
    };
    let group_size = get_usize(q, "group_size").unwrap_or(16);
    let exclude_modules = q
        .get("exclude_modules")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    let producer = v
        .get("producer")
        .and_then(|p| p.get("name"))
        .and_then(Value::as_str)
        .map(str::to_string);
    Ok(QuantConfig {
        algo,
        group_size,
        exclude_modules,
        producer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nemotron_and_qwen_configs() {
        let n = parse_model_config(&json!({"model_type": "nemotron_h", "hidden_size": 2688, "moe_intermediate_size": 1856,
            "n_routed_experts": 128, "num_experts_per_tok": 6, "num_hidden_layers": 52, "norm_topk_prob": true,
            "routed_scaling_factor": 2.5, "mlp_hidden_act": "relu2", "n_shared_experts": 1,
            "moe_shared_expert_intermediate_size": 3712}))
        .unwrap();
        assert_eq!(
            (n.family, n.activation, n.scoring),
            (Family::NemotronH, Activation::Relu2NoMul, Scoring::Sigmoid)
        );
        assert_eq!(n.shared_intermediate, Some(3712));
        let q = parse_model_config(&json!({"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768,
            "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "norm_topk_prob": true}))
        .unwrap();
        assert_eq!(
            (q.family, q.activation, q.scoring, q.shared_intermediate),
            (Family::Qwen3Moe, Activation::Silu, Scoring::Softmax, None)
        );
        let e = parse_model_config(&json!({"model_type": "qwen3_moe", "hidden_size": 2048}))
            .unwrap_err();
        assert!(e.contains("moe_intermediate_size"), "{e}");
        let e = parse_model_config(&json!({"model_type": "llama"})).unwrap_err();
        assert!(e.contains("llama"), "{e}");
    }

    #[test]
    fn quant_configs() {
        let q = parse_quant_config(
            &json!({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4",
            "group_size": 16, "exclude_modules": ["lm_head", "model.layers.0.mlp.gate"]}}),
        )
        .unwrap();
        assert_eq!(q.algo, QuantAlgo::Nvfp4);
        assert_eq!(q.exclude_modules.len(), 2);
        assert_eq!(
            parse_quant_config(&json!({"quant_algo": "W4A16_NVFP4"}))
                .unwrap()
                .algo,
            QuantAlgo::W4A16Nvfp4
        );
    }
}
