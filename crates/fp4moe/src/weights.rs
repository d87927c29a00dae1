//! The weights of one MoE layer in the fused vLLM/ModelOpt layout (DESIGN 2, 6).
//!
//! - `w13`: `[E, S·I, H]` NVFP4 (S = 2 gated: rows `[gate; up]`; S = 1 non-gated: `up`), with one
//!   `scale_2` per expert **and shard** (`[E, S]`), so gate and up dequantize exactly.
//! - `w2`: `[E, H, I]` NVFP4, `scale_2` `[E]`.
//! - W4A4 input scales (dequant convention, `amax / 2688`) `[E]` for w13 and w2.
//! - optional routing bias `[E]`, router gate `[E, H]` (f32) and shared expert.

use crate::format::nvfp4::{self, Nvfp4Tensor};
use crate::format::{FormatError, BLOCK};
use crate::spec::{Intermediate, MoeSpec, QuantMode, SpecError};
use half::bf16;
use rayon::prelude::*;

/// `E` stacked NVFP4 matrices `[rows, cols]`; rows split into `shards` equal parts that each
/// carry their own `scale_2`.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertStack {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub shards: usize,
    /// `[E, rows, cols/2]`.
    pub packed: Vec<u8>,
    /// `[E, rows, cols/16]` E4M3 bytes, linear layout.
    pub scales: Vec<u8>,
    /// `[E, shards]`, dequant convention.
    pub scale_2: Vec<f32>,
}

impl ExpertStack {
    /// Quantizes `experts` matrices produced by `fill(e, buf)` (buf: `rows·cols` f32) with the
    /// ModelOpt recipe, one `scale_2` per shard, in parallel over experts. Only one f32 matrix per
    /// worker thread exists at a time.
    pub fn quantize_with<F>(
        tensor: &str,
        experts: usize,
        rows: usize,
        cols: usize,
        shards: usize,
        fill: F,
    ) -> Result<Self, FormatError>
    where
        F: Fn(usize, &mut [f32]) + Sync,
    {
        nvfp4::check_cols(tensor, cols)?;
        if shards == 0 || rows % shards != 0 {
            return Err(FormatError::Shape {
                tensor: tensor.to_string(),
                expected: vec![shards, rows / shards.max(1)],
                got: vec![rows],
            });
        }
        // Zero experts or rows (an empty stack) and sizes that overflow are shape errors.
        let per = rows.checked_mul(cols);
        if experts == 0 || rows == 0 || per.and_then(|p| p.checked_mul(experts)).is_none() {
            return Err(FormatError::Shape {
                tensor: tensor.to_string(),
                expected: vec![experts.max(1), rows.max(shards), cols],
                got: vec![experts, rows, cols],
            });
        }
        let per = rows * cols;
        let parts: Vec<Result<Vec<Nvfp4Tensor>, FormatError>> = (0..experts)
            .into_par_iter()
            .map_init(
                || vec![0.0f32; per],
                |buf, e| {
                    fill(e, buf);
                    let name = format!("{tensor}[{e}]");
                    buf.chunks_exact(per / shards)
                        .map(|shard| Nvfp4Tensor::quantize(&name, shard, rows / shards, cols))
                        .collect()
                },
            )
            .collect();
        let mut s = Self {
            experts,
            rows,
            cols,
            shards,
            packed: Vec::with_capacity(experts * per / 2),
            scales: Vec::with_capacity(experts * per / BLOCK),
            scale_2: Vec::with_capacity(experts * shards),
        };
        for p in parts {
            for t in p? {
                s.packed.extend_from_slice(&t.packed);
                s.scales.extend_from_slice(&t.scales);
                s.scale_2.push(t.scale_2);
            }
        }
        Ok(s)
    }

    /// Checks sizes, scale bytes and scale_2 values; `tensor` names the stack in errors.
    pub fn validate(&self, tensor: &str) -> Result<(), FormatError> {
        nvfp4::check_cols(tensor, self.cols)?;
        if self.shards == 0 || self.rows % self.shards != 0 {
            // Rows split into `shards` equal parts, each with its own scale_2.
            return Err(FormatError::Shape {
                tensor: format!("{tensor}_weight"),
                expected: vec![self.shards, self.rows / self.shards.max(1)],
                got: vec![self.rows],
            });
        }
        let checks = [
            (
                "weight",
                self.packed.len(),
                vec![self.experts, self.rows, self.cols / 2],
            ),
            (
                "weight_scale",
                self.scales.len(),
                vec![self.experts, self.rows, self.cols / BLOCK],
            ),
            (
                "weight_scale_2",
                self.scale_2.len(),
                vec![self.experts, self.shards],
            ),
        ];
        for (suffix, len, shape) in checks {
            if Some(len) != shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b)) {
                return Err(FormatError::Shape {
                    tensor: format!("{tensor}_{suffix}"),
                    expected: shape,
                    got: vec![len],
                });
            }
        }
        nvfp4::check_scale_bytes(
            &format!("{tensor}_weight_scale"),
            &self.scales,
            self.scale_cols(),
        )?;
        if let Some(&v) = self.scale_2.iter().find(|v| !v.is_finite() || **v < 0.0) {
            return Err(FormatError::BadScale {
                tensor: format!("{tensor}_weight_scale_2"),
                value: v,
            });
        }
        Ok(())
    }

    pub fn row_bytes(&self) -> usize {
        self.cols / 2
    }

    pub fn scale_cols(&self) -> usize {
        self.cols / BLOCK
    }

    /// Packed bytes, scale bytes and `scale_2` of row `r` of expert `e`.
    #[inline]
    pub fn row(&self, e: usize, r: usize) -> (&[u8], &[u8], f32) {
        let i = e * self.rows + r;
        let rb = self.row_bytes();
        let sc = self.scale_cols();
        let shard = r / (self.rows / self.shards);
        (
            &self.packed[i * rb..(i + 1) * rb],
            &self.scales[i * sc..(i + 1) * sc],
            self.scale_2[e * self.shards + shard],
        )
    }

    /// Expert `e` dequantized to f32 `[rows, cols]`.
    pub fn dequantize_expert(&self, e: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            let (p, s, s2) = self.row(e, r);
            nvfp4::dequantize_row(p, s, s2, o);
        }
        out
    }

    /// Bytes of one expert (packed values and block scales).
    pub fn expert_bytes(&self) -> usize {
        self.rows * (self.row_bytes() + self.scale_cols())
    }
}

/// A dense projection of the shared expert.
#[derive(Clone, Debug, PartialEq)]
pub enum DenseWeight {
    /// `[rows, cols]` bf16, used as is.
    Bf16 {
        rows: usize,
        cols: usize,
        data: Vec<bf16>,
    },
    /// One NVFP4 matrix (`experts == 1`), dequantized (weight-only).
    Nvfp4(ExpertStack),
}

impl DenseWeight {
    pub fn rows(&self) -> usize {
        match self {
            DenseWeight::Bf16 { rows, .. } => *rows,
            DenseWeight::Nvfp4(s) => s.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            DenseWeight::Bf16 { cols, .. } => *cols,
            DenseWeight::Nvfp4(s) => s.cols,
        }
    }

    /// Row `r` in f32.
    #[inline]
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            DenseWeight::Bf16 { cols, data, .. } => {
                for (o, v) in out.iter_mut().zip(&data[r * cols..(r + 1) * cols]) {
                    *o = v.to_f32();
                }
            }
            DenseWeight::Nvfp4(s) => {
                let (p, sc, s2) = s.row(0, r);
                nvfp4::dequantize_row(p, sc, s2, out);
            }
        }
    }

    /// Checks shape `[rows, cols]` and, for NVFP4, one expert with `shards` scale_2 shards and
    /// valid scales; `tensor` names the weight in errors.
    fn check(
        &self,
        tensor: &str,
        rows: usize,
        cols: usize,
        shards: usize,
    ) -> Result<(), crate::Error> {
        if self.rows() != rows || self.cols() != cols {
            return Err(shape_err(tensor, vec![rows, cols], vec![self.rows(), self.cols()]).into());
        }
        match self {
            DenseWeight::Bf16 { data, .. } => {
                if Some(data.len()) != rows.checked_mul(cols) {
                    return Err(shape_err(tensor, vec![rows, cols], vec![data.len()]).into());
                }
            }
            DenseWeight::Nvfp4(s) => {
                if s.experts != 1 {
                    return Err(shape_err(
                        tensor,
                        vec![1, rows, cols],
                        vec![s.experts, s.rows, s.cols],
                    )
                    .into());
                }
                if s.shards != shards {
                    return Err(shape_err(
                        &format!("{tensor}_weight_scale_2"),
                        vec![1, shards],
                        vec![s.experts, s.shards],
                    )
                    .into());
                }
                s.validate(tensor)?;
            }
        }
        Ok(())
    }
}

/// The shared expert: a dense MLP with the layer's activation on the unquantized input.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedExpert {
    /// `[S·Is, H]` (`[gate; up]` when gated).
    pub w13: DenseWeight,
    /// `[H, Is]`.
    pub w2: DenseWeight,
}

/// All weights of one MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeWeights {
    pub w13: ExpertStack,
    pub w2: ExpertStack,
    pub w13_input_scale: Option<Vec<f32>>,
    pub w2_input_scale: Option<Vec<f32>>,
    pub e_score_correction_bias: Option<Vec<f32>>,
    /// Router gate `[E, H]` in f32; needed only when logits are not given.
    pub router: Option<Vec<f32>>,
    pub shared: Option<SharedExpert>,
}

fn shape_err(tensor: &str, expected: Vec<usize>, got: Vec<usize>) -> SpecError {
    SpecError::Shape {
        tensor: tensor.to_string(),
        expected,
        got,
    }
}

fn check_input_scales(tensor: &'static str, v: &[f32], experts: usize) -> Result<(), SpecError> {
    if v.len() != experts {
        return Err(shape_err(tensor, vec![experts], vec![v.len()]));
    }
    match v.iter().position(|s| !(s.is_finite() && *s > 0.0)) {
        Some(e) => Err(SpecError::BadInputScale {
            tensor,
            expert: e,
            value: v[e],
        }),
        None => Ok(()),
    }
}

impl MoeWeights {
    /// Checks that the weights match `spec` (shapes, shards, scales the mode needs).
    pub fn validate(&self, spec: &MoeSpec) -> Result<(), crate::Error> {
        spec.validate()?;
        let (h, i, e) = (
            spec.shape.hidden,
            spec.shape.intermediate,
            spec.shape.experts,
        );
        let s = spec.activation.w13_shards();
        self.w13.validate("w13")?;
        self.w2.validate("w2")?;
        let rows13 = s.saturating_mul(i);
        if (
            self.w13.experts,
            self.w13.rows,
            self.w13.cols,
            self.w13.shards,
        ) != (e, rows13, h, s)
        {
            return Err(shape_err(
                "w13_weight",
                vec![e, rows13, h],
                vec![self.w13.experts, self.w13.rows, self.w13.cols],
            )
            .into());
        }
        if (self.w2.experts, self.w2.rows, self.w2.cols, self.w2.shards) != (e, h, i, 1) {
            return Err(shape_err(
                "w2_weight",
                vec![e, h, i],
                vec![self.w2.experts, self.w2.rows, self.w2.cols],
            )
            .into());
        }
        if let QuantMode::W4A4 { intermediate } = spec.quant {
            let a1 = self
                .w13_input_scale
                .as_deref()
                .ok_or(SpecError::MissingInputScales {
                    tensor: "w13_input_scale",
                })?;
            check_input_scales("w13_input_scale", a1, e)?;
            if intermediate == Intermediate::Static {
                let a2 = self
                    .w2_input_scale
                    .as_deref()
                    .ok_or(SpecError::MissingInputScales {
                        tensor: "w2_input_scale",
                    })?;
                check_input_scales("w2_input_scale", a2, e)?;
            }
        }
        if let Some(b) = &self.e_score_correction_bias {
            if b.len() != e {
                return Err(shape_err("e_score_correction_bias", vec![e], vec![b.len()]).into());
            }
            // A NaN bias would sort first and silently take over routing.
            nvfp4::check_finite("e_score_correction_bias", b, e)?;
        }
        if let Some(r) = &self.router {
            if Some(r.len()) != e.checked_mul(h) {
                return Err(shape_err("router", vec![e, h], vec![r.len()]).into());
            }
            nvfp4::check_finite("router", r, h)?;
        }
        match (spec.shared_intermediate, &self.shared) {
            (Some(w), Some(sh)) => {
                let rows = s.saturating_mul(w);
                sh.w13.check("shared_experts.w13", rows, h, s)?;
                sh.w2.check("shared_experts.w2", h, w, 1)?;
            }
            (Some(w), None) => return Err(SpecError::MissingShared(w).into()),
            (None, Some(_)) => return Err(SpecError::UnexpectedShared.into()),
            (None, None) => {}
        }
        Ok(())
    }

    /// `(gs1, gs2)` of a quant mode: none in W4A16; in W4A4 the input's and the
    /// intermediate's global scales (below).
    pub fn global_scales(&self, quant: crate::spec::QuantMode) -> (Option<f32>, Option<f32>) {
        match quant {
            crate::spec::QuantMode::W4A16 => (None, None),
            crate::spec::QuantMode::W4A4 { intermediate } => (
                self.input_global_scale(),
                self.intermediate_global_scale(intermediate),
            ),
        }
    }

    /// `gs1 = 1 / max_e input_scale(w13)`: one global scale for the layer's input QDQ.
    pub fn input_global_scale(&self) -> Option<f32> {
        self.w13_input_scale
            .as_ref()
            .map(|v| 1.0 / v.iter().fold(0.0f32, |m, s| m.max(*s)))
    }

    /// `gs2` for the intermediate QDQ: `1 / max_e input_scale(w2)` (static) or 1 (dynamic).
    pub fn intermediate_global_scale(&self, intermediate: Intermediate) -> Option<f32> {
        match intermediate {
            Intermediate::Dynamic => Some(1.0),
            Intermediate::Static => self
                .w2_input_scale
                .as_ref()
                .map(|v| 1.0 / v.iter().fold(0.0f32, |m, s| m.max(*s))),
        }
    }
}
