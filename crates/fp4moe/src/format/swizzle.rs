//! The 128x4 block-scale swizzle read by Blackwell tensor cores and cuBLASLt (DESIGN 1.3).
//!
//! A linear `[rows, kc]` scale matrix (kc = K/16) becomes `[round_up(rows, 128), round_up(kc, 4)]`
//! bytes, zero-filled, with the byte of `(m, k)` at
//! `((m/128)·ceil(kc/4) + k/4)·512 + (m%32)·16 + ((m/32)%4)·4 + k%4`.
//! Stacked experts are swizzled independently; each expert's stride uses the **padded** row count
//! (the bug vLLM fixed in PR #35497).

/// Bytes of one swizzled `[rows, kc]` matrix.
pub fn swizzled_len(rows: usize, kc: usize) -> usize {
    rows.div_ceil(128) * 128 * kc.div_ceil(4) * 4
}

/// Byte offset of scale `(m, k)` inside one swizzled matrix with `kc` scale columns.
#[inline]
pub fn swizzled_offset(m: usize, k: usize, kc: usize) -> usize {
    ((m / 128) * kc.div_ceil(4) + k / 4) * 512 + (m % 32) * 16 + ((m / 32) % 4) * 4 + k % 4
}

/// Swizzles `experts` stacked `[rows, kc]` linear matrices.
pub fn swizzle_128x4(linear: &[u8], experts: usize, rows: usize, kc: usize) -> Vec<u8> {
    let per = swizzled_len(rows, kc);
    let mut out = vec![0u8; experts * per];
    for e in 0..experts {
        let src = &linear[e * rows * kc..(e + 1) * rows * kc];
        let dst = &mut out[e * per..(e + 1) * per];
        for m in 0..rows {
            for k in 0..kc {
                dst[swizzled_offset(m, k, kc)] = src[m * kc + k];
            }
        }
    }
    out
}

/// Inverse of [`swizzle_128x4`]: drops the padding.
pub fn unswizzle_128x4(swizzled: &[u8], experts: usize, rows: usize, kc: usize) -> Vec<u8> {
    let per = swizzled_len(rows, kc);
    let mut out = vec![0u8; experts * rows * kc];
    for e in 0..experts {
        let src = &swizzled[e * per..(e + 1) * per];
        let dst = &mut out[e * rows * kc..(e + 1) * rows * kc];
        for m in 0..rows {
            for k in 0..kc {
                dst[m * kc + k] = src[swizzled_offset(m, k, kc)];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn offsets_are_a_bijection_onto_the_padded_block() {
        let (rows, kc) = (256, 8);
        let mut seen = vec![false; swizzled_len(rows, kc)];
        for m in 0..rows {
            for k in 0..kc {
                let o = swizzled_offset(m, k, kc);
                assert!(!seen[o]);
                seen[o] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn known_offsets() {
        assert_eq!(swizzled_offset(0, 0, 4), 0);
        assert_eq!(swizzled_offset(1, 0, 4), 16);
        assert_eq!(swizzled_offset(32, 0, 4), 4);
        assert_eq!(swizzled_offset(0, 1, 4), 1);
        assert_eq!(swizzled_offset(0, 4, 8), 512);
        assert_eq!(swizzled_offset(128, 0, 8), 1024);
    }

    #[test]
    fn padding_is_zero_and_expert_stride_is_padded() {
        // 130 rows (not a multiple of 128) and kc = 3: the second expert starts at the padded stride.
        let (e, rows, kc) = (2, 130, 3);
        let lin: Vec<u8> = (0..e * rows * kc).map(|i| (i % 251 + 1) as u8).collect();
        let s = swizzle_128x4(&lin, e, rows, kc);
        let per = swizzled_len(rows, kc);
        assert_eq!(per, 256 * 4);
        assert_eq!(s[per + swizzled_offset(0, 0, kc)], lin[rows * kc]);
        let nonzero = s.iter().filter(|&&b| b != 0).count();
        assert_eq!(nonzero, e * rows * kc);
    }

    proptest! {
        #[test]
        fn round_trip(e in 1usize..3, rows in 1usize..300, kc in 1usize..10, seed in any::<u64>()) {
            let lin: Vec<u8> = (0..e * rows * kc)
                .map(|i| (seed.wrapping_mul(6364136223846793005).wrapping_add((i as u64).wrapping_mul(1442695040888963407)) >> 56) as u8)
                .collect();
            let s = swizzle_128x4(&lin, e, rows, kc);
            prop_assert_eq!(s.len(), e * swizzled_len(rows, kc));
            prop_assert_eq!(unswizzle_128x4(&s, e, rows, kc), lin);
        }
    }
}
