//! Weight layouts of the CUDA decode kernels (`kernels/expert_gemm.cu`): each lane of a warp
//! loads its mma.sync A fragment with one 16-byte load, so no shuffles or shared memory stand
//! between global memory and the tensor cores. Pure byte permutations, tested on the CPU.
//!
//! NVFP4, per expert, row group `rg` (16 rows) and 64-wide k group `kg` (four 16-wide blocks):
//! - data, 512 bytes: lane `L = 4g + q`, bytes `16L + 4j + {0,1,2,3}` = packed bytes of
//!   `(row g, k 2q..2q+1)`, `(row g+8, k 2q..)`, `(row g, k 2q+8..2q+9)`, `(row g+8, k 2q+8..)`
//!   of k block `4kg + j` (each byte holds two E2M1 codes, even k low);
//! - scales, 64 bytes: `8g + j` = scale code of row g, block `4kg + j`; `8g + 4 + j` = row g + 8.
//!
//! Scale codes ([`scale_code`]): the E4M3 block scale S re-encoded so that one integer
//! multiply-add gives a bf16 pair on the device: with T = S · 2^118 (bf16 exponent field F in
//! 236..=253 for every nonzero E4M3 value, subnormals included, and a 3-bit mantissa m3), the
//! code is `(F − 235)·8 + m3` (8..=151) and `code · 16 + 0x7580` are T's bf16 bits; `code ·
//! 0x0010_0010 + 0x7580_7580` the pair (T, T). Zero scales get code 0, whose decoded value is
//! nonzero, so the codes of a zero-scale block are zeroed (its values are 0 either way).
//!
//! K is padded to a multiple of 64 with zero codes and zero scale codes.
//!
//! BF16, per row group and 16-wide k block: 32 lanes x 4 words, word i of lane `4g + q` holding
//! the bf16 pair of A-fragment register i (rows g / g+8, k 2q.. / 2q+8..).

use crate::weights::ExpertStack;
use half::bf16;

/// Offset of a scale code's decoded bf16 bits: `235 << 7` (T = S · 2^118), and for S itself
/// `117 << 7`.
pub const SCALE_T_BIAS: u16 = 235 << 7;
pub const SCALE_S_BIAS: u16 = 117 << 7;

/// The device scale code of E4M3 byte `b` (see the module docs); 0 for zero. Bytes the weights'
/// validation rejects (sign bit set, NaN) map to 0 as well.
pub fn scale_code(b: u8) -> u8 {
    let v = crate::format::e4m3::decode(b);
    if b & 0x80 != 0 || !v.is_finite() || v == 0.0 {
        return 0;
    }
    // Exact: an E4M3 value times 2^118 is a bf16 with at most 3 mantissa bits.
    let t = (v * 2f32.powi(118)).to_bits();
    let (f, m3) = ((t >> 23) & 0xFF, (t >> 20) & 7);
    ((f - 235) * 8 + m3) as u8
}

/// The E4M3 byte of scale code `c` ([`scale_code`]'s inverse on valid scales; 0 for code 0).
pub fn scale_e4m3(c: u8) -> u8 {
    if c == 0 {
        return 0;
    }
    let t = f32::from_bits(u32::from(c as u16 * 16 + SCALE_T_BIAS) << 16);
    crate::format::e4m3::encode_sat(t * 2f32.powi(-118))
}

/// K rounded up to the kernels' 64-wide k groups.
pub fn padded_k(k: usize) -> usize {
    k.div_ceil(64) * 64
}

/// Prepared NVFP4 stack: `(data, scales)`.
pub fn pack_nvfp4(s: &ExpertStack) -> (Vec<u8>, Vec<u8>) {
    let kg = padded_k(s.cols) / 64;
    let rg_n = s.rows / 16;
    let blocks = s.cols / 16;
    let mut data = vec![0u8; s.experts * rg_n * kg * 512];
    let mut scales = vec![0u8; s.experts * rg_n * kg * 64];
    let rb = s.row_bytes();
    let sc = s.scale_cols();
    for e in 0..s.experts {
        for rg in 0..rg_n {
            let tile = (e * rg_n + rg) * kg;
            for lane in 0..32 {
                let (g, q) = (lane / 4, lane % 4);
                let rows = [rg * 16 + g, rg * 16 + g + 8];
                for kgi in 0..kg {
                    for j in 0..4 {
                        let kb = kgi * 4 + j;
                        if kb >= blocks {
                            continue;
                        }
                        let at = |row: usize, byte_in_block: usize| {
                            s.packed[(e * s.rows + row) * rb + kb * 8 + byte_in_block]
                        };
                        let o = (tile + kgi) * 512 + lane * 16 + 4 * j;
                        let code = |row: usize| scale_code(s.scales[(e * s.rows + row) * sc + kb]);
                        // A zero-scale block's codes become zero (see the module docs).
                        let keep = |row: usize, b: u8| if code(row) == 0 { 0 } else { b };
                        data[o] = keep(rows[0], at(rows[0], q));
                        data[o + 1] = keep(rows[1], at(rows[1], q));
                        data[o + 2] = keep(rows[0], at(rows[0], 4 + q));
                        data[o + 3] = keep(rows[1], at(rows[1], 4 + q));
                        if q == 0 {
                            let so = (tile + kgi) * 64 + 8 * g;
                            scales[so + j] = code(rows[0]);
                            scales[so + 4 + j] = code(rows[1]);
                        }
                    }
                }
            }
        }
    }
    (data, scales)
}

/// Inverse of [`pack_nvfp4`]: the linear `(packed, scales)` of a stack of `experts` `[rows, cols]`
/// matrices (padding dropped); a zero-scale block comes back with zero codes.
pub fn unpack_nvfp4(
    data: &[u8],
    scales: &[u8],
    experts: usize,
    rows: usize,
    cols: usize,
) -> (Vec<u8>, Vec<u8>) {
    let kg = padded_k(cols) / 64;
    let rg_n = rows / 16;
    let mut packed = vec![0u8; experts * rows * cols / 2];
    let mut lin = vec![0u8; experts * rows * cols / 16];
    for e in 0..experts {
        for r in 0..rows {
            let (rg, r16) = (r / 16, r % 16);
            let (g, hi) = (r16 % 8, usize::from(r16 >= 8));
            for kb in 0..cols / 16 {
                let (kgi, j) = (kb / 4, kb % 4);
                let tile = (e * rg_n + rg) * kg + kgi;
                for q in 0..4 {
                    let o = tile * 512 + (4 * g + q) * 16 + 4 * j;
                    let dst = (e * rows + r) * cols / 2 + kb * 8;
                    packed[dst + q] = data[o + hi];
                    packed[dst + 4 + q] = data[o + 2 + hi];
                }
                lin[(e * rows + r) * cols / 16 + kb] =
                    scale_e4m3(scales[tile * 64 + 8 * g + 4 * hi + j]);
            }
        }
    }
    (packed, lin)
}

/// Prepared bf16 matrix `[rows, cols]` (rows a multiple of 16) in A-fragment order.
pub fn pack_bf16(rows: usize, cols: usize, w: &[bf16]) -> Vec<u8> {
    let kb_n = padded_k(cols) / 16;
    let rg_n = rows / 16;
    let mut out = vec![0u8; rg_n * kb_n * 512];
    let at = |r: usize, c: usize| {
        if c < cols {
            w[r * cols + c].to_bits()
        } else {
            0
        }
    };
    for rg in 0..rg_n {
        for kb in 0..kb_n {
            for lane in 0..32 {
                let (g, q) = (lane / 4, lane % 4);
                let (r0, r1) = (rg * 16 + g, rg * 16 + g + 8);
                let (k0, k1) = (kb * 16 + 2 * q, kb * 16 + 2 * q + 8);
                let words = [(r0, k0), (r1, k0), (r0, k1), (r1, k1)];
                for (i, (r, k)) in words.into_iter().enumerate() {
                    let o = ((rg * kb_n + kb) * 32 + lane) * 16 + 4 * i;
                    out[o..o + 2].copy_from_slice(&at(r, k).to_le_bytes());
                    out[o + 2..o + 4].copy_from_slice(&at(r, k + 1).to_le_bytes());
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::e2m1;

    /// Reads element (row, k) of expert e back out of the packed layout, as the kernel does.
    fn read_back(data: &[u8], rows: usize, kg: usize, e: usize, row: usize, k: usize) -> u8 {
        let (rg, r16) = (row / 16, row % 16);
        let (g, hi_row) = (r16 % 8, r16 >= 8);
        let (kgi, j, kk) = (k / 64, (k % 64) / 16, k % 16);
        let q = (kk % 8) / 2;
        let second_half = kk >= 8;
        let lane = 4 * g + q;
        let byte = (usize::from(second_half) << 1) | usize::from(hi_row);
        let b = data[((e * rows / 16 + rg) * kg + kgi) * 512 + lane * 16 + 4 * j + byte];
        if kk % 2 == 0 {
            b & 0xF
        } else {
            b >> 4
        }
    }

    #[test]
    fn nvfp4_fragments_hold_the_right_elements() {
        let (experts, rows, cols) = (2, 32, 80); // K not a multiple of 64: padded
        let s = ExpertStack::quantize_with("w", experts, rows, cols, 1, |e, b| {
            for (i, v) in b.iter_mut().enumerate() {
                *v = ((i * 7 + e * 13) % 23) as f32 - 11.0;
            }
        })
        .unwrap();
        let (data, scales) = pack_nvfp4(&s);
        let kg = padded_k(cols) / 64;
        for e in 0..experts {
            for r in 0..rows {
                for k in 0..cols {
                    let b = s.packed[(e * rows + r) * cols / 2 + k / 2];
                    let want = if k % 2 == 0 { b & 0xF } else { b >> 4 };
                    assert_eq!(read_back(&data, rows, kg, e, r, k), want, "e{e} r{r} k{k}");
                    let (rg, r16, kgi, j) = (r / 16, r % 16, k / 64, (k % 64) / 16);
                    let so = ((e * rows / 16 + rg) * kg + kgi) * 64
                        + 8 * (r16 % 8)
                        + 4 * usize::from(r16 >= 8)
                        + j;
                    let want = s.scales[(e * rows + r) * cols / 16 + k / 16];
                    assert_eq!(scales[so], scale_code(want));
                }
            }
        }
        // Padding holds zero codes (value 0) and zero scales.
        assert_eq!(e2m1::decode(read_back(&data, rows, kg, 0, 0, 100)), 0.0);
    }

    /// Every valid E4M3 scale: the device's one-operation decodes give T = S · 2^118 and S
    /// exactly (as bf16, duplicated), and the code maps back to the byte.
    #[test]
    fn scale_codes_decode_exactly_with_one_multiply_add() {
        for b in 0u8..=0x7E {
            let s = crate::format::e4m3::decode(b);
            let c = scale_code(b);
            assert_eq!(scale_e4m3(c), b, "byte {b:#x}");
            if b == 0 {
                assert_eq!(c, 0);
                continue;
            }
            assert!((8..=151).contains(&c), "byte {b:#x}: code {c}");
            let pair = u32::from(c) * 0x0010_0010 + 0x7580_7580;
            let t = bf16::from_f32(s * 2f32.powi(118));
            assert_eq!(t.to_f32(), s * 2f32.powi(118), "byte {b:#x}: T not a bf16");
            assert_eq!(pair, u32::from(t.to_bits()) * 0x0001_0001, "byte {b:#x}");
            let sb = bf16::from_bits(c as u16 * 16 + SCALE_S_BIAS);
            assert_eq!(sb.to_f32(), s, "byte {b:#x}: S");
        }
        assert_eq!(scale_code(0x7F), 0); // NaN
        assert_eq!(scale_code(0x81), 0); // negative
    }

    #[test]
    fn zero_scale_blocks_pack_with_zero_codes() {
        let (experts, rows, cols) = (1, 16, 64);
        let mut s = ExpertStack::quantize_with("w", experts, rows, cols, 1, |_, b| {
            for (i, v) in b.iter_mut().enumerate() {
                *v = (i % 7) as f32 - 3.0;
            }
        })
        .unwrap();
        s.scales[1] = 0; // row 0, block 1: nonzero codes under a zero scale
        let (data, scales) = pack_nvfp4(&s);
        for k in 16..32 {
            assert_eq!(read_back(&data, rows, 1, 0, 0, k), 0, "k{k}");
        }
        assert_ne!(read_back(&data, rows, 1, 0, 0, 0), 0);
        assert_eq!(scales[1], 0);
        let (packed, lin) = unpack_nvfp4(&data, &scales, experts, rows, cols);
        assert_eq!(lin, s.scales);
        assert!(packed[8..16].iter().all(|&b| b == 0));
        assert_eq!(packed[..8], s.packed[..8]);
    }

    #[test]
    fn bf16_fragments_hold_the_right_elements() {
        let (rows, cols) = (32, 48);
        let w: Vec<bf16> = (0..rows * cols).map(|i| bf16::from_f32(i as f32)).collect();
        let p = pack_bf16(rows, cols, &w);
        let kb_n = padded_k(cols) / 16;
        for r in 0..rows {
            for k in 0..cols {
                let (rg, r16, kb, kk) = (r / 16, r % 16, k / 16, k % 16);
                let (g, q) = (r16 % 8, (kk % 8) / 2);
                let word = usize::from(r16 >= 8) | (usize::from(kk >= 8) << 1);
                let o = ((rg * kb_n + kb) * 32 + 4 * g + q) * 16 + 4 * word + 2 * (kk % 2);
                assert_eq!(
                    u16::from_le_bytes([p[o], p[o + 1]]),
                    w[r * cols + k].to_bits()
                );
            }
        }
    }
}
