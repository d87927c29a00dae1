//! Runtime activation quantization (W4A4): vLLM's `scaled_fp4_quant` recipe with exact
//! reciprocals (DESIGN 1.2).
//!
//! With the global scale `gs = 1 / input_scale`, per 16-block of a row, in f32:
//! 1. `vmax = max|x|`, `s = min(gs · (vmax · (1/6)), 448)`, `S = e4m3_rne(s)`;
//! 2. `out_scale = 1 / (f32(S) · (1/gs))`, or 0 when `S == 0`;
//! 3. `code = e2m1_rne(clamp(x · out_scale, -6, 6))`; QDQ value `= e2m1(code) · f32(S) / gs`.

use super::{e2m1, e4m3, BLOCK};

/// Block scale byte and the element multiplier of one block.
#[inline(always)]
fn block_scale(block: &[f32], gs: f32) -> (u8, f32) {
    let vmax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = (gs * (vmax * (1.0f32 / 6.0))).min(e4m3::E4M3_MAX);
    let sb = e4m3::encode_sat(s);
    let sf = e4m3::decode(sb);
    let out_scale = if sf != 0.0 {
        1.0 / (sf * (1.0 / gs))
    } else {
        0.0
    };
    (sb, out_scale)
}

#[inline(always)]
fn element_code(x: f32, out_scale: f32) -> u8 {
    let v = (x * out_scale).clamp(-e2m1::E2M1_MAX, e2m1::E2M1_MAX);
    e2m1::encode(v, v < 0.0)
}

/// Quantizes one row (length a multiple of 16) into packed codes and block-scale bytes.
pub fn quantize_row(x: &[f32], gs: f32, packed: &mut [u8], scales: &mut [u8]) {
    for ((block, out), sc) in x
        .chunks_exact(BLOCK)
        .zip(packed.chunks_exact_mut(BLOCK / 2))
        .zip(scales.iter_mut())
    {
        let (sb, out_scale) = block_scale(block, gs);
        *sc = sb;
        for (pair, o) in block.chunks_exact(2).zip(out.iter_mut()) {
            *o = e2m1::pack(
                element_code(pair[0], out_scale),
                element_code(pair[1], out_scale),
            );
        }
    }
}

/// Value of a code after dequantization: `e2m1(code) · f32(S) / gs` (+0 for either zero code).
#[inline(always)]
fn dequantized(code: u8, sf: f32, gs: f32) -> f32 {
    e2m1::decode(code) * sf / gs
}

/// Quantize-dequantize of one row: `out[i] = e2m1(code_i) · f32(S) / gs`.
pub fn qdq_row(x: &[f32], gs: f32, out: &mut [f32]) {
    for (block, o) in x.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        let (sb, out_scale) = block_scale(block, gs);
        let sf = e4m3::decode(sb);
        for (&v, r) in block.iter().zip(o.iter_mut()) {
            *r = dequantized(element_code(v, out_scale), sf, gs);
        }
    }
}

/// [`qdq_row`] in place.
pub fn qdq_row_in_place(x: &mut [f32], gs: f32) {
    for block in x.chunks_exact_mut(BLOCK) {
        let (sb, out_scale) = block_scale(block, gs);
        let sf = e4m3::decode(sb);
        for v in block.iter_mut() {
            *v = dequantized(element_code(*v, out_scale), sf, gs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchor_vectors() {
        // DESIGN/anchors 1.9: gs = 2688 / 7.5.
        let gs = 2688.0f32 / 7.5;
        let x: Vec<f32> = (0..16).map(|i| -7.5 + i as f32).collect();
        let mut p = [0u8; 8];
        let mut s = [0u8; 1];
        quantize_row(&x, gs, &mut p, &mut s);
        assert_eq!(s[0], 0x7E);
        assert_eq!(p, [0xff, 0xee, 0xcd, 0x9a, 0x21, 0x54, 0x66, 0x77]);

        let mut y = [0.0f32; 16];
        y[..4].copy_from_slice(&[0.1, -0.2, 0.3, 0.05]);
        y[15] = 0.01;
        quantize_row(&y, gs, &mut p, &mut s);
        assert_eq!(s[0], 0x59);
        assert_eq!(p, [0xe4, 0x27, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn zero_block_has_zero_scale() {
        let mut p = [0xAAu8; 8];
        let mut s = [0xAAu8; 1];
        quantize_row(&[0.0; 16], 100.0, &mut p, &mut s);
        assert_eq!((s[0], p), (0, [0; 8]));
        let mut q = [1.0f32; 16];
        qdq_row(&[0.0; 16], 100.0, &mut q);
        assert!(q.iter().all(|&v| v == 0.0));
    }
}
