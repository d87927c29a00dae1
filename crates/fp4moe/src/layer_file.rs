//! One MoE layer in one safetensors file: the golden `moe_*` layout (DESIGN 6), also the repro
//! format of `fp4moe run-layer`.
//!
//! Tensors (E experts, S = 2 gated / 1 non-gated, T tokens):
//! `w13_weight` U8 `[E, S·I, H/2]`, `w13_weight_scale` U8/F8_E4M3 `[E, S·I, H/16]`,
//! `w13_weight_scale_2` F32 `[E, S]`, `w2_weight` U8 `[E, H, I/2]`, `w2_weight_scale`
//! `[E, H, I/16]`, `w2_weight_scale_2` F32 `[E]`; optional `w13_input_scale`, `w2_input_scale`
//! F32 `[E]` (or `[E, S]`: the max over shards is used), every element finite and positive;
//! `e_score_correction_bias` F32 `[E]`; input `x` F32/BF16 `[T, H]` with `router_logits` F32
//! `[T, E]` or a router `gate_weight` F32/BF16 `[E, H]`; optional shared expert (both tensors or
//! neither) `shared_w13_weight` `[S·Is, H]` and `shared_w2_weight` `[H, Is]` (F32/BF16, used as
//! bf16); optional `expected_topk_ids` I32 `[T, k]`, `expected_topk_weights` F32 `[T, k]` (rsf
//! included), `expected_output` F32 `[T, H]`.
//!
//! Metadata key `case`: JSON with `activation`, `mode` (`w4a16`/`w4a4`), `intermediate`
//! (`static`/`dynamic`, W4A4), `topk`, `scoring` (`softmax`/`sigmoid`), `renormalize`, `bias`,
//! `n_group`, `topk_group`, `rsf`, and informative shapes.

use crate::error::{Error, Result};
use crate::format::nvfp4::check_finite;
use crate::spec::{
    Activation, Intermediate, LayerShape, MoeSpec, QuantMode, RoutingConfig, Scoring,
};
use crate::tensor_io::{self, OwnedTensor, TensorReader};
use crate::weights::{DenseWeight, ExpertStack, MoeWeights, SharedExpert};
use half::bf16;
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

/// The `case` metadata.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CaseConfig {
    #[serde(default)]
    pub name: String,
    pub activation: String,
    pub mode: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intermediate: Option<String>,
    pub topk: usize,
    pub scoring: String,
    pub renormalize: bool,
    #[serde(default)]
    pub bias: bool,
    #[serde(default = "one")]
    pub n_group: usize,
    #[serde(default = "one")]
    pub topk_group: usize,
    #[serde(default = "one_f")]
    pub rsf: f32,
}

fn one() -> usize {
    1
}
fn one_f() -> f32 {
    1.0
}

/// What the file says the layer should produce.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Expected {
    pub topk_ids: Option<Vec<i32>>,
    pub topk_weights: Option<Vec<f32>>,
    pub output: Option<Vec<f32>>,
}

/// A layer, its input and (optionally) its expected result.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerFile {
    pub name: String,
    pub spec: MoeSpec,
    pub weights: MoeWeights,
    pub x: Vec<f32>,
    pub tokens: usize,
    pub router_logits: Option<Vec<f32>>,
    pub expected: Expected,
}

impl CaseConfig {
    fn to_spec(&self, path: &Path, shape: LayerShape, shared: Option<usize>) -> Result<MoeSpec> {
        let activation = Activation::from_name(&self.activation).ok_or_else(|| {
            Error::file(
                path,
                format!(
                    "case.activation `{}` is not one of silu, gelu_tanh, relu2_no_mul, silu_no_mul",
                    self.activation
                ),
            )
        })?;
        let quant = match (self.mode.as_str(), self.intermediate.as_deref()) {
            ("w4a16", _) => QuantMode::W4A16,
            ("w4a4", None | Some("static")) => QuantMode::W4A4 {
                intermediate: Intermediate::Static,
            },
            ("w4a4", Some("dynamic")) => QuantMode::W4A4 {
                intermediate: Intermediate::Dynamic,
            },
            ("w4a4", Some(other)) => {
                return Err(Error::file(
                    path,
                    format!("case.intermediate `{other}` is not static or dynamic"),
                ))
            }
            (other, _) => {
                return Err(Error::file(
                    path,
                    format!("case.mode `{other}` is not w4a16 or w4a4"),
                ))
            }
        };
        let scoring = match self.scoring.as_str() {
            "softmax" => Scoring::Softmax,
            "sigmoid" => Scoring::Sigmoid,
            other => {
                return Err(Error::file(
                    path,
                    format!("case.scoring `{other}` is not softmax or sigmoid"),
                ))
            }
        };
        let spec = MoeSpec {
            shape,
            activation,
            quant,
            routing: RoutingConfig {
                scoring,
                top_k: self.topk,
                n_group: self.n_group,
                topk_group: self.topk_group,
                renormalize: self.renormalize,
                routed_scaling_factor: self.rsf,
            },
            shared_intermediate: shared,
        };
        spec.validate()
            .map_err(|e| Error::file(path, format!("case: {e}")))?;
        Ok(spec)
    }

    /// The `case` JSON for a spec.
    pub fn from_spec(name: &str, spec: &MoeSpec, has_bias: bool) -> Self {
        let (mode, intermediate) = match spec.quant {
            QuantMode::W4A16 => ("w4a16", None),
            QuantMode::W4A4 {
                intermediate: Intermediate::Static,
            } => ("w4a4", Some("static".to_string())),
            QuantMode::W4A4 {
                intermediate: Intermediate::Dynamic,
            } => ("w4a4", Some("dynamic".to_string())),
        };
        Self {
            name: name.to_string(),
            activation: spec.activation.name().to_string(),
            mode: mode.to_string(),
            intermediate,
            topk: spec.routing.top_k,
            scoring: match spec.routing.scoring {
                Scoring::Softmax => "softmax",
                Scoring::Sigmoid => "sigmoid",
            }
            .to_string(),
            renormalize: spec.routing.renormalize,
            bias: has_bias,
            n_group: spec.routing.n_group,
            topk_group: spec.routing.topk_group,
            rsf: spec.routing.routed_scaling_factor,
        }
    }
}

const SCALE_DTYPES: [Dtype; 2] = [Dtype::U8, Dtype::F8_E4M3];

fn read_stack(
    r: &TensorReader<'_>,
    prefix: &str,
    e: usize,
    rows: usize,
    cols: usize,
    shards: usize,
) -> Result<ExpertStack> {
    let packed = r.bytes(
        &format!("{prefix}_weight"),
        &[e, rows, cols / 2],
        &[Dtype::U8],
    )?;
    let scales_name = format!("{prefix}_weight_scale");
    let scales = r.bytes(&scales_name, &[e, rows, cols / 16], &SCALE_DTYPES)?;
    let s2_name = format!("{prefix}_weight_scale_2");
    let s2_shape = r.shape(&s2_name)?;
    let scale_2 = if shards == 1 && s2_shape == [e] {
        r.f32(&s2_name, &[e])?
    } else {
        r.f32(&s2_name, &[e, shards])?
    };
    let stack = ExpertStack {
        experts: e,
        rows,
        cols,
        shards,
        packed,
        scales,
        scale_2,
    };
    stack
        .validate(prefix)
        .map_err(|err| Error::file(r.path, err.to_string()))?;
    Ok(stack)
}

/// Per-expert input scales `[E]` (or `[E, S]`, reduced by max over shards). Every element must
/// be finite and positive: a bad shard must not vanish in the reduction.
fn read_input_scale(r: &TensorReader<'_>, name: &str, e: usize) -> Result<Option<Vec<f32>>> {
    if !r.contains(name) {
        return Ok(None);
    }
    let (v, shape) = r.f32_any(name)?;
    let shards = match shape.as_slice() {
        [n] if *n == e => 1,
        [n, s] if *n == e && *s > 0 => *s,
        _ => {
            return Err(r.err(
                name,
                format!("expected shape [{e}] or [{e}, S], got {shape:?}"),
            ))
        }
    };
    if let Some(i) = v.iter().position(|s| !(s.is_finite() && *s > 0.0)) {
        let at = if shape.len() == 1 {
            format!("expert {i}")
        } else {
            format!("expert {}, shard {}", i / shards, i % shards)
        };
        return Err(r.err(
            name,
            format!("input scale {} of {at} must be finite and positive", v[i]),
        ));
    }
    Ok(Some(
        v.chunks_exact(shards)
            .map(|c| c.iter().fold(0.0f32, |m, x| m.max(*x)))
            .collect(),
    ))
}

fn read_dense(r: &TensorReader<'_>, name: &str, rows: usize, cols: usize) -> Result<DenseWeight> {
    let v = r.f32(name, &[rows, cols])?;
    Ok(DenseWeight::Bf16 {
        rows,
        cols,
        data: v.iter().map(|&x| bf16::from_f32(x)).collect(),
    })
}

/// The shared expert's width `Is`, from `shared_w2_weight` `[H, Is]`; the shared expert exists
/// iff both `shared_w13_weight` and `shared_w2_weight` are present.
fn shared_width(r: &TensorReader<'_>, hidden: usize) -> Result<Option<usize>> {
    let (w13, w2) = ("shared_w13_weight", "shared_w2_weight");
    match (r.contains(w13), r.contains(w2)) {
        (false, false) => return Ok(None),
        (true, false) => {
            return Err(r.err(
                w2,
                format!("missing although `{w13}` is present (a shared expert needs both)"),
            ))
        }
        (false, true) => {
            return Err(r.err(
                w13,
                format!("missing although `{w2}` is present (a shared expert needs both)"),
            ))
        }
        (true, true) => {}
    }
    let s13 = r.shape(w13)?;
    if s13.len() != 2 {
        return Err(r.err(
            w13,
            format!("expected 2 dimensions [S*Is, {hidden}], got {s13:?}"),
        ));
    }
    let s2 = r.shape(w2)?;
    let [h, width] = s2[..] else {
        return Err(r.err(
            w2,
            format!("expected 2 dimensions [{hidden}, Is], got {s2:?}"),
        ));
    };
    if h != hidden {
        return Err(r.err(w2, format!("expected shape [{hidden}, Is], got {s2:?}")));
    }
    if width == 0 || width % 16 != 0 {
        return Err(r.err(
            w2,
            format!(
                "shared width Is = {width} (dimension 1) must be a positive multiple of 16 \
                 (the NVFP4 block size)"
            ),
        ));
    }
    Ok(Some(width))
}

/// Reads a layer file.
pub fn read(path: &Path) -> Result<LayerFile> {
    let bytes = tensor_io::read_file(path)?;
    let r = TensorReader::new(path, &bytes)?;
    let case_json = r.metadata("case").ok_or_else(|| {
        Error::file(
            path,
            "metadata key `case` (the layer configuration JSON) is missing",
        )
    })?;
    let case: CaseConfig = serde_json::from_str(case_json)
        .map_err(|e| Error::file(path, format!("metadata `case` is not valid: {e}")))?;
    let activation = Activation::from_name(&case.activation).ok_or_else(|| {
        Error::file(
            path,
            format!("case.activation `{}` is unknown", case.activation),
        )
    })?;
    let shards = activation.w13_shards();

    let w13_shape = r.shape("w13_weight")?;
    let [e, rows13, hb] = w13_shape[..] else {
        return Err(r.err(
            "w13_weight",
            format!("expected 3 dimensions [E, S*I, H/2], got {w13_shape:?}"),
        ));
    };
    for (dim, (n, what)) in [(e, "experts E"), (rows13, "rows S*I"), (hb, "H/2")]
        .into_iter()
        .enumerate()
    {
        if n == 0 {
            return Err(r.err(
                "w13_weight",
                format!("dimension {dim} ({what}) of shape {w13_shape:?} must be positive"),
            ));
        }
    }
    if rows13 % shards != 0 {
        return Err(r.err(
            "w13_weight",
            format!("{rows13} rows is not a multiple of {shards} shards ({activation})"),
        ));
    }
    let hidden = match hb.checked_mul(2) {
        Some(h) if h % 16 == 0 => h,
        Some(h) => {
            return Err(r.err(
                "w13_weight",
                format!(
                    "hidden size H = {h} (2 * dimension 2, H/2 = {hb}) must be a multiple of 16 \
                     (the NVFP4 block size)"
                ),
            ))
        }
        None => {
            return Err(r.err(
                "w13_weight",
                format!("dimension 2 (H/2 = {hb}) is too large"),
            ))
        }
    };
    let inter = rows13 / shards;
    if inter % 16 != 0 {
        return Err(r.err(
            "w13_weight",
            format!(
                "intermediate size I = {rows13} rows / {shards} shards = {inter} must be a \
                 multiple of 16 (the NVFP4 block size)"
            ),
        ));
    }
    let shared = shared_width(&r, hidden)?;
    let shape = LayerShape {
        hidden,
        intermediate: inter,
        experts: e,
    };
    let spec = case.to_spec(path, shape, shared)?;

    let w13 = read_stack(&r, "w13", e, rows13, hidden, shards)?;
    let w2 = read_stack(&r, "w2", e, hidden, inter, 1)?;
    let x_shape = r.shape("x")?;
    let tokens = match x_shape[..] {
        [t, h] if h == hidden => t,
        _ => {
            return Err(r.err(
                "x",
                format!("expected shape [T, {hidden}], got {x_shape:?}"),
            ))
        }
    };
    let x = r.f32("x", &[tokens, hidden])?;
    let bias = if r.contains("e_score_correction_bias") {
        Some(r.f32("e_score_correction_bias", &[e])?)
    } else {
        None
    };
    if case.bias && bias.is_none() {
        return Err(r.err(
            "e_score_correction_bias",
            "missing although case.bias is true",
        ));
    }
    let router_logits = if r.contains("router_logits") {
        Some(r.f32("router_logits", &[tokens, e])?)
    } else {
        None
    };
    let router = if r.contains("gate_weight") {
        Some(r.f32("gate_weight", &[e, hidden])?)
    } else {
        None
    };
    // Checked here too so that errors use the file's tensor names (validation says `router`).
    for (name, v, cols) in [
        ("e_score_correction_bias", &bias, e),
        ("gate_weight", &router, hidden),
    ] {
        if let Some(v) = v {
            check_finite(name, v, cols).map_err(|err| Error::file(path, err.to_string()))?;
        }
    }
    if router_logits.is_none() && router.is_none() {
        return Err(r.err(
            "router_logits",
            "missing, and there is no `gate_weight` to compute it from",
        ));
    }
    let shared = match shared {
        Some(w) => {
            let rows = shards.checked_mul(w).ok_or_else(|| {
                r.err("shared_w2_weight", format!("shared width {w} is too large"))
            })?;
            Some(SharedExpert {
                w13: read_dense(&r, "shared_w13_weight", rows, hidden)?,
                w2: read_dense(&r, "shared_w2_weight", hidden, w)?,
            })
        }
        None => None,
    };
    let k = spec.routing.top_k;
    let expected = Expected {
        topk_ids: r
            .contains("expected_topk_ids")
            .then(|| r.i32("expected_topk_ids", &[tokens, k]))
            .transpose()?,
        topk_weights: r
            .contains("expected_topk_weights")
            .then(|| r.f32("expected_topk_weights", &[tokens, k]))
            .transpose()?,
        output: r
            .contains("expected_output")
            .then(|| r.f32("expected_output", &[tokens, hidden]))
            .transpose()?,
    };
    let weights = MoeWeights {
        w13,
        w2,
        w13_input_scale: read_input_scale(&r, "w13_input_scale", e)?,
        w2_input_scale: read_input_scale(&r, "w2_input_scale", e)?,
        e_score_correction_bias: bias,
        router,
        shared,
    };
    weights
        .validate(&spec)
        .map_err(|err| Error::file(path, err.to_string()))?;
    Ok(LayerFile {
        name: if case.name.is_empty() {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        } else {
            case.name.clone()
        },
        spec,
        weights,
        x,
        tokens,
        router_logits,
        expected,
    })
}

fn stack_tensors(out: &mut Vec<(String, OwnedTensor)>, prefix: &str, s: &ExpertStack) {
    out.push((
        format!("{prefix}_weight"),
        OwnedTensor::bytes(
            Dtype::U8,
            vec![s.experts, s.rows, s.cols / 2],
            s.packed.clone(),
        ),
    ));
    out.push((
        format!("{prefix}_weight_scale"),
        OwnedTensor::bytes(
            Dtype::F8_E4M3,
            vec![s.experts, s.rows, s.cols / 16],
            s.scales.clone(),
        ),
    ));
    let s2_shape = if prefix == "w2" {
        vec![s.experts]
    } else {
        vec![s.experts, s.shards]
    };
    out.push((
        format!("{prefix}_weight_scale_2"),
        OwnedTensor::f32(s2_shape, &s.scale_2),
    ));
}

fn dense_tensor(w: &DenseWeight) -> OwnedTensor {
    match w {
        DenseWeight::Bf16 { rows, cols, data } => OwnedTensor::bf16(vec![*rows, *cols], data),
        DenseWeight::Nvfp4(s) => {
            let d = s.dequantize_expert(0);
            OwnedTensor::f32(vec![s.rows, s.cols], &d)
        }
    }
}

/// Writes a layer file (atomically).
pub fn write(path: &Path, lf: &LayerFile) -> Result<()> {
    let (t, h, e, k) = (
        lf.tokens,
        lf.spec.shape.hidden,
        lf.spec.shape.experts,
        lf.spec.routing.top_k,
    );
    let w = &lf.weights;
    let mut out = Vec::new();
    stack_tensors(&mut out, "w13", &w.w13);
    stack_tensors(&mut out, "w2", &w.w2);
    for (name, v) in [
        ("w13_input_scale", &w.w13_input_scale),
        ("w2_input_scale", &w.w2_input_scale),
        ("e_score_correction_bias", &w.e_score_correction_bias),
    ] {
        if let Some(v) = v {
            out.push((name.to_string(), OwnedTensor::f32(vec![e], v)));
        }
    }
    if let Some(r) = &w.router {
        out.push(("gate_weight".into(), OwnedTensor::f32(vec![e, h], r)));
    }
    if let Some(sh) = &w.shared {
        out.push(("shared_w13_weight".into(), dense_tensor(&sh.w13)));
        out.push(("shared_w2_weight".into(), dense_tensor(&sh.w2)));
    }
    out.push(("x".into(), OwnedTensor::f32(vec![t, h], &lf.x)));
    if let Some(l) = &lf.router_logits {
        out.push(("router_logits".into(), OwnedTensor::f32(vec![t, e], l)));
    }
    if let Some(v) = &lf.expected.topk_ids {
        out.push(("expected_topk_ids".into(), OwnedTensor::i32(vec![t, k], v)));
    }
    if let Some(v) = &lf.expected.topk_weights {
        out.push((
            "expected_topk_weights".into(),
            OwnedTensor::f32(vec![t, k], v),
        ));
    }
    if let Some(v) = &lf.expected.output {
        out.push(("expected_output".into(), OwnedTensor::f32(vec![t, h], v)));
    }
    let case = CaseConfig::from_spec(&lf.name, &lf.spec, w.e_score_correction_bias.is_some());
    let json = serde_json::to_string(&case).map_err(|e| Error::file(path, e.to_string()))?;
    tensor_io::write_tensors(
        path,
        &out,
        Some(HashMap::from([("case".to_string(), json)])),
    )
}

/// Writes the results of `run-layer`: `output` F32 `[T, H]`, `topk_ids` I32 `[T, k]`,
/// `topk_weights` F32 `[T, k]`.
pub fn write_outputs(
    path: &Path,
    output: &[f32],
    topk: &crate::routing::TopK,
    hidden: usize,
) -> Result<()> {
    let t = topk.tokens;
    let tensors = vec![
        (
            "output".to_string(),
            OwnedTensor::f32(vec![t, hidden], output),
        ),
        (
            "topk_ids".to_string(),
            OwnedTensor::i32(vec![t, topk.k], &topk.ids),
        ),
        (
            "topk_weights".to_string(),
            OwnedTensor::f32(vec![t, topk.k], &topk.weights),
        ),
    ];
    tensor_io::write_tensors(path, &tensors, None)
}
