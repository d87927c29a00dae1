//! `quantize-tensors`: every 2-D BF16/F32 tensor `NAME` of a safetensors file becomes
//! `NAME.weight` (U8 `[r, c/2]`), `NAME.weight_scale` (F8_E4M3 `[r, c/16]`) and
//! `NAME.weight_scale_2` (F32, 0-d) with the ModelOpt recipe. A trailing `.weight` in `NAME` is
//! dropped first, so `x.up_proj.weight` becomes `x.up_proj.weight{,_scale,_scale_2}` as in
//! ModelOpt checkpoints. Any other tensor (other dtype or rank, columns not a multiple of 16,
//! non-finite values) is an error naming it, as are two tensors that would share an output name
//! (`a` and `a.weight`); nothing is written then.

use crate::checkpoint::write::projection_tensors;
use crate::error::{Error, Result};
use crate::format::Nvfp4Tensor;
use crate::tensor_io::{self, TensorReader};
use rayon::prelude::*;
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::path::Path;

/// One quantized tensor's summary.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub scale_2: f32,
}

/// The output base name of input tensor `name`: `name` without a trailing `.weight`.
fn base_name(name: &str) -> &str {
    name.strip_suffix(".weight").unwrap_or(name)
}

/// Quantizes `input` into `output` (written atomically).
pub fn quantize_tensors(input: &Path, output: &Path) -> Result<Vec<Quantized>> {
    let bytes = tensor_io::read_file(input)?;
    let r = TensorReader::new(input, &bytes)?;
    let names = r.names();
    let mut bad = Vec::new();
    for n in &names {
        let v = r.view(n)?;
        if !matches!(v.dtype(), Dtype::BF16 | Dtype::F32) || v.shape().len() != 2 {
            bad.push(format!("`{n}` ({} {:?})", v.dtype(), v.shape()));
        }
    }
    if !bad.is_empty() {
        return Err(Error::File {
            path: input.to_path_buf(),
            message: format!(
                "only 2-D BF16/F32 tensors can be quantized; not: {}",
                bad.join(", ")
            ),
        });
    }
    let mut bases: BTreeMap<&str, &str> = BTreeMap::new();
    let mut collisions = Vec::new();
    for n in &names {
        if let Some(first) = bases.insert(base_name(n), n) {
            collisions.push(format!(
                "`{first}` and `{n}` (both would become `{}.weight`)",
                base_name(n)
            ));
        }
    }
    if !collisions.is_empty() {
        return Err(Error::File {
            path: input.to_path_buf(),
            message: format!(
                "tensors with the same name apart from a trailing `.weight` cannot both be \
                 quantized: {}",
                collisions.join(", ")
            ),
        });
    }
    let results: Vec<Result<(Quantized, Nvfp4Tensor)>> = names
        .par_iter()
        .map(|n| {
            let (data, shape) = r.f32_any(n)?;
            let t =
                Nvfp4Tensor::quantize(n, &data, shape[0], shape[1]).map_err(|e| Error::File {
                    path: input.to_path_buf(),
                    message: e.to_string(),
                })?;
            let base = base_name(n).to_string();
            Ok((
                Quantized {
                    name: base,
                    rows: shape[0],
                    cols: shape[1],
                    scale_2: t.scale_2,
                },
                t,
            ))
        })
        .collect();
    let mut out = Vec::new();
    let mut summary = Vec::new();
    for res in results {
        let (q, t) = res?;
        out.extend(projection_tensors(
            &q.name, q.rows, q.cols, t.packed, t.scales, t.scale_2, None,
        ));
        summary.push(q);
    }
    tensor_io::write_tensors(output, &out, None)?;
    Ok(summary)
}
