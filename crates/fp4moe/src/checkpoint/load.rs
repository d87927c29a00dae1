//! Loading one MoE layer of a checkpoint, and the per-layer statistics `fp4moe inspect` shows.

use super::config::{parse_model_config, parse_quant_config, ModelConfig, QuantAlgo, QuantConfig};
use super::shards::CheckpointFiles;
use crate::error::{Error, Result};
use crate::format::e4m3;
use crate::spec::{Intermediate, LayerShape, MoeSpec, QuantMode, RoutingConfig};
use crate::weights::{DenseWeight, ExpertStack, MoeWeights, SharedExpert};
use half::bf16;
use safetensors::tensor::Dtype;
use std::path::Path;

/// An opened checkpoint directory.
pub struct Checkpoint {
    pub files: CheckpointFiles,
    pub config: ModelConfig,
    pub quant: QuantConfig,
    /// Layers whose experts are present, ascending.
    pub moe_layers: Vec<usize>,
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::file(path, format!("not valid JSON: {e}")))
}

/// Projection names of w13 (in row order) and w2 for a family / gatedness.
fn w13_names(gated: bool) -> &'static [&'static str] {
    if gated {
        &["gate_proj", "up_proj"]
    } else {
        &["up_proj"]
    }
}

/// One NVFP4 projection `[rows, cols]` as stored by ModelOpt.
struct Projection {
    packed: Vec<u8>,
    scales: Vec<u8>,
    scale_2: f32,
    input_scale: Option<f32>,
}

const SCALE_DTYPES: [Dtype; 2] = [Dtype::F8_E4M3, Dtype::U8];

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let cfg_json = read_json(&cfg_path)?;
        let config = parse_model_config(&cfg_json).map_err(|m| Error::file(&cfg_path, m))?;
        let hq = dir.join("hf_quant_config.json");
        let quant = if hq.is_file() {
            parse_quant_config(&read_json(&hq)?).map_err(|m| Error::file(&hq, m))?
        } else if let Some(q) = cfg_json.get("quantization_config") {
            parse_quant_config(q)
                .map_err(|m| Error::file(&cfg_path, format!("quantization_config: {m}")))?
        } else {
            return Err(Error::file(dir, "no hf_quant_config.json and no quantization_config in config.json: not a ModelOpt checkpoint"));
        };
        let files = CheckpointFiles::open(dir)?;
        let gated = config.activation.is_gated();
        let first = w13_names(gated)[0];
        let moe_layers = (0..config.layers)
            .filter(|&l| {
                files.contains(&format!(
                    "{}.experts.0.{first}.weight",
                    config.family.moe_prefix(l)
                ))
            })
            .collect();
        Ok(Self {
            files,
            config,
            quant,
            moe_layers,
        })
    }

    /// The quant mode the checkpoint declares (`NVFP4` → W4A4, `W4A16_NVFP4` → W4A16).
    pub fn declared_mode(&self) -> Result<QuantMode> {
        match &self.quant.algo {
            QuantAlgo::Nvfp4 => Ok(QuantMode::W4A4 {
                intermediate: Intermediate::Static,
            }),
            QuantAlgo::W4A16Nvfp4 => Ok(QuantMode::W4A16),
            QuantAlgo::Other(a) => Err(Error::file(
                &self.files.dir,
                format!("quant_algo `{a}` is not NVFP4 or W4A16_NVFP4"),
            )),
        }
    }

    /// The spec of every MoE layer for `mode`.
    pub fn spec(&self, mode: QuantMode) -> MoeSpec {
        Self::spec_for(&self.config, mode)
    }

    /// The MoE spec a model config describes, for `mode`.
    pub fn spec_for(c: &ModelConfig, mode: QuantMode) -> MoeSpec {
        MoeSpec {
            shape: LayerShape {
                hidden: c.hidden,
                intermediate: c.intermediate,
                experts: c.experts,
            },
            activation: c.activation,
            quant: mode,
            routing: RoutingConfig {
                scoring: c.scoring,
                top_k: c.top_k,
                n_group: c.n_group,
                topk_group: c.topk_group,
                renormalize: c.renormalize,
                routed_scaling_factor: c.routed_scaling_factor,
            },
            shared_intermediate: c.shared_intermediate,
        }
    }

    fn projection(&self, name: &str, rows: usize, cols: usize) -> Result<Projection> {
        let w = self.files.tensor(&format!("{name}.weight"))?;
        let packed = w.bytes(&[rows, cols / 2], &[Dtype::U8])?.to_vec();
        let s = self.files.tensor(&format!("{name}.weight_scale"))?;
        let scales = s.bytes(&[rows, cols / 16], &SCALE_DTYPES)?.to_vec();
        if let Some(i) = scales.iter().position(|&b| e4m3::is_nan(b)) {
            return Err(s.err(format!(
                "block scale at [{}, {}] is an E4M3 NaN byte ({:#04x})",
                i / (cols / 16),
                i % (cols / 16),
                scales[i]
            )));
        }
        let s2t = self.files.tensor(&format!("{name}.weight_scale_2"))?;
        let scale_2 = s2t.scalar()?;
        if !scale_2.is_finite() || scale_2 < 0.0 {
            return Err(s2t.err(format!(
                "weight_scale_2 = {scale_2} must be finite and non-negative"
            )));
        }
        let input_scale = match self.files.contains(&format!("{name}.input_scale")) {
            true => Some(
                self.files
                    .tensor(&format!("{name}.input_scale"))?
                    .scalar()?,
            ),
            false => None,
        };
        Ok(Projection {
            packed,
            scales,
            scale_2,
            input_scale,
        })
    }

    fn check_layer(&self, layer: usize) -> Result<String> {
        let prefix = self.config.family.moe_prefix(layer);
        if !self.moe_layers.contains(&layer) {
            let excluded = self
                .quant
                .exclude_modules
                .iter()
                .find(|m| glob_match(m, &format!("{prefix}.experts.0.up_proj")));
            return Err(Error::file(
                &self.files.dir,
                match excluded {
                    Some(m) => format!("layer {layer}: its experts are excluded from quantization (`{m}` in exclude_modules)"),
                    None => format!("layer {layer} is not an NVFP4 MoE layer here; MoE layers: {:?}", self.moe_layers),
                },
            ));
        }
        Ok(prefix)
    }

    /// Loads MoE layer `layer` for `mode` (the declared one when `None`). W4A4 needs every
    /// expert's input scales, finite and positive; W4A16 ignores them.
    pub fn load_layer(
        &self,
        layer: usize,
        mode: Option<QuantMode>,
    ) -> Result<(MoeSpec, MoeWeights)> {
        let prefix = self.check_layer(layer)?;
        let mode = match mode {
            Some(m) => m,
            None => self.declared_mode()?,
        };
        let spec = self.spec(mode);
        let (h, i, e) = (
            spec.shape.hidden,
            spec.shape.intermediate,
            spec.shape.experts,
        );
        let gated = spec.activation.is_gated();
        let shards = spec.activation.w13_shards();
        let w4a4 = matches!(mode, QuantMode::W4A4 { .. });
        let mut w13 = ExpertStack {
            experts: e,
            rows: shards * i,
            cols: h,
            shards,
            packed: Vec::with_capacity(e * shards * i * h / 2),
            scales: Vec::with_capacity(e * shards * i * h / 16),
            scale_2: Vec::with_capacity(e * shards),
        };
        let mut w2 = ExpertStack {
            experts: e,
            rows: h,
            cols: i,
            shards: 1,
            packed: Vec::with_capacity(e * h * i / 2),
            scales: Vec::with_capacity(e * h * i / 16),
            scale_2: Vec::with_capacity(e),
        };
        let (mut in13, mut in2) = (Vec::with_capacity(e), Vec::with_capacity(e));
        for x in 0..e {
            let mut a13 = 0.0f32;
            for proj in w13_names(gated) {
                let name = format!("{prefix}.experts.{x}.{proj}");
                let p = self.projection(&name, i, h)?;
                w13.packed.extend_from_slice(&p.packed);
                w13.scales.extend_from_slice(&p.scales);
                w13.scale_2.push(p.scale_2);
                if w4a4 {
                    a13 = a13.max(input_scale(&name, p.input_scale, x, &self.files.dir)?);
                }
            }
            let name = format!("{prefix}.experts.{x}.down_proj");
            let p = self.projection(&name, h, i)?;
            w2.packed.extend_from_slice(&p.packed);
            w2.scales.extend_from_slice(&p.scales);
            w2.scale_2.push(p.scale_2);
            if w4a4 {
                in2.push(input_scale(&name, p.input_scale, x, &self.files.dir)?);
                in13.push(a13);
            }
        }
        let router_t = self.files.tensor(&format!("{prefix}.gate.weight"))?;
        router_t.expect_shape(&[e, h])?;
        let router = router_t.to_f32()?;
        let bias_name = format!("{prefix}.gate.e_score_correction_bias");
        let bias = if self.files.contains(&bias_name) {
            let b = self.files.tensor(&bias_name)?;
            b.expect_shape(&[e])?;
            Some(b.to_f32()?)
        } else {
            None
        };
        let shared = match spec.shared_intermediate {
            Some(w) => Some(self.shared_expert(&prefix, gated, h, w)?),
            None => None,
        };
        let weights = MoeWeights {
            w13,
            w2,
            w13_input_scale: w4a4.then_some(in13),
            w2_input_scale: w4a4.then_some(in2),
            e_score_correction_bias: bias,
            router: Some(router),
            shared,
        };
        weights
            .validate(&spec)
            .map_err(|err| Error::file(&self.files.dir, format!("layer {layer}: {err}")))?;
        Ok((spec, weights))
    }

    fn dense(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(Option<Vec<bf16>>, Option<Projection>)> {
        let t = self.files.tensor(&format!("{name}.weight"))?;
        if t.dtype == Dtype::U8 {
            return Ok((None, Some(self.projection(name, rows, cols)?)));
        }
        t.expect_shape(&[rows, cols])?;
        Ok((
            Some(t.to_f32()?.into_iter().map(bf16::from_f32).collect()),
            None,
        ))
    }

    fn shared_expert(&self, prefix: &str, gated: bool, h: usize, w: usize) -> Result<SharedExpert> {
        let base = format!("{prefix}.shared_experts");
        let mut bf = Vec::new();
        let mut nv: Vec<Projection> = Vec::new();
        for proj in w13_names(gated) {
            match self.dense(&format!("{base}.{proj}"), w, h)? {
                (Some(v), _) => bf.extend(v),
                (_, Some(p)) => nv.push(p),
                _ => {}
            }
        }
        let w13 = if nv.is_empty() {
            DenseWeight::Bf16 {
                rows: w13_names(gated).len() * w,
                cols: h,
                data: bf,
            }
        } else if bf.is_empty() {
            DenseWeight::Nvfp4(ExpertStack {
                experts: 1,
                rows: nv.len() * w,
                cols: h,
                shards: nv.len(),
                packed: nv.iter().flat_map(|p| p.packed.iter().copied()).collect(),
                scales: nv.iter().flat_map(|p| p.scales.iter().copied()).collect(),
                scale_2: nv.iter().map(|p| p.scale_2).collect(),
            })
        } else {
            return Err(Error::file(
                &self.files.dir,
                format!("{base}: gate and up projections mix bf16 and NVFP4"),
            ));
        };
        let w2 = match self.dense(&format!("{base}.down_proj"), h, w)? {
            (Some(v), _) => DenseWeight::Bf16 {
                rows: h,
                cols: w,
                data: v,
            },
            (_, Some(p)) => DenseWeight::Nvfp4(ExpertStack {
                experts: 1,
                rows: h,
                cols: w,
                shards: 1,
                packed: p.packed,
                scales: p.scales,
                scale_2: vec![p.scale_2],
            }),
            _ => {
                return Err(Error::file(
                    &self.files.dir,
                    format!("{base}.down_proj.weight is missing"),
                ))
            }
        };
        Ok(SharedExpert { w13, w2 })
    }

    /// Statistics of one MoE layer's expert weights (the problems that corrupted other engines).
    pub fn layer_stats(&self, layer: usize) -> Result<LayerStats> {
        let (spec, w) = self.load_layer(layer, Some(QuantMode::W4A16))?;
        let mut st = LayerStats {
            layer,
            ..Default::default()
        };
        let mut count = |scales: &[u8]| {
            for &b in scales {
                st.scale_bytes += 1;
                if b == 0 {
                    st.zero += 1;
                } else if b & 0x78 == 0 {
                    st.subnormal += 1;
                }
                if b == 0x01 {
                    st.at_floor += 1;
                }
            }
        };
        count(&w.w13.scales);
        count(&w.w2.scales);
        let all: Vec<f32> = w.w13.scale_2.iter().chain(&w.w2.scale_2).copied().collect();
        st.scale_2_min = all.iter().copied().fold(f32::INFINITY, f32::min);
        st.scale_2_max = all.iter().copied().fold(0.0, f32::max);
        if spec.activation.is_gated() {
            st.shard_scale_2_mismatches = w
                .w13
                .scale_2
                .chunks_exact(2)
                .filter(|c| c[0] != c[1])
                .count();
        }
        let prefix = self.config.family.moe_prefix(layer);
        for x in 0..spec.shape.experts {
            for proj in w13_names(spec.activation.is_gated())
                .iter()
                .chain(&["down_proj"])
            {
                let name = format!("{prefix}.experts.{x}.{proj}.input_scale");
                let ok = self
                    .files
                    .tensor(&name)
                    .and_then(|t| t.scalar())
                    .map(|v| v.is_finite() && v > 0.0)
                    .unwrap_or(false);
                if !ok {
                    st.missing_or_bad_input_scales
                        .push(format!("expert {x} {proj}"));
                }
            }
        }
        Ok(st)
    }
}

/// Block-scale and scale statistics of one layer.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LayerStats {
    pub layer: usize,
    pub scale_bytes: usize,
    pub zero: usize,
    pub subnormal: usize,
    /// Bytes at ModelOpt's 2^-9 clamp.
    pub at_floor: usize,
    pub scale_2_min: f32,
    pub scale_2_max: f32,
    /// Gated experts whose gate and up `scale_2` differ (engines that keep one lose accuracy).
    pub shard_scale_2_mismatches: usize,
    pub missing_or_bad_input_scales: Vec<String>,
}

fn input_scale(name: &str, v: Option<f32>, expert: usize, dir: &Path) -> Result<f32> {
    match v {
        Some(s) if s.is_finite() && s > 0.0 => Ok(s),
        Some(s) => Err(Error::file(dir, format!("expert {expert}: `{name}.input_scale` = {s} must be finite and positive (or run with --mode w4a16)"))),
        None => Err(Error::file(dir, format!("expert {expert}: `{name}.input_scale` is missing; W4A4 needs calibrated input scales (or run with --mode w4a16)"))),
    }
}

/// `*` wildcard match of an `exclude_modules` pattern; a module pattern also covers its
/// submodules (`a.b` matches `a.b.c`).
fn glob_match(pattern: &str, text: &str) -> bool {
    fn go(p: &[u8], t: &[u8]) -> bool {
        match p.split_first() {
            None => t.is_empty(),
            Some((b'*', rest)) => (0..=t.len()).any(|i| go(rest, &t[i..])),
            Some((c, rest)) => t.first() == Some(c) && go(rest, &t[1..]),
        }
    }
    go(pattern.as_bytes(), text.as_bytes())
        || go(format!("{pattern}.*").as_bytes(), text.as_bytes())
}

#[cfg(test)]
mod tests {
    #[test]
    fn exclude_patterns() {
        use super::glob_match;
        assert!(glob_match(
            "model.layers.*.mlp.gate",
            "model.layers.3.mlp.gate"
        ));
        assert!(glob_match(
            "model.layers.3.mlp",
            "model.layers.3.mlp.experts.0.up_proj"
        ));
        assert!(!glob_match(
            "model.layers.3.mlp",
            "model.layers.30.mlp.experts.0.up_proj"
        ));
        assert!(!glob_match(
            "lm_head",
            "model.layers.3.mlp.experts.0.up_proj"
        ));
    }
}
