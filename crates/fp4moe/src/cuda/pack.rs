//! Weight layouts of the CUDA kernels (`kernels/expert_gemm.cu`, `expert_stream.cu`,
//! `prefill_gemm.cu`): each lane of a warp
//! loads its mma.sync A fragment with one 16-byte load, so no shuffles or shared memory stand
//! between global memory and the tensor cores. Pure bit and byte permutations, tested on the CPU.
//!
//! NVFP4, per expert, row group `rg` (16 rows) and 64-wide k group `kg` (four 16-wide blocks):
//! - data, 512 bytes: lane `L = 4g + q`, little-endian word `16L + 4j` holds the E2M1 codes of
//!   k block `4kg + j` for the four A-fragment registers i = `(row g, k 2q..2q+1)`,
//!   `(row g+8, k 2q..)`, `(row g, k 2q+8..2q+9)`, `(row g+8, k 2q+8..)`, each code's four bits
//!   scattered ([`CODE_BITS`]) so that the kernels reach register i's bf16 bits with a mask
//!   (register 0), a shift and a mask (1), or a mask, an integer multiply and a mask (2; 3 after
//!   a shift right by 8): seven logic or shift operations and three multiplies per fragment
//!   (`kernels/gemm_common.cuh`);
//! - scales, 64 bytes: lane `4g + q` loads its eight codes (rows g and g + 8 of k blocks
//!   `4kg + 0..4`) as two 32-bit words at `8g`, [`scale_word`] of blocks 0, 1 and of 2, 3: the
//!   even block's two codes at bits 4..12 (row g) and 20..28 (row g + 8), the odd block's the
//!   same rotated left by 8, so a mask (after a rotate for the odd block) and an OR give the bf16
//!   pair (S_g, S_g+8), whose halves the bf16 multiplies take as operand swizzles.
//!
//! Scale codes ([`scale_code`]): the E4M3 block scale S re-encoded so that an OR gives its bf16
//! bits on the device: with T = S · 2^118 (bf16 exponent field F in 236..=253 for every nonzero
//! E4M3 value, subnormals included, so F's top three bits are always 111, and a 3-bit mantissa
//! m3), the code is `(F − 224)·8 + m3` (96..=239) and `0x7000 | code · 16` are T's bf16 bits.
//! Zero scales get code 0, whose decoded value is nonzero, so the codes of a zero-scale block are
//! zeroed (its values are 0 either way).
//!
//! K is padded to a multiple of 64 with zero codes and zero scale codes.
//!
//! BF16, per row group and 16-wide k block: 32 lanes x 4 words, word i of lane `4g + q` holding
//! the bf16 pair of A-fragment register i (rows g / g+8, k 2q.. / 2q+8..).

use crate::weights::ExpertStack;
use half::bf16;
use rayon::prelude::*;

/// The bits a scale code's decoded bf16 T = S · 2^118 always has: F's top three bits, `224 << 7`.
pub const SCALE_T_OR: u16 = 224 << 7;

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
    ((f - 224) * 8 + m3) as u8
}

/// The E4M3 byte of scale code `c` ([`scale_code`]'s inverse on valid scales; 0 for code 0).
pub fn scale_e4m3(c: u8) -> u8 {
    if c == 0 {
        return 0;
    }
    let t = f32::from_bits(u32::from(SCALE_T_OR | u16::from(c) << 4) << 16);
    crate::format::e4m3::encode_sat(t * 2f32.powi(-118))
}

/// The scale word of two k blocks from `codes` = [row g's of the even block, row g + 8's, row
/// g's of the odd block, row g + 8's] (see the module docs).
pub fn scale_word(codes: [u8; 4]) -> u32 {
    let pair = |g: u8, g8: u8| u32::from(g) << 4 | u32::from(g8) << 20;
    pair(codes[0], codes[1]) | pair(codes[2], codes[3]).rotate_left(8)
}

/// Inverse of [`scale_word`].
pub fn scale_word_codes(w: u32) -> [u8; 4] {
    let unpair = |p: u32| [(p >> 4) as u8, (p >> 20) as u8];
    let ([a, b], [c, d]) = (unpair(w), unpair(w.rotate_right(8)));
    [a, b, c, d]
}

/// Where [`fragment_word`] puts A-fragment register i's two codes: bit b of the pair byte (low
/// nibble the even-k code, bits m, e0, e1, s; high nibble the odd-k one) goes to word bit
/// `CODE_BITS[i][b]`. Register 0's bits are their bf16 places (m, e0, e1 → 6..8, s → 15; +16 for
/// the odd code), register 1's the same 3 lower, register 2's magnitudes 6 and its signs 1 lower,
/// register 3's (in the word shifted right by 8) magnitudes 5 and signs 10 lower; see
/// `e2m1x2_scaled_bits` in kernels/gemm_common.cuh.
pub const CODE_BITS: [[u8; 8]; 4] = [
    [6, 7, 8, 15, 22, 23, 24, 31],
    [3, 4, 5, 12, 19, 20, 21, 28],
    [0, 1, 2, 14, 16, 17, 18, 30],
    [9, 10, 11, 13, 25, 26, 27, 29],
];

/// Pair byte p of A-fragment register i with its bits at their [`CODE_BITS`] places:
/// `SPREAD[i][p]`, so a fragment word is four lookups and three ORs (an upload packs ~10^8 of
/// them per projection).
static SPREAD: [[u32; 256]; 4] = spread_tables();

const fn spread_tables() -> [[u32; 256]; 4] {
    let mut t = [[0u32; 256]; 4];
    let mut i = 0;
    while i < 4 {
        let mut p = 0;
        while p < 256 {
            let mut b = 0;
            while b < 8 {
                t[i][p] |= ((p as u32 >> b) & 1) << CODE_BITS[i][b];
                b += 1;
            }
            p += 1;
        }
        i += 1;
    }
    t
}

/// The packed data word of A-fragment registers 0..3 given as code pairs (one byte each, even k
/// in the low nibble), bits placed by [`CODE_BITS`].
pub fn fragment_word(pairs: [u8; 4]) -> u32 {
    let at = |i: usize| SPREAD[i][usize::from(pairs[i])];
    at(0) | at(1) | at(2) | at(3)
}

/// Inverse of [`fragment_word`].
pub fn fragment_pairs(w: u32) -> [u8; 4] {
    std::array::from_fn(|i| {
        CODE_BITS[i]
            .iter()
            .enumerate()
            .fold(0u8, |p, (b, &at)| p | (((w >> at) & 1) as u8) << b)
    })
}

/// K rounded up to the kernels' 64-wide k groups.
pub fn padded_k(k: usize) -> usize {
    k.div_ceil(64) * 64
}

/// Prepared NVFP4 stack: `(data, scales)`. Experts are packed in parallel (rayon).
pub fn pack_nvfp4(s: &ExpertStack) -> (Vec<u8>, Vec<u8>) {
    let kg = padded_k(s.cols) / 64;
    let rg_n = s.rows / 16;
    let mut data = vec![0u8; s.experts * rg_n * kg * 512];
    let mut scales = vec![0u8; s.experts * rg_n * kg * 64];
    // An empty stack has no tiles (chunks of at least one byte: rayon rejects zero).
    let (per_data, per_scales) = ((rg_n * kg * 512).max(1), (rg_n * kg * 64).max(1));
    let codes: [u8; 256] = std::array::from_fn(|b| scale_code(b as u8));
    data.par_chunks_mut(per_data)
        .zip(scales.par_chunks_mut(per_scales))
        .enumerate()
        .for_each(|(e, (d, sc))| pack_nvfp4_expert(s, e, &codes, d, sc));
    (data, scales)
}

/// [`pack_nvfp4`] of expert `e` into its `data` and `scales` regions; `codes`: [`scale_code`]
/// of every E4M3 byte.
fn pack_nvfp4_expert(
    s: &ExpertStack,
    e: usize,
    codes: &[u8; 256],
    data: &mut [u8],
    scales: &mut [u8],
) {
    let kg = padded_k(s.cols) / 64;
    let rg_n = s.rows / 16;
    let blocks = s.cols / 16;
    let rb = s.row_bytes();
    let sc = s.scale_cols();
    for rg in 0..rg_n {
        let tile = rg * kg;
        for lane in 0..32 {
            let (g, q) = (lane / 4, lane % 4);
            let rows = [rg * 16 + g, rg * 16 + g + 8];
            for kgi in 0..kg {
                let mut lane_codes = [0u8; 8]; // 2j: row g's code of block j, 2j + 1: g + 8's
                for j in 0..4 {
                    let kb = kgi * 4 + j;
                    if kb >= blocks {
                        continue;
                    }
                    let at = |row: usize, byte_in_block: usize| {
                        s.packed[(e * s.rows + row) * rb + kb * 8 + byte_in_block]
                    };
                    let o = (tile + kgi) * 512 + lane * 16 + 4 * j;
                    let code =
                        |row: usize| codes[usize::from(s.scales[(e * s.rows + row) * sc + kb])];
                    // A zero-scale block's codes become zero (see the module docs).
                    let keep = |row: usize, b: u8| if code(row) == 0 { 0 } else { b };
                    let pairs = [
                        keep(rows[0], at(rows[0], q)),
                        keep(rows[1], at(rows[1], q)),
                        keep(rows[0], at(rows[0], 4 + q)),
                        keep(rows[1], at(rows[1], 4 + q)),
                    ];
                    data[o..o + 4].copy_from_slice(&fragment_word(pairs).to_le_bytes());
                    lane_codes[2 * j] = code(rows[0]);
                    lane_codes[2 * j + 1] = code(rows[1]);
                }
                if q == 0 {
                    let so = (tile + kgi) * 64 + 8 * g;
                    for (h, four) in lane_codes.chunks_exact(4).enumerate() {
                        let w = scale_word([four[0], four[1], four[2], four[3]]);
                        scales[so + 4 * h..so + 4 * h + 4].copy_from_slice(&w.to_le_bytes());
                    }
                }
            }
        }
    }
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
                    let word = u32::from_le_bytes([data[o], data[o + 1], data[o + 2], data[o + 3]]);
                    let pairs = fragment_pairs(word);
                    let dst = (e * rows + r) * cols / 2 + kb * 8;
                    packed[dst + q] = pairs[hi];
                    packed[dst + 4 + q] = pairs[2 + hi];
                }
                lin[(e * rows + r) * cols / 16 + kb] =
                    scale_e4m3(scale_code_at(scales, tile, g, j, hi));
            }
        }
    }
    (packed, lin)
}

/// The scale code of row g (`hi` 0) or g + 8 (`hi` 1), k block j, of k-group tile `tile`.
fn scale_code_at(scales: &[u8], tile: usize, g: usize, j: usize, hi: usize) -> u8 {
    let o = tile * 64 + 8 * g + 4 * (j / 2);
    let w = u32::from_le_bytes([scales[o], scales[o + 1], scales[o + 2], scales[o + 3]]);
    scale_word_codes(w)[2 * (j % 2) + hi]
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
        let reg = (usize::from(second_half) << 1) | usize::from(hi_row);
        let o = ((e * rows / 16 + rg) * kg + kgi) * 512 + lane * 16 + 4 * j;
        let w = u32::from_le_bytes([data[o], data[o + 1], data[o + 2], data[o + 3]]);
        let pair = fragment_pairs(w)[reg];
        if kk % 2 == 0 {
            pair & 0xF
        } else {
            pair >> 4
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
                    let tile = (e * rows / 16 + rg) * kg + kgi;
                    let got = scale_code_at(&scales, tile, r16 % 8, j, usize::from(r16 >= 8));
                    let want = s.scales[(e * rows + r) * cols / 16 + k / 16];
                    assert_eq!(got, scale_code(want));
                }
            }
        }
        // Padding holds zero codes (value 0) and zero scales.
        assert_eq!(e2m1::decode(read_back(&data, rows, kg, 0, 0, 100)), 0.0);
    }

    /// Every valid E4M3 scale: the device's decode gives T = S · 2^118 exactly as bf16 (the pair
    /// of both rows, `scale_pairs`), and the code maps back to the byte.
    #[test]
    fn scale_codes_decode_exactly_with_a_mask_and_an_or() {
        for b in 0u8..=0x7E {
            let s = crate::format::e4m3::decode(b);
            let c = scale_code(b);
            assert_eq!(scale_e4m3(c), b, "byte {b:#x}");
            if b == 0 {
                assert_eq!(c, 0);
                continue;
            }
            assert!((96..=239).contains(&c), "byte {b:#x}: code {c}");
            let t = bf16::from_f32(s * 2f32.powi(118));
            assert_eq!(t.to_f32(), s * 2f32.powi(118), "byte {b:#x}: T not a bf16");
            // Both rows' codes of a block through the device's rotate, mask and OR
            // (`scale_pairs`): this code as row g's and, as row g + 8's, every other valid one.
            for b8 in (0u8..=0x7E).step_by(5) {
                let c8 = scale_code(b8);
                let t8 = bf16::from_f32(crate::format::e4m3::decode(b8) * 2f32.powi(118));
                for j in 0..4 {
                    let mut codes = [0x5Au8; 8]; // other blocks' codes: must not leak in
                    codes[2 * j] = c;
                    codes[2 * j + 1] = c8;
                    let want = u32::from(t.to_bits()) | u32::from(t8.to_bits()) << 16;
                    let want = if c8 == 0 {
                        want & 0xFFFF | u32::from(SCALE_T_OR) << 16
                    } else {
                        want
                    };
                    assert_eq!(
                        device_scale_pairs(codes, j),
                        want,
                        "bytes {b:#x} {b8:#x}, block {j}"
                    );
                }
            }
        }
        assert_eq!(scale_code(0x7F), 0); // NaN
        assert_eq!(scale_code(0x81), 0); // negative
    }

    /// The device's `scale_pairs` (kernels/gemm_common.cuh): the word of block j (`j < 2 ? s.x
    /// : s.y`), rotated right by 8 for an odd block, masked, OR the constant bits.
    fn device_scale_pairs(codes: [u8; 8], j: usize) -> u32 {
        let h = 4 * (j / 2);
        let w = scale_word([codes[h], codes[h + 1], codes[h + 2], codes[h + 3]]);
        let v = if j % 2 == 1 { w.rotate_right(8) } else { w };
        (v & 0x0FF0_0FF0) | (u32::from(SCALE_T_OR) * 0x0001_0001)
    }

    #[test]
    fn scale_words_round_trip() {
        let mut x = 0x2545_F491u32;
        for _ in 0..1000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let codes = x.to_le_bytes();
            assert_eq!(scale_word_codes(scale_word(codes)), codes);
        }
    }

    /// The device's extraction (`e2m1x2_scaled_bits` in kernels/gemm_common.cuh), bit for bit.
    fn device_pair_bits(w: u32, i: usize) -> u32 {
        const MASK: u32 = 0x81C0_81C0;
        match i {
            0 => w & MASK,
            1 => w.wrapping_mul(8) & MASK,
            2 => (w & 0x4007_4007).wrapping_mul((1 << 6) | (1 << 1)) & MASK,
            _ => ((w >> 8) & 0x002E_002E).wrapping_mul((1 << 5) | (1 << 10)) & MASK,
        }
    }

    /// The code bits fill the word: every bit belongs to exactly one code.
    #[test]
    fn code_bits_are_a_permutation() {
        let mut seen = [false; 32];
        for &at in CODE_BITS.iter().flatten() {
            assert!(!seen[usize::from(at)], "bit {at} twice");
            seen[usize::from(at)] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    /// Every code pair in every register position, beside arbitrary neighbours: the device's
    /// extraction gives the bf16 bits of e2m1 · 2^-126 for both codes (the sign bit alone for
    /// -0), and the word gives the pairs back.
    #[test]
    fn fragment_words_decode_exactly() {
        let bits = |code: u8| -> u16 {
            let m = f32::from(code & 7 != 0) * e2m1::decode(code & 7) * 2f32.powi(-126);
            let b = bf16::from_f32(m);
            assert_eq!(b.to_f32(), m, "code {code}: not exact in bf16");
            b.to_bits() | (u16::from(code & 8) << 12)
        };
        let mut fill = 0x9E37_79B9u32;
        for i in 0..4 {
            for pair in 0..=255u8 {
                for _ in 0..8 {
                    fill = fill.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    let mut pairs = fill.to_le_bytes();
                    pairs[i] = pair;
                    let w = fragment_word(pairs);
                    assert_eq!(fragment_pairs(w), pairs);
                    let want = u32::from(bits(pair & 0xF)) | u32::from(bits(pair >> 4)) << 16;
                    assert_eq!(
                        device_pair_bits(w, i),
                        want,
                        "register {i}, pair {pair:#04x}, word {w:#010x}"
                    );
                }
            }
        }
        // Neighbours all ones and all zeros: the multiplies must not carry into a kept bit.
        for i in 0..4 {
            for pair in 0..=255u8 {
                for fillb in [0u8, 0xFF] {
                    let mut pairs = [fillb; 4];
                    pairs[i] = pair;
                    let want = u32::from(bits(pair & 0xF)) | u32::from(bits(pair >> 4)) << 16;
                    assert_eq!(device_pair_bits(fragment_word(pairs), i), want);
                }
            }
        }
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
        assert_eq!(scale_code_at(&scales, 0, 0, 1, 0), 0); // row 0 (g 0), block 1
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
