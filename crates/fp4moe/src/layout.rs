//! Backend weight layouts (DESIGN 4): the gated-only gate/up swap with 64-row interleave, and
//! folding `scale_2` into the E4M3 block scales when (and only when) that is exact.
//!
//! Interleave: a gated expert's w13 rows `[gate 0:I; up 0:I]` become
//! `[up 0:64, gate 0:64, up 64:128, gate 64:128, …]` (FlashInfer's CuteDSL contract; it keeps
//! a row's gate and up in one 128-row tile). When I is not a multiple of 64 the last pair of
//! chunks is shorter. Non-gated experts (ReLU², SiLU-no-mul) hold only `up` and are never
//! reordered: their bytes come out of every prepare path unchanged.
//!
//! Folding: `S' = e4m3(f32(S) · scale_2)` lets a kernel drop `scale_2`. It is exact only when
//! every product is representable, which for typical `scale_2 ≈ 1e-4` it is not (products land
//! in E4M3's subnormal range; vLLM PR #48536). [`fold_scale_2`] measures the worst relative error
//! and refuses anything but zero.

use crate::format::e4m3;
use crate::spec::Activation;
use crate::weights::ExpertStack;

/// Rows per interleave chunk.
pub const INTERLEAVE: usize = 64;

/// Source row (in `[gate; up]` order) of interleaved row `r`, for intermediate width `inter`.
pub fn interleaved_source_row(r: usize, inter: usize) -> usize {
    let chunk = r / (2 * INTERLEAVE);
    let start = chunk * INTERLEAVE;
    let len = INTERLEAVE.min(inter - start);
    let within = r - 2 * start;
    if within < len {
        inter + start + within // up
    } else {
        start + within - len // gate
    }
}

/// Reorders each expert's `2·inter` rows of `row_bytes` bytes from `[gate; up]` to the
/// interleaved order.
pub fn interleave_gate_up(src: &[u8], experts: usize, inter: usize, row_bytes: usize) -> Vec<u8> {
    permute_rows(
        src,
        experts,
        2 * inter,
        row_bytes,
        |r| interleaved_source_row(r, inter),
        false,
    )
}

/// Inverse of [`interleave_gate_up`].
pub fn deinterleave_gate_up(src: &[u8], experts: usize, inter: usize, row_bytes: usize) -> Vec<u8> {
    permute_rows(
        src,
        experts,
        2 * inter,
        row_bytes,
        |r| interleaved_source_row(r, inter),
        true,
    )
}

/// `dst[r] = src[map(r)]` per expert, or the inverse (`dst[map(r)] = src[r]`).
fn permute_rows(
    src: &[u8],
    experts: usize,
    rows: usize,
    row_bytes: usize,
    map: impl Fn(usize) -> usize,
    inverse: bool,
) -> Vec<u8> {
    let mut dst = vec![0u8; src.len()];
    let per = rows * row_bytes;
    for e in 0..experts {
        for r in 0..rows {
            let (d, s) = if inverse { (map(r), r) } else { (r, map(r)) };
            dst[e * per + d * row_bytes..e * per + (d + 1) * row_bytes]
                .copy_from_slice(&src[e * per + s * row_bytes..e * per + (s + 1) * row_bytes]);
        }
    }
    dst
}

/// w13 in the order a fused gated kernel reads (interleaved when gated, untouched otherwise).
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedW13 {
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
    pub interleaved: bool,
}

/// Puts `w13` into the interleaved kernel order for `activation`.
pub fn prepare_w13_interleaved(w13: &ExpertStack, activation: Activation) -> PreparedW13 {
    if !activation.is_gated() {
        return PreparedW13 {
            packed: w13.packed.clone(),
            scales: w13.scales.clone(),
            interleaved: false,
        };
    }
    let inter = w13.rows / 2;
    PreparedW13 {
        packed: interleave_gate_up(&w13.packed, w13.experts, inter, w13.row_bytes()),
        scales: interleave_gate_up(&w13.scales, w13.experts, inter, w13.scale_cols()),
        interleaved: true,
    }
}

/// Worst relative error folding `scale_2` into `scales` would introduce, and the folded bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Fold {
    pub scales: Vec<u8>,
    pub worst_relative_error: f64,
}

/// A fold that would change the dequantized values.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("folding scale_2 = {scale_2:e} into the block scales of `{tensor}` is not exact (worst relative error {worst_relative_error:.3e}); keep scale_2 separate")]
pub struct InexactFold {
    pub tensor: String,
    pub scale_2: f32,
    pub worst_relative_error: f64,
}

/// `S' = e4m3(f32(S) · scale_2)` for every byte, with the worst relative error over non-zero scales.
pub fn fold_report(scales: &[u8], scale_2: f32) -> Fold {
    let mut worst = 0.0f64;
    let folded = scales
        .iter()
        .map(|&b| {
            let exact = e4m3::decode(b) as f64 * scale_2 as f64;
            let nb = e4m3::encode_sat(exact as f32);
            if exact != 0.0 {
                worst = worst.max(((e4m3::decode(nb) as f64 - exact) / exact).abs());
            }
            nb
        })
        .collect();
    Fold {
        scales: folded,
        worst_relative_error: worst,
    }
}

/// Folds `scale_2` into the block scales, or refuses when any value would change.
pub fn fold_scale_2(tensor: &str, scales: &[u8], scale_2: f32) -> Result<Vec<u8>, InexactFold> {
    let f = fold_report(scales, scale_2);
    if f.worst_relative_error == 0.0 {
        Ok(f.scales)
    } else {
        Err(InexactFold {
            tensor: tensor.to_string(),
            scale_2,
            worst_relative_error: f.worst_relative_error,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(experts: usize, n: usize, row_bytes: usize) -> Vec<u8> {
        (0..experts * n * row_bytes)
            .map(|i| (i / row_bytes) as u8)
            .collect()
    }

    #[test]
    fn interleave_order() {
        // I = 128: [up 0:64, gate 0:64, up 64:128, gate 64:128].
        let order: Vec<usize> = (0..256).map(|r| interleaved_source_row(r, 128)).collect();
        assert_eq!(order[0], 128);
        assert_eq!(order[63], 191);
        assert_eq!(order[64], 0);
        assert_eq!(order[127], 63);
        assert_eq!(order[128], 192);
        assert_eq!(order[192], 64);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..256).collect::<Vec<_>>());
    }

    #[test]
    fn interleave_round_trips_with_partial_chunk() {
        for inter in [16, 64, 96, 1856 / 16] {
            let src = rows(3, 2 * inter, 5);
            let i = interleave_gate_up(&src, 3, inter, 5);
            assert_ne!(i, src);
            assert_eq!(deinterleave_gate_up(&i, 3, inter, 5), src, "inter {inter}");
        }
    }

    #[test]
    fn exact_fold_by_power_of_two() {
        let scales = vec![0x38u8, 0x40, 0x30];
        assert_eq!(
            fold_scale_2("w", &scales, 0.5).unwrap(),
            vec![0x30, 0x38, 0x28]
        );
    }

    #[test]
    fn inexact_fold_is_refused_with_its_error() {
        let scales = vec![0x7Eu8, 0x39];
        let e = fold_scale_2("w13", &scales, 1.0 / 2688.0).unwrap_err();
        assert!(e.worst_relative_error > 0.0);
        assert!(e.to_string().contains("w13"));
    }
}
