//! NVFP4 tensors and ModelOpt's weight quantizer (DESIGN 1, 1.1).
//!
//! A row-major `[rows, cols]` tensor is stored as
//! - `packed`: `[rows, cols/2]` bytes of E2M1 pairs (even column in the low nibble),
//! - `scales`: `[rows, cols/16]` E4M3 block scales in the linear layout,
//! - `scale_2`: the per-tensor dequant multiplier (`amax / 2688`, the on-disk convention).
//!
//! Dequantization: `x̂[r, c] = e2m1(q[r, c]) · f32(S[r, c/16]) · scale_2`.
//!
//! Quantization (f32, in this order): `scale_2 = amax / 2688`; per block
//! `s = block_amax / (6 · scale_2)`, `s = 1` if `s == 0`, `s = max(s, 2^-9)`, `S = e4m3_rne(s)`;
//! per element `v = w / (f32(S) · scale_2)`, code = E2M1 RNE of `|v|` saturating at 6, sign iff
//! `w < 0`. An all-zero tensor has `amax = 0`: we store `scale_2 = 0`, every block scale 1.0 and
//! every code 0, so it dequantizes to exact zeros instead of the NaNs `0 / 0` would give.

use super::{e2m1, e4m3, FormatError, BLOCK};

/// `6 · 448`: the largest representable |value| of a tensor with unit `scale_2`.
pub const NVFP4_RANGE: f32 = 2688.0;
/// ModelOpt's lower clamp on weight block scales (the smallest E4M3 subnormal).
pub const MIN_WEIGHT_BLOCK_SCALE: f32 = 1.0 / 512.0;

/// One NVFP4 matrix with its two-level scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Tensor {
    pub rows: usize,
    pub cols: usize,
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
    pub scale_2: f32,
}

/// Checks that `cols` is a positive multiple of the block size.
pub fn check_cols(tensor: &str, cols: usize) -> Result<(), FormatError> {
    if cols == 0 || cols % BLOCK != 0 {
        return Err(FormatError::ColsNotMultipleOf16 {
            tensor: tensor.to_string(),
            cols,
        });
    }
    Ok(())
}

/// Index of the first non-finite value, reported as `(row, col)`.
pub fn check_finite(tensor: &str, data: &[f32], cols: usize) -> Result<(), FormatError> {
    match data.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(FormatError::NonFinite {
            tensor: tensor.to_string(),
            row: i / cols.max(1),
            col: i % cols.max(1),
            value: data[i],
        }),
    }
}

/// ModelOpt's per-block scale for a block whose absolute max is `block_amax`.
#[inline]
pub fn weight_block_scale(block_amax: f32, scale_2: f32) -> u8 {
    let mut s = block_amax / (6.0 * scale_2);
    if s == 0.0 {
        s = 1.0;
    }
    e4m3::encode_sat(s.max(MIN_WEIGHT_BLOCK_SCALE))
}

/// Quantizes one row with a known `scale_2`, writing `cols/2` packed bytes and `cols/16` scales.
pub fn quantize_row_with_scale_2(row: &[f32], scale_2: f32, packed: &mut [u8], scales: &mut [u8]) {
    for ((block, out), sc) in row
        .chunks_exact(BLOCK)
        .zip(packed.chunks_exact_mut(BLOCK / 2))
        .zip(scales.iter_mut())
    {
        let block_amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (s_byte, denom) = if scale_2 == 0.0 {
            (e4m3::encode_sat(1.0), f32::INFINITY) // all-zero tensor: codes 0
        } else {
            let b = weight_block_scale(block_amax, scale_2);
            (b, e4m3::decode(b) * scale_2)
        };
        *sc = s_byte;
        for (pair, o) in block.chunks_exact(2).zip(out.iter_mut()) {
            let lo = e2m1::encode(pair[0] / denom, pair[0] < 0.0);
            let hi = e2m1::encode(pair[1] / denom, pair[1] < 0.0);
            *o = e2m1::pack(lo, hi);
        }
    }
}

/// `amax / 2688` in f32, the ModelOpt per-tensor scale.
pub fn weight_scale_2(amax: f32) -> f32 {
    amax / NVFP4_RANGE
}

/// Absolute maximum of a slice (0 for an empty one).
pub fn amax(data: &[f32]) -> f32 {
    data.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

impl Nvfp4Tensor {
    /// Quantizes a finite row-major `[rows, cols]` matrix with ModelOpt's recipe.
    /// `tensor` names the data in errors.
    pub fn quantize(
        tensor: &str,
        data: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Self, FormatError> {
        check_cols(tensor, cols)?;
        if data.len() != rows * cols {
            return Err(FormatError::Shape {
                tensor: tensor.to_string(),
                expected: vec![rows, cols],
                got: vec![data.len()],
            });
        }
        check_finite(tensor, data, cols)?;
        let scale_2 = weight_scale_2(amax(data));
        Ok(Self::quantize_with_scale_2(data, rows, cols, scale_2))
    }

    /// Quantizes finite data against a given per-tensor `scale_2` (used when several
    /// shards must share one, or to reproduce an existing checkpoint's scale).
    pub fn quantize_with_scale_2(data: &[f32], rows: usize, cols: usize, scale_2: f32) -> Self {
        let mut packed = vec![0u8; rows * cols / 2];
        let mut scales = vec![0u8; rows * cols / BLOCK];
        for ((row, p), s) in data
            .chunks_exact(cols)
            .zip(packed.chunks_exact_mut(cols / 2))
            .zip(scales.chunks_exact_mut(cols / BLOCK))
        {
            quantize_row_with_scale_2(row, scale_2, p, s);
        }
        Self {
            rows,
            cols,
            packed,
            scales,
            scale_2,
        }
    }

    /// Wraps existing parts after checking their sizes and scale bytes.
    pub fn from_parts(
        tensor: &str,
        rows: usize,
        cols: usize,
        packed: Vec<u8>,
        scales: Vec<u8>,
        scale_2: f32,
    ) -> Result<Self, FormatError> {
        check_cols(tensor, cols)?;
        if packed.len() != rows * cols / 2 {
            return Err(FormatError::Shape {
                tensor: format!("{tensor}.weight"),
                expected: vec![rows, cols / 2],
                got: vec![packed.len()],
            });
        }
        if scales.len() != rows * cols / BLOCK {
            return Err(FormatError::Shape {
                tensor: format!("{tensor}.weight_scale"),
                expected: vec![rows, cols / BLOCK],
                got: vec![scales.len()],
            });
        }
        check_scale_bytes(&format!("{tensor}.weight_scale"), &scales, cols / BLOCK)?;
        if !scale_2.is_finite() || scale_2 < 0.0 {
            return Err(FormatError::BadScale {
                tensor: format!("{tensor}.weight_scale_2"),
                value: scale_2,
            });
        }
        Ok(Self {
            rows,
            cols,
            packed,
            scales,
            scale_2,
        })
    }

    /// Dequantizes row `r` into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let p = &self.packed[r * self.cols / 2..(r + 1) * self.cols / 2];
        let s = &self.scales[r * self.cols / BLOCK..(r + 1) * self.cols / BLOCK];
        dequantize_row(p, s, self.scale_2, out);
    }

    /// The whole matrix in f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(r, o);
        }
        out
    }
}

/// Rejects E4M3 NaN bytes in block scales, naming the first one's position.
pub fn check_scale_bytes(
    tensor: &str,
    scales: &[u8],
    scale_cols: usize,
) -> Result<(), FormatError> {
    match scales
        .iter()
        .position(|&b| e4m3::is_nan(b) || b & 0x80 != 0)
    {
        None => Ok(()),
        Some(i) => Err(FormatError::BadScaleByte {
            tensor: tensor.to_string(),
            row: i / scale_cols.max(1),
            col: i % scale_cols.max(1),
            byte: scales[i],
        }),
    }
}

const NIBBLE: [f32; 16] = e2m1::decode_table();

/// Dequantizes one packed row: `out[c] = (e2m1(q) · f32(S)) · scale_2` in f32.
///
/// `e2m1 · S` is exact, so each value is the exact product rounded once; multiplying by a
/// pre-rounded `S · scale_2` instead would round twice and miss by an ulp. A 16-entry table per
/// block keeps the cost at one multiply per element.
#[inline]
pub fn dequantize_row(packed: &[u8], scales: &[u8], scale_2: f32, out: &mut [f32]) {
    for ((p, &s), o) in packed
        .chunks_exact(BLOCK / 2)
        .zip(scales)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        let sf = e4m3::decode(s);
        let table = NIBBLE.map(|v| v * sf * scale_2);
        for (b, pair) in p.iter().zip(o.chunks_exact_mut(2)) {
            pair[0] = table[(b & 0xF) as usize];
            pair[1] = table[(b >> 4) as usize];
        }
    }
}

/// Like [`dequantize_row`] but without `scale_2` (so the values are exact: `e2m1 · S`).
#[inline]
pub fn dequantize_row_unit(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    for ((p, &s), o) in packed
        .chunks_exact(BLOCK / 2)
        .zip(scales)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        let f = e4m3::decode(s);
        for (b, pair) in p.iter().zip(o.chunks_exact_mut(2)) {
            pair[0] = NIBBLE[(b & 0xF) as usize] * f;
            pair[1] = NIBBLE[(b >> 4) as usize] * f;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchor_block_from_design() {
        // A block whose amax sets scale_2 gets S = 448 and codes that reach ±6.
        let row: Vec<f32> = (0..16).map(|i| -7.5 + i as f32).collect();
        let t = Nvfp4Tensor::quantize("anchor", &row, 1, 16).unwrap();
        assert_eq!(t.scales, vec![0x7E]);
        assert_eq!(t.scale_2, 7.5 / 2688.0);
        let d = t.dequantize();
        assert_eq!(d[0], -6.0 * 448.0 * t.scale_2);
        assert_eq!(d[8], (0.5 * 448.0) * t.scale_2);
        assert_eq!(d[15], 6.0 * 448.0 * t.scale_2);
    }

    #[test]
    fn non_finite_names_the_index() {
        let mut v = vec![1.0f32; 64];
        v[37] = f32::NAN;
        let e = Nvfp4Tensor::quantize("w", &v, 2, 32).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor `w`: non-finite value NaN at [1, 5]; NVFP4 cannot represent it"
        );
    }

    #[test]
    fn all_zero_tensor_dequantizes_to_zero() {
        let t = Nvfp4Tensor::quantize("z", &[0.0; 32], 1, 32).unwrap();
        assert_eq!(t.scale_2, 0.0);
        assert!(t.dequantize().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn cols_must_be_multiple_of_16() {
        assert!(matches!(
            Nvfp4Tensor::quantize("w", &[1.0; 24], 1, 24),
            Err(FormatError::ColsNotMultipleOf16 { cols: 24, .. })
        ));
    }
}
