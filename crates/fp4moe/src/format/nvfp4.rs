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
///
/// On x86-64 CPUs with AVX2 (checked at run time) the table is built with two vector multiplies
/// per half and read with `vpermps`; every output bit is the same as the portable loop's for
/// every input loading admits (see the module's tests; for the two NaN scale bytes, which
/// loading rejects, both give NaN with an unspecified sign).
#[inline]
pub fn dequantize_row(packed: &[u8], scales: &[u8], scale_2: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(a) = avx2::Avx2::detect() {
        return a.dequantize_row(packed, scales, scale_2, out);
    }
    dequantize_row_portable(packed, scales, scale_2, out)
}

/// [`dequantize_row`] with scalar table lookups: the definition the AVX2 version must match.
#[inline]
fn dequantize_row_portable(packed: &[u8], scales: &[u8], scale_2: f32, out: &mut [f32]) {
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{e4m3, BLOCK, NIBBLE};
    use std::arch::x86_64::{
        __m128i, __m256, __m256i, _mm256_blendv_ps, _mm256_castsi256_ps, _mm256_cvtepu8_epi32,
        _mm256_loadu_ps, _mm256_mul_ps, _mm256_permutevar8x32_ps, _mm256_set1_ps,
        _mm256_slli_epi32, _mm256_storeu_ps, _mm_and_si128, _mm_loadl_epi64, _mm_set1_epi8,
        _mm_srli_epi16, _mm_unpackhi_epi64, _mm_unpacklo_epi8,
    };

    /// Proof that the CPU has AVX2: only `Avx2::detect` makes one.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2(());

    impl Avx2 {
        #[inline]
        pub(super) fn detect() -> Option<Self> {
            std::arch::is_x86_feature_detected!("avx2").then_some(Avx2(()))
        }

        /// [`super::dequantize_row`] on AVX2.
        #[inline]
        pub(super) fn dequantize_row(
            self,
            packed: &[u8],
            scales: &[u8],
            scale_2: f32,
            out: &mut [f32],
        ) {
            // SAFETY: an `Avx2` exists only where AVX2 was detected.
            unsafe { dequantize_row(packed, scales, scale_2, out) }
        }
    }

    /// Values of the eight output lanes: entry `idx & 7` of `lo` where bit 3 of `idx` is clear,
    /// of `hi` where it is set.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn lookup(lo: __m256, hi: __m256, idx: __m256i) -> __m256 {
        // `vpermps` reads the low three bits of each index; `vblendvps` the sign bit, where the
        // shift puts bit 3.
        let a = _mm256_permutevar8x32_ps(lo, idx);
        let b = _mm256_permutevar8x32_ps(hi, idx);
        _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx)))
    }

    /// The portable loop's table, `(v · sf) · scale_2` per entry, as two halves of eight: the
    /// same two roundings per lane (`vmulps` rounds like `mulss`; no FMA, no flush to zero),
    /// so signed zeros (`+0.0` for code 8), infinities and subnormals come out as in the scalar
    /// table.
    ///
    /// The 16 nibbles of a block in output order (low nibble of byte `j` is value `2j`) become
    /// two vectors of 32-bit indices, each looked up in both halves and blended on bit 3.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn dequantize_row(packed: &[u8], scales: &[u8], scale_2: f32, out: &mut [f32]) {
        // SAFETY: `NIBBLE` holds sixteen floats; each load reads eight of them.
        let (nib_lo, nib_hi) = unsafe {
            (
                _mm256_loadu_ps(NIBBLE.as_ptr()),
                _mm256_loadu_ps(NIBBLE[8..].as_ptr()),
            )
        };
        let s2 = _mm256_set1_ps(scale_2);
        let low4 = _mm_set1_epi8(0x0F);
        for ((p, &s), o) in packed
            .chunks_exact(BLOCK / 2)
            .zip(scales)
            .zip(out.chunks_exact_mut(BLOCK))
        {
            let sf = _mm256_set1_ps(e4m3::decode(s));
            let t_lo = _mm256_mul_ps(_mm256_mul_ps(nib_lo, sf), s2);
            let t_hi = _mm256_mul_ps(_mm256_mul_ps(nib_hi, sf), s2);
            // SAFETY: `p` holds the eight bytes read (an unaligned 64-bit load).
            let bytes = unsafe { _mm_loadl_epi64(p.as_ptr().cast::<__m128i>()) };
            let even = _mm_and_si128(bytes, low4);
            let odd = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low4);
            let nibbles = _mm_unpacklo_epi8(even, odd);
            let (i0, i1) = (
                _mm256_cvtepu8_epi32(nibbles),
                _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(nibbles, nibbles)),
            );
            // SAFETY: this function runs only where AVX2 was detected.
            let (first, second) = unsafe { (lookup(t_lo, t_hi, i0), lookup(t_lo, t_hi, i1)) };
            // SAFETY: `o` holds sixteen floats; each store writes eight of them.
            unsafe {
                _mm256_storeu_ps(o.as_mut_ptr(), first);
                _mm256_storeu_ps(o[8..].as_mut_ptr(), second);
            }
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
    use rand::{rngs::SmallRng, RngCore, SeedableRng};

    /// Runs `dequantize_row` (and the AVX2 version by name where the CPU has AVX2) and the
    /// portable definition on the same row and compares the bits of the whole output buffer
    /// (filled with a NaN sentinel first, so values not written show).
    fn assert_same_bits(packed: &[u8], scales: &[u8], scale_2: f32, len: usize, what: &str) {
        let sentinel = f32::from_bits(0x7FC0_1234);
        let mut want = vec![sentinel; len];
        dequantize_row_portable(packed, scales, scale_2, &mut want);
        // One path's output, written over the sentinel, against the portable one.
        let check = |path: &str, run: &dyn Fn(&mut [f32])| {
            let mut got = vec![sentinel; len];
            run(&mut got);
            compare_bits(
                packed,
                scales,
                scale_2,
                &want,
                &got,
                &format!("{what}, {path}"),
            );
        };
        check("dispatched", &|out| {
            dequantize_row(packed, scales, scale_2, out)
        });
        #[cfg(target_arch = "x86_64")]
        if let Some(a) = avx2::Avx2::detect() {
            check("avx2", &|out| {
                a.dequantize_row(packed, scales, scale_2, out)
            });
        }
    }

    fn compare_bits(
        packed: &[u8],
        scales: &[u8],
        scale_2: f32,
        want: &[f32],
        got: &[f32],
        what: &str,
    ) {
        for (c, (w, g)) in want.iter().zip(got).enumerate() {
            if scales.get(c / BLOCK).is_some_and(|&b| e4m3::is_nan(b)) && c < packed.len() * 2 {
                // Loading rejects NaN scale bytes, and Rust leaves the sign and payload of a
                // NaN result unspecified (LLVM may fold `(-v) · x` into `-(v · x)`).
                assert!(
                    g.is_nan() && w.is_nan(),
                    "{what}: col {c}: got {g:e}, want NaN"
                );
                continue;
            }
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{what}: col {c} (byte {:#04x}, scale byte {:#04x}, scale_2 {scale_2:e}): \
                 got {g:e}, want {w:e}",
                packed.get(c / 2).copied().unwrap_or(0),
                scales.get(c / BLOCK).copied().unwrap_or(0),
            );
        }
    }

    /// `scale_2` values: an all-zero tensor's, unit, typical checkpoint ones, ones whose products
    /// are subnormal or underflow to zero, and ones whose products overflow to infinity.
    const SCALE_2S: [f32; 14] = [
        0.0,
        1.0,
        7.5 / 2688.0,
        0.37 / 2688.0,
        1.0 / 2688.0,
        3.0e-6,
        1.0e-38,
        f32::MIN_POSITIVE,
        1.0e-42,
        f32::from_bits(1),
        1.0e35,
        3.0e36,
        1.0e38,
        f32::MAX,
    ];

    /// Every packed byte in every position of a block under every scale byte (the 127 that
    /// loading admits, the negative ones too, and the two NaNs, where only NaN-ness is
    /// compared), for each of `SCALE_2S`. Row `s` has
    /// 256 blocks; block `j` has scale byte `s + j` and byte `j + 37 i` at position `i`, so each
    /// (scale byte, position, byte) triple occurs in one of the 256 rows.
    #[test]
    fn fast_dequantize_matches_portable_for_every_byte() {
        let blocks = 256;
        let mut packed = vec![0u8; blocks * BLOCK / 2];
        let mut scales = vec![0u8; blocks];
        for scale_2 in SCALE_2S {
            for s in 0..=255u8 {
                for j in 0..blocks {
                    scales[j] = s.wrapping_add(j as u8);
                    for i in 0..BLOCK / 2 {
                        packed[j * BLOCK / 2 + i] = (j + 37 * i) as u8;
                    }
                }
                assert_same_bits(&packed, &scales, scale_2, blocks * BLOCK, "exhaustive");
            }
        }
    }

    /// Rows of random length and content, random admitted scale bytes and random finite
    /// positive `scale_2` over the whole exponent range; also buffers longer than the row (the
    /// tail stays untouched) and fewer scales than blocks (only whole blocks with a scale).
    #[test]
    fn fast_dequantize_matches_portable_on_random_rows() {
        let mut bits = SmallRng::seed_from_u64(0x2545_F491_4F6C_DD1D);
        for case in 0..2000 {
            let blocks = 1 + (bits.next_u64() % 200) as usize;
            let packed: Vec<u8> = (0..blocks * BLOCK / 2)
                .map(|_| bits.next_u64() as u8)
                .collect();
            let mut scales: Vec<u8> = (0..blocks)
                .map(|_| (bits.next_u64() % 0x7F) as u8)
                .collect();
            let scale_2 = match case % 4 {
                0 => SCALE_2S[(bits.next_u64() % SCALE_2S.len() as u64) as usize],
                // Any finite positive f32 (subnormals included).
                1 => f32::from_bits(1 + (bits.next_u64() % (0x7F80_0000 - 1)) as u32),
                _ => f32::from_bits(0x3800_0000 + (bits.next_u64() % 0x0200_0000) as u32),
            };
            let mut len = blocks * BLOCK;
            if case % 7 == 0 {
                len += BLOCK + (bits.next_u64() % BLOCK as u64) as usize;
            }
            if case % 11 == 0 {
                scales.truncate(blocks / 2);
            }
            assert_same_bits(&packed, &scales, scale_2, len, &format!("case {case}"));
        }
    }

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
