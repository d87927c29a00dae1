//! How routing is launched, as pure functions of the batch and the layer: one fused
//! `route_small` launch or the split kernels ([`RoutePath`]), the router-logit kernel
//! ([`RouterKernel`]: SIMT, wide, TF32x3 or bf16 tensor cores) and its K splits, and the shared
//! memory and warp counts those launches need. Thresholds are measured crossovers on the H200
//! (docs/KERNEL_NOTES.md).

use super::{tuning_choice, tuning_knob};
use std::sync::OnceLock;

/// Pairs per chunk of the multi-block pair sort.
pub(super) const SORT_CHUNK: usize = 2048;

/// Most pairs the one-block pair sort (`sort_pairs`, and `route_small`'s sort) takes.
pub(super) const SORT_ONE_BLOCK_MAX: usize = 2 * SORT_CHUNK;

/// Shared ints the pair sort's expert ordering uses after its `33·E` (`sort_pairs`,
/// `route_small`) or `E` (`scan_pair_counts`): `[MAX_EXPERTS / 32][32]` pass counts, or
/// `sort_pairs_few`'s as many pass masks, 16 warp totals and 33 pass sums (`SLOT_COUNT_INTS`
/// in sort_pairs.cuh).
pub(super) const SLOT_COUNT_INTS: usize = 576;

/// Largest token count routed by the fused `route_small` kernel by default. The fused kernel
/// saves three launches but runs top-k, the sort and the input preparation of the whole batch
/// in one block. Measured on the H200 (W4A16, µs per layer, fused / split, the split path's
/// launches programmatic, means of three rounds): run 227 (KERNEL_NOTES session 49), Nemotron-3
/// Nano 2 tokens 39.8 / 40.0, 3 47.4 / 45.7, 4 54.3 / 52.7, 8 82.5 / 76.5; Qwen3-30B-A3B 2 34.3
/// / 33.9, 3 41.4 / 38.9, 4 43.8 / 41.7 (a tie at two tokens, kept fused; split ahead from
/// three on both presets). Run 138 had set 3 (Nemotron 3 tokens 51.5 / 52.9), before the
/// one-block sort (`sort_pairs_few`) and the register top-k lost their serial sections: both
/// paths run that code, but the split path spreads the top-k over blocks. One token takes
/// `one_token` where it applies.
pub const ROUTE_FUSED_MAX_TOKENS: usize = 2;

/// Most warps of `route_small`'s top-k phase (one token each, looping beyond): bounds its
/// shared scratch of `2·E + 64` floats per warp (69.6 KB at E = 512, about the sort's 67.5 KB).
pub(super) const ROUTE_TOPK_WARPS: usize = 16;
// route_small's few-pair path prepares the input in the warps past the top-k ones (of 32).
const _: () = assert!(ROUTE_TOPK_WARPS <= 16);

/// How routing, pair sort and input preparation are launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoutePath {
    /// One `route_small` launch (logits, top-k, sort, prepare_input) for small batches.
    Fused,
    /// `router_logits` / `route_topk` / pair sort / `prepare_input`, one launch each (the pair
    /// sort takes three above 4096 pairs).
    Split,
}

impl RoutePath {
    /// `FP4MOE_ROUTE=fused|split`, a benchmark knob.
    pub(super) fn from_env() -> Option<Self> {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let choices = [("fused", RoutePath::Fused), ("split", RoutePath::Split)];
        tuning_choice(&KNOB, "FP4MOE_ROUTE", &choices)
    }

    /// The path for `tokens` tokens routed to `top_k` of `experts` experts: `forced` when given,
    /// else fused up to [`ROUTE_FUSED_MAX_TOKENS`] tokens; split whenever the fused kernel
    /// cannot run (more pairs than its one-block sort takes, or more shared memory than the
    /// device allows) or would not give the split path's bits (from `tiled_from` tokens the
    /// split path computes logits with a tiled kernel, another summation order: 128 or 1024,
    /// by the layer's router kernel).
    pub fn choose(
        tokens: usize,
        top_k: usize,
        experts: usize,
        max_shared_bytes: usize,
        tiled_from: usize,
        forced: Option<Self>,
    ) -> Self {
        let fits = tokens * top_k <= SORT_ONE_BLOCK_MAX
            && tokens < tiled_from
            && route_small_smem(tokens, experts, true) <= max_shared_bytes;
        match forced {
            _ if !fits => RoutePath::Split,
            Some(path) => path,
            None if tokens <= ROUTE_FUSED_MAX_TOKENS => RoutePath::Fused,
            None => RoutePath::Split,
        }
    }
}

/// Warps of `route_small`'s top-k phase for `tokens` tokens.
pub(super) fn route_topk_warps(tokens: usize) -> usize {
    tokens.clamp(1, ROUTE_TOPK_WARPS)
}

/// Dynamic shared memory of `route_small`: the larger of its top-k scratch (`2·E + 64` floats
/// per top-k warp, when it selects) and its pair sort's (`33·E + SLOT_COUNT_INTS` ints); the input preparation
/// needs none.
pub(super) fn route_small_smem(tokens: usize, experts: usize, selects: bool) -> usize {
    let topk = if selects {
        route_topk_warps(tokens) * (2 * experts + 64)
    } else {
        0
    };
    4 * topk.max(33 * experts + SLOT_COUNT_INTS)
}

/// Warps per router logit up to `ROUTER_SLICED_MAX_LOGITS` logits (`RL_SLICES`,
/// `RL_SLICED_MAX_LOGITS` in routing.cuh), one beyond.
pub(super) const ROUTER_SLICES: usize = 8;
pub(super) const ROUTER_SLICED_MAX_LOGITS: usize = 1024;

/// Warps per logit for `logits` logits (`router_slices` in routing.cuh).
pub(super) fn router_slices(logits: usize) -> usize {
    if logits <= ROUTER_SLICED_MAX_LOGITS {
        ROUTER_SLICES
    } else {
        1
    }
}

/// Tokens x experts per block of `router_logits_multi` (`RM_BT`, `RM_BE` in routing.cu), the
/// split path's logits beyond `ROUTER_SLICED_MAX_LOGITS` (a warp per 2 x 4 of them, bitwise a
/// warp per logit's).
pub(super) const ROUTER_MULTI_TILE: (usize, usize) = (8, 8);

/// Logits per 32-warp block (`route_small`, and `router_logits` up to
/// `ROUTER_SLICED_MAX_LOGITS` logits) for `logits` logits.
pub(super) fn router_logits_per_block(logits: usize) -> usize {
    32 / router_slices(logits)
}

/// Threads per block of `router_logits_tf32x3` (`RT_THREADS`).
pub(super) const ROUTER_TF32_THREADS: u32 = 128;

/// Token count from which router logits come from an f32 tiled kernel ([`RouterKernel`])
/// instead of a warp (or eight) per logit.
pub const ROUTER_TILED_FROM: usize = 1024;

/// Token count from which [`RouterKernel::Bf16`] computes the router logits: the 16-token
/// tiles against `router_logits_multi` below them (H200, the layer, µs, two rounds each, session
/// 37). Run 165: Nemotron 96 tokens 249.2 / 249.7 vs 248.0 / 247.6, 128 259.9 / 261.2 vs 261.4
/// / 264.4; Qwen3 96 144.6 / 144.7 vs 143.1 / 142.8, 128 155.1 / 154.8 vs 157.2 / 156.9. Run
/// 166: Nemotron 112 268.9 / 268.5 vs 266.2 / 264.9, 128 258.4 / 258.0 vs 258.3 / 258.2; Qwen3
/// 112 155.7 / 155.8 vs 155.2 / 154.7, 128 157.0 / 157.0 vs 158.0 / 157.8 → from 128 (level
/// or ahead there; behind at 112). Run 162 (the 64-token tiles, session 36): 128 tokens behind
/// (Nemotron 260.3 vs 257.2), so 160 until session 37; run 69 (against a warp per logit): the
/// 64-token tiles leave most SMs idle below ~128 tokens.
pub const ROUTER_BF16_FROM: usize = 128;

/// Token count from which `kernel` computes router logits: [`ROUTER_BF16_FROM`] or
/// [`ROUTER_TILED_FROM`], or for either `FP4MOE_ROUTER_TILED_FROM` (a benchmark knob, read
/// once per process, so workspaces and forwards agree).
pub(super) fn router_tiled_from(kernel: RouterKernel) -> usize {
    static KNOB: OnceLock<Option<String>> = OnceLock::new();
    tuning_knob(&KNOB, "FP4MOE_ROUTER_TILED_FROM")
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(match kernel {
            RouterKernel::Bf16 => ROUTER_BF16_FROM,
            _ => ROUTER_TILED_FROM,
        })
}

/// Blocks `router_logits_wide` fills by splitting k: two per SM (its occupancy, by registers)
/// of a 132-SM part, never more (a second partial wave would cost more than the split saves).
/// A constant rather than the device's SM count, so that the logits' bits (the split count
/// fixes the summation order) are the same on every device.
pub const ROUTER_WIDE_WAVE: usize = 264;

/// `router_logits_wide`'s tile (`RW_TOK` tokens x `RW_EXP` experts), k chunk (`RW_K`), threads
/// and dynamic shared memory (`RW_STAGES` stages of `RW_TOK + RW_EXP` rows of `RW_LD` floats).
pub(super) const ROUTER_WIDE_TILE: (usize, usize) = (64, 128);
pub(super) const ROUTER_WIDE_K: usize = 16;
pub(super) const ROUTER_WIDE_THREADS: u32 = 128;
pub(super) const ROUTER_WIDE_STAGES: usize = 4;
pub(super) const ROUTER_WIDE_LD: usize = 20;
pub(super) const ROUTER_WIDE_SHARED: u32 =
    (ROUTER_WIDE_STAGES * (ROUTER_WIDE_TILE.0 + ROUTER_WIDE_TILE.1) * ROUTER_WIDE_LD * 4) as u32;

/// How `router_logits_wide` splits k for `tokens` tokens: `(splits, k per split)`, k per split a
/// multiple of its 16-k chunk, at least 8 chunks per split (the last slice takes what is left,
/// possibly fewer), at most 8 splits, and as many as
/// fit in [`ROUTER_WIDE_WAVE`] blocks (1 from 16384 tokens of 128 experts, 4 at 4096).
pub fn router_wide_splits(tokens: usize, hidden: usize, experts: usize) -> (usize, usize) {
    router_k_splits(tokens, hidden, experts, ROUTER_WIDE_K)
}

/// `router_logits_bf16`'s k split: [`router_wide_splits`]' rule (the same tile) with its 32-k
/// chunks.
pub fn router_bf16_splits(tokens: usize, hidden: usize, experts: usize) -> (usize, usize) {
    router_k_splits(tokens, hidden, experts, ROUTER_BF16_K)
}

/// The k split of the 64 x 128 router tiles with `chunk`-wide k chunks (see
/// [`router_wide_splits`]).
pub(super) fn router_k_splits(
    tokens: usize,
    hidden: usize,
    experts: usize,
    chunk: usize,
) -> (usize, usize) {
    let tiles = tokens.div_ceil(ROUTER_WIDE_TILE.0) * experts.div_ceil(ROUTER_WIDE_TILE.1);
    let chunks = hidden.div_ceil(chunk).max(1);
    let splits = (ROUTER_WIDE_WAVE / tiles.max(1))
        .clamp(1, 8)
        .min((chunks / 8).max(1));
    let k_split = chunks.div_ceil(splits) * chunk;
    (hidden.div_ceil(k_split).max(1), k_split)
}

/// Floats of `CudaWorkspace::router_part` for `tokens` tokens: room for the partial sums of
/// `router_logits_wide` or `router_logits_bf16` where they split k (they run only from
/// `tiled_from` tokens, [`router_tiled_from`] of the layer's router kernel).
pub(super) fn router_part_len(
    tokens: usize,
    hidden: usize,
    experts: usize,
    tiled_from: usize,
) -> usize {
    let (wide, _) = router_wide_splits(tokens, hidden, experts);
    let (bf16, _) = router_bf16_splits(tokens, hidden, experts);
    let splits = wide.max(bf16);
    if tokens < tiled_from || splits == 1 {
        0
    } else {
        splits * tokens * experts
    }
}

/// `router_logits_bf16`'s k chunk, threads, dynamic shared memory (`RB_STAGES` stages of
/// `RB_TOK` x rows of `RB_XLD` floats and `RB_EXP` router rows of `RB_WLD` bf16) and the
/// padding of its bf16 router copy (rows to a multiple of its expert tile, columns of its k
/// chunk). Its tile is [`ROUTER_WIDE_TILE`].
pub(super) const ROUTER_BF16_K: usize = 32;
pub(super) const ROUTER_BF16_THREADS: u32 = 256;
pub(super) const ROUTER_BF16_STAGES: usize = 4;
pub(super) const ROUTER_BF16_XLD: usize = 40;
pub(super) const ROUTER_BF16_WLD: usize = 40;
pub(super) const ROUTER_BF16_SHARED: u32 = router_bf16_shared(ROUTER_WIDE_TILE.0);

/// `router_logits_bf16_t16`'s token tile and warps (`RB16_TOK`, `RB16_WARPS` in routing.cu):
/// 16 tokens x 128 experts, the 64-token tile's bits (the same MMAs per logit in the same
/// order) from four times as many blocks; 8 warps of 16 experts each (run 215: 4 warps of 32
/// took 14.5 µs under ncu at 512 Nemotron tokens, 8 take 11.4).
pub(super) const ROUTER_BF16_T16: (usize, u32) = (16, 8);

/// Dynamic shared memory of the bf16 router's ring for a `tok`-token tile.
pub(super) const fn router_bf16_shared(tok: usize) -> u32 {
    (ROUTER_BF16_STAGES * (tok * ROUTER_BF16_XLD * 4 + ROUTER_WIDE_TILE.1 * ROUTER_BF16_WLD * 2))
        as u32
}

/// Token count below which the bf16 router runs 16-token tiles rather than 64-token ones
/// (`FP4MOE_ROUTER_BF16_TILE=16|64` forces either, a benchmark knob). Run 165 (H200, the
/// layer, µs, two rounds, 16 vs 64): Nemotron 160 tokens 272.4 / 275.1 vs 277.5 / 277.8, 256
/// 312.3 / 310.4 vs 312.8 / 313.6, 512 412.1 / 412.8 vs 415.5 / 417.5, 1024 level, 1536
/// 682.0 / 680.2 vs 670.2 / 675.2; Qwen3 160 162.0 / 161.3 vs 165.7 / 165.3, 256 172.1 /
/// 172.4 vs 174.6 / 174.6, 512 and 1024 level, 1536 398.1 / 394.2 vs 387.4 / 391.9.
pub const ROUTER_BF16_T16_BELOW: usize = 1024;

/// The bf16 router's token tile for `tokens` tokens: `forced` (16 or 64) when given, else 16
/// below [`ROUTER_BF16_T16_BELOW`] tokens.
pub fn router_bf16_tile(tokens: usize, forced: Option<usize>) -> usize {
    match forced {
        Some(t @ (16 | 64)) => t,
        _ if tokens < ROUTER_BF16_T16_BELOW => ROUTER_BF16_T16.0,
        _ => ROUTER_WIDE_TILE.0,
    }
}

/// The router `[E, H]` as bf16 for `router_logits_bf16`, zero-padded to
/// `[E.div_ceil(128)·128, H.div_ceil(32)·32]`, where every weight is a finite bf16 value (a
/// router stored in bf16 in its checkpoint, the usual case: ModelOpt leaves routers unquantized)
/// and `H % 4 == 0` (its 16-byte x copies); `None` otherwise, which leaves the f32 kernels.
pub(super) fn router_bf16_copy(
    router: &[f32],
    experts: usize,
    hidden: usize,
) -> Option<(Vec<u16>, usize)> {
    let exact = |v: &f32| v.is_finite() && half::bf16::from_f32(*v).to_f32() == *v;
    if hidden % 4 != 0 || router.len() != experts * hidden || !router.iter().all(exact) {
        return None;
    }
    let hp = hidden.div_ceil(ROUTER_BF16_K) * ROUTER_BF16_K;
    let ep = experts.div_ceil(ROUTER_WIDE_TILE.1) * ROUTER_WIDE_TILE.1;
    let mut out = vec![0u16; ep * hp];
    for (dst, src) in out.chunks_mut(hp).zip(router.chunks(hidden)) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = half::bf16::from_f32(*s).to_bits();
        }
    }
    Some((out, hp))
}

/// How the router logits of tiled batches are computed (from [`ROUTER_BF16_FROM`] tokens for
/// [`RouterKernel::Bf16`], [`ROUTER_TILED_FROM`] for the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterKernel {
    /// `router_logits_tiled`: f32 FMAs in 64 x 64 tiles, each logit one thread's sequential
    /// sum over k.
    Simt,
    /// `router_logits_wide` (the default for f32 routers): f32 FMAs in 64-token x 128-expert
    /// tiles, k split into slices summed in a fixed order where the tiles alone would not fill
    /// one wave ([`router_wide_splits`]; the split depends on T, H and E only, so the logits
    /// are the same bits on every device); unsplit, the bits of [`RouterKernel::Simt`]. Run 64
    /// (routing stage, Nemotron): 64 / 97 / 167 / 296 / 548–562 µs at 1024 / 2048 / 4096 /
    /// 8192 / 16384 tokens, against 126 / 141 / 176 / 303 / 584–588 (SIMT) and 93 / 132 /
    /// 214–218 / 382 / 724 (TF32).
    Wide,
    /// `router_logits_tf32x3`: tensor cores in split TF32 (three MMAs per product, f32
    /// accumulation), relative error ~1e-6 against an f32 sum; the default at 1024–2047 tokens
    /// in session 12, slower than [`RouterKernel::Wide`] everywhere (run 64).
    Tf32x3,
    /// `router_logits_bf16`: bf16 tensor cores with exact products, for a router whose weights
    /// are bf16 values (else [`RouterKernel::Wide`] runs): x split into three bf16 pieces
    /// where a 16 x 16 fragment holds anything but bf16 values (one MMA per product for bf16
    /// activations, three otherwise), each 32-k chunk's MMAs summed from zero and added to the
    /// logit in f32; the 64 x 128 tile and k split of the wide kernel.
    Bf16,
}

impl RouterKernel {
    /// `FP4MOE_ROUTER=simt|wide|tf32x3|bf16`, a benchmark knob.
    pub(super) fn from_env() -> Option<Self> {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let choices = [
            ("simt", RouterKernel::Simt),
            ("wide", RouterKernel::Wide),
            ("tf32x3", RouterKernel::Tf32x3),
            ("bf16", RouterKernel::Bf16),
        ];
        tuning_choice(&KNOB, "FP4MOE_ROUTER", &choices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::compile;

    #[test]
    fn router_bf16_tile_by_batch_or_forced() {
        assert_eq!(router_bf16_tile(ROUTER_BF16_FROM, None), 16);
        assert_eq!(router_bf16_tile(ROUTER_BF16_T16_BELOW - 1, None), 16);
        assert_eq!(router_bf16_tile(ROUTER_BF16_T16_BELOW, None), 64);
        assert_eq!(router_bf16_tile(16384, Some(16)), 16);
        assert_eq!(router_bf16_tile(160, Some(64)), 64);
        // Anything else forced is ignored (the knob's value is not checked elsewhere).
        assert_eq!(router_bf16_tile(160, Some(32)), 16);
        // The 16-token ring is the smaller; both fit sm_86/89's 99 KB.
        assert!(router_bf16_shared(ROUTER_BF16_T16.0) < router_bf16_shared(ROUTER_WIDE_TILE.0));
        assert!(ROUTER_BF16_SHARED as usize <= 99 * 1024);
    }

    #[test]
    fn router_wide_splits_cover_k_once_and_fill_one_wave() {
        // Nemotron's H: 4 slices at 4096 tokens, none from 16384, 8 (the cap) at 1024.
        assert_eq!(router_wide_splits(16384, 2688, 128), (1, 2688));
        assert_eq!(router_wide_splits(4096, 2688, 128), (4, 672));
        assert_eq!(router_wide_splits(1024, 2688, 128), (8, 336));
        // The bf16 kernel's 32-k chunks: at most as many slices, each a multiple of 32.
        assert_eq!(router_bf16_splits(4096, 2688, 128), (4, 672));
        assert_eq!(router_bf16_splits(1024, 2688, 128), (8, 352));
        for tokens in [
            1usize, 63, 127, 128, 300, 1024, 1100, 2047, 4096, 8191, 16384, 40000,
        ] {
            for hidden in [4usize, 64, 132, 2064, 2688, 7168] {
                for experts in [8usize, 100, 128, 512] {
                    let tiles = tokens.div_ceil(64) * experts.div_ceil(128);
                    let mut most = 0;
                    for (chunk, (splits, k)) in [
                        (ROUTER_WIDE_K, router_wide_splits(tokens, hidden, experts)),
                        (ROUTER_BF16_K, router_bf16_splits(tokens, hidden, experts)),
                    ] {
                        assert!(k % chunk == 0 && (1..=8).contains(&splits));
                        // Every slice holds some k, and together they hold all of it.
                        assert!((splits - 1) * k < hidden && splits * k >= hidden);
                        assert!(splits == 1 || splits * tiles <= ROUTER_WIDE_WAVE);
                        assert!(splits == 1 || k >= 8 * chunk);
                        most = most.max(splits);
                    }
                    // Room for either kernel's partial sums, from either threshold.
                    for from in [ROUTER_BF16_FROM, ROUTER_TILED_FROM] {
                        let part = router_part_len(tokens, hidden, experts, from);
                        let split = tokens >= from && most > 1;
                        assert_eq!(part, if split { most * tokens * experts } else { 0 });
                    }
                }
            }
        }
    }

    #[test]
    fn sort_shared_memory_matches_the_kernels() {
        // The pass counts the sorts order the active experts by: one int per (32-expert chunk,
        // passes 0..=SLOT_PASS_CAP) for up to MAX_EXPERTS experts, after the launches' 33·E / E.
        let define = |name| compile::kernel_define("sort_pairs.cuh", name);
        assert_eq!(define("SLOT_COUNT_INTS"), SLOT_COUNT_INTS);
        let chunks = crate::cuda::MAX_EXPERTS.div_ceil(32);
        let per_pass = chunks * (define("SLOT_PASS_CAP") + 1);
        // sort_pairs_few: as many pass masks, then a total per 32-expert chunk and 33 pass sums.
        assert!(per_pass + chunks + 33 <= SLOT_COUNT_INTS);
        // Warp 0 scans the counts with one lane per passes value.
        assert_eq!(define("SLOT_PASS_CAP"), 31);
    }

    #[test]
    fn router_launch_constants_match_the_kernels() {
        assert_eq!(compile::kernel_define("routing.cu", "RL_WARPS"), 32);
        // The tiled launches' blocks (64 x 64 SIMT, 32 x 32 TF32).
        assert_eq!(compile::kernel_define("routing.cu", "RL_TILE"), 64);
        assert_eq!(compile::kernel_define("routing.cu", "RT_TOK"), 32);
        assert_eq!(compile::kernel_define("routing.cu", "RT_EXP"), 32);
        assert_eq!(
            compile::kernel_define("routing.cu", "RT_THREADS"),
            ROUTER_TF32_THREADS as usize
        );
        // The wide kernel's tile, chunk, threads and shared-memory ring.
        let wide = |name| compile::kernel_define("routing.cu", name);
        assert_eq!((wide("RW_TOK"), wide("RW_EXP")), ROUTER_WIDE_TILE);
        assert_eq!(wide("RW_K"), ROUTER_WIDE_K);
        assert_eq!(wide("RW_THREADS"), ROUTER_WIDE_THREADS as usize);
        assert_eq!(wide("RW_STAGES"), ROUTER_WIDE_STAGES);
        assert_eq!(wide("RW_LD"), ROUTER_WIDE_LD);
        // The bf16 kernel's (the wide kernel's tile).
        assert_eq!((wide("RB_TOK"), wide("RB_EXP")), ROUTER_WIDE_TILE);
        assert_eq!(wide("RB_K"), ROUTER_BF16_K);
        assert_eq!(wide("RB_THREADS"), ROUTER_BF16_THREADS as usize);
        assert_eq!(
            (wide("RB16_TOK"), wide("RB16_WARPS")),
            (ROUTER_BF16_T16.0, ROUTER_BF16_T16.1 as usize)
        );
        assert_eq!(wide("RB_STAGES"), ROUTER_BF16_STAGES);
        assert_eq!(
            (wide("RB_XLD"), wide("RB_WLD")),
            (ROUTER_BF16_XLD, ROUTER_BF16_WLD)
        );
        let routing_cuh = compile::kernel_text("routing.cuh");
        assert!(routing_cuh.contains(&format!("#define RL_SLICES {ROUTER_SLICES}\n")));
        let max = format!("#define RL_SLICED_MAX_LOGITS {ROUTER_SLICED_MAX_LOGITS}\n");
        assert!(routing_cuh.contains(&max));
        assert_eq!(
            (wide("RM_BT"), wide("RM_BE")),
            ROUTER_MULTI_TILE,
            "router_logits_multi's block tile"
        );
        assert_eq!(router_logits_per_block(128), 4);
        assert_eq!(router_logits_per_block(1025), 32);
    }

    #[test]
    fn route_path_follows_tokens_and_the_fused_kernels_limits() {
        use RoutePath::{Fused, Split};
        let (h200, sm89) = (227 * 1024, 99 * 1024);
        // E 128 on the H200, f32 router tiles (from 1024 tokens) unless `from` says otherwise.
        let on_h200_from =
            |tokens, top_k, from, forced| RoutePath::choose(tokens, top_k, 128, h200, from, forced);
        let on_h200 =
            |tokens, top_k, forced| on_h200_from(tokens, top_k, ROUTER_TILED_FROM, forced);
        // Nemotron-3 Nano (E 128, top-6): fused up to the threshold, split above.
        assert_eq!(on_h200(1, 6, None), Fused);
        let max = ROUTE_FUSED_MAX_TOKENS;
        assert_eq!(on_h200(max, 6, None), Fused);
        assert_eq!(on_h200(max + 1, 6, None), Split);
        // Forced either way (the layer's override or FP4MOE_ROUTE) ...
        assert_eq!(on_h200(1, 6, Some(Split)), Split);
        assert_eq!(on_h200(1023, 4, Some(Fused)), Fused);
        // ... but never fused beyond its one-block sort, the device's shared memory or the
        // split path's untiled router logits (bitwise equality).
        assert_eq!(on_h200(683, 6, Some(Fused)), Split);
        assert_eq!(on_h200(1024, 4, Some(Fused)), Split);
        // A bf16 router's tiled kernel from ROUTER_BF16_FROM tokens.
        let bf16_from = ROUTER_BF16_FROM;
        assert_eq!(
            on_h200_from(bf16_from - 1, 4, bf16_from, Some(Fused)),
            Fused
        );
        assert_eq!(on_h200_from(bf16_from, 4, bf16_from, Some(Fused)), Split);
        let tiny = route_small_smem(1, 128, true) - 1;
        let f32_tiles = ROUTER_TILED_FROM;
        assert_eq!(RoutePath::choose(1, 6, 128, tiny, f32_tiles, None), Split);
        assert_eq!(
            RoutePath::choose(1, 6, 128, tiny, f32_tiles, Some(Fused)),
            Split
        );
        // The limits (E 512, top-32) at the threshold fit sm_86/89's 99 KB.
        assert_eq!(
            RoutePath::choose(max, 32, 512, sm89, f32_tiles, None),
            Fused
        );
        // Shared memory: top-k scratch (2·E + 64 floats per warp, at most 16 warps) or the
        // sort's 33·E + 576 ints, whichever is larger.
        assert_eq!(route_small_smem(1, 128, true), 4 * (33 * 128 + 576));
        assert_eq!(route_small_smem(16, 256, true), 4 * 16 * (2 * 256 + 64));
        // At E = 512 the sort's (17472 ints) passes 16 warps' top-k scratch (17408 floats).
        assert_eq!(route_small_smem(100, 512, true), 4 * (33 * 512 + 576));
        assert_eq!(route_small_smem(16, 512, false), 4 * (33 * 512 + 576));
    }
}
