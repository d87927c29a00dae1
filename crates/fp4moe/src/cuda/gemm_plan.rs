//! Which expert-GEMM kernels a forward launches, as pure functions of the batch and the layer:
//! the decode or prefill path ([`GemmPath`], from mean tokens per routed expert), the mma decode
//! kernels' block shape ([`GemmShape`]) and token subtiles ([`subtiles_wanted`]), the decode
//! kernel family ([`DecodeKernel`], streaming for one token), the prefill tile ([`PrefillTile`])
//! and activation feed ([`PrefillFeed`]), and the expert-ready handoff's default
//! ([`handoff_by_default`]). The thresholds are crossovers measured on the H200; their docs give
//! the run and the numbers (docs/KERNEL_NOTES.md). Each choice can be forced per layer
//! (`CudaLayer::set_*`) or per process by a benchmark knob (`FP4MOE_*`). A choice changes
//! results only where README's limits say the last bits can move (the decode/prefill and
//! streaming/mma boundaries, the narrow shape); the others give the same bits.

use super::{pack, tuning_choice, tuning_knob, Error, Result};
use std::sync::OnceLock;

/// Block shapes of the mma decode GEMMs (`expert_gemm.cu`): row groups per block, the rest of
/// the warps split K (the deep shape: one warp per row group runs both of the wide shape's K
/// slices). Every shape of a launch gives the same bits except narrow, which splits K another
/// way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmShape {
    /// 2 row groups x 8 K slices: four times the wide shape's blocks (the default up to 2
    /// tokens until run 131; since then only for a launch of one expert up to 2 tokens).
    Narrow,
    /// 8 row groups x 2 K slices: one activation staging per 128 weight rows.
    Wide,
    /// One token subtile only (else wide): 8 row groups x 1 warp that runs both of the wide
    /// shape's K slices into separate sums added as the wide block adds them (the same bits),
    /// 8 warps per block and four blocks per SM (non-gated; three gated): twice the blocks
    /// resident, so one block's start (its routing reads, activation staging and first weight
    /// loads) overlaps three others' k loops, and no split-K exchange through shared memory.
    /// Each warp's chain is twice the wide one's, so it loses where the grid is about one wave
    /// (the default rule: [`DEEP_GATED_GEMM1_FROM_TOKENS`], [`DEEP_GATED_FROM_TOKENS`],
    /// [`DEEP_NONGATED_FROM_TOKENS`]).
    Deep,
    /// One token subtile and NVFP4 weights only (else wide): 4 row groups x the wide shape's 2
    /// K slices (the same bits) in 8-warp blocks, three per SM (gated) or four, so a grid of
    /// about one wave of wide blocks (a gated layer's GEMM1 holds one per SM: Qwen3-30B-A3B at
    /// 3 tokens, ~23 experts x 6 blocks on 132 SMs) runs in finer blocks without the deep
    /// shape's doubled chains (the default rule: [`HALF_FROM_TOKENS`]).
    Half,
    /// The half shape at four blocks per SM for a gated layer's NVFP4 GEMM1 (64 registers where
    /// [`GemmShape::Half`] has 80): 32 warps per SM instead of 24, so a third more weight bytes
    /// in flight (the default rule: [`HALF4_GATED_GEMM1_FROM_TOKENS`]). Every other half kernel
    /// already runs four blocks per SM: there it is [`GemmShape::Half`].
    Half4,
}

impl GemmShape {
    /// The shape that runs `nsub` subtiles: every shape but narrow and wide (deep and the half
    /// shapes) exists for one subtile only.
    pub(super) fn resolve(self, nsub: usize) -> Self {
        match self {
            GemmShape::Narrow | GemmShape::Wide => self,
            _ if nsub != 1 => GemmShape::Wide,
            shape => shape,
        }
    }
    /// Warps per block: 16, or 8 for the 32-token variants (register budget) and the
    /// one-subtile shapes (deep, half).
    pub(super) fn warps(self, nsub: usize) -> usize {
        if nsub == 4 || !matches!(self.resolve(nsub), GemmShape::Narrow | GemmShape::Wide) {
            8
        } else {
            16
        }
    }
    /// Row groups per block (`expert_gemm.cu`'s instantiations).
    pub(super) fn rgpb(self, nsub: usize) -> usize {
        match (self.resolve(nsub), nsub == 4) {
            (GemmShape::Narrow, false) => 2,
            (GemmShape::Narrow, true) => 1,
            (GemmShape::Wide | GemmShape::Deep, false) => 8,
            (GemmShape::Wide | GemmShape::Deep, true) => 4,
            (GemmShape::Half | GemmShape::Half4, _) => 4,
        }
    }
    pub(super) fn name(self, nsub: usize) -> &'static str {
        match self.resolve(nsub) {
            GemmShape::Narrow => "narrow",
            GemmShape::Wide => "wide",
            GemmShape::Deep => "deep",
            GemmShape::Half => "half",
            GemmShape::Half4 => "half4",
        }
    }
    /// The shape of an NVFP4 (`nvfp4`) or bf16 GEMM1 (`gemm1`) or GEMM2 of a gated or
    /// non-gated layer (`gated`), `tokens` tokens over `slots` grid experts:
    /// - one expert (a shared or dense expert, or top-1 at one token): narrow up to 2 tokens,
    ///   where the wide grid would be a few blocks for the whole GPU (a shared expert of 3712
    ///   rows: 29), else wide (run 131: 2 tokens narrow / wide, Nemotron-3 Nano 60.4 / 50.3,
    ///   Qwen3-30B-A3B 52.4 / 41.5; one token, mma kernels forced, runs 128 and 132: 37.9 /
    ///   35.0);
    /// - routed NVFP4 experts: deep from [`DEEP_GATED_GEMM1_FROM_TOKENS`] tokens for a gated
    ///   layer's GEMM1, [`DEEP_GATED_FROM_TOKENS`] for its GEMM2, [`DEEP_NONGATED_FROM_TOKENS`]
    ///   for both of a non-gated one (runs 153, 177, 179, 184); below, half from
    ///   [`HALF_FROM_TOKENS`] (runs 178–180), a gated GEMM1's at four blocks per SM from
    ///   [`HALF4_GATED_GEMM1_FROM_TOKENS`] (runs 183–184), else wide. Run 138 (H200, µs per
    ///   layer, wide / deep both / deep GEMM1 only / deep GEMM2 only; wide the mean of two
    ///   rounds): Qwen3 4 tokens 57.0 / 53.3 / 54.4 / 55.4, 8 78.4 / 74.6 / 76.5 / 75.8, 32 141.3 / 125.8 /
    ///   131.8 / 134.6, 64 154.4 / 144.4 / 151.0 / 147.6 (its wide gated GEMM1 holds one block
    ///   per SM, whose start nothing hides); Nemotron 6 tokens 79.2 / 82.6 / 79.3 / 82.3, 8
    ///   95.7 / 98.4 / 99.8 / 94.5, 12 112.3 / 118.0 / 120.0 / 110.8, 32 177.8 / 173.8 / 177.7
    ///   / 173.4, 64 230.7 / 231.4 / 230.7 / 230.0 (two wide blocks per SM already overlap;
    ///   deep loses where its grid is little more than one wave; on session 33's weight layout
    ///   Nemotron's deep GEMMs win from 6 tokens, run 153); run 137: 2 tokens, deep both,
    ///   Qwen3 43.4 against 36.5, Nemotron 57.4 against 45.2 (less than a wave: each warp's
    ///   chain doubles). bf16 routed experts are not measured with the deep shape and stay
    ///   wide.
    ///
    /// The deep and half shapes exist for one token subtile and fall back to wide for more; they
    /// give the wide shape's bits, so this choice never changes results. `FP4MOE_GEMM_SHAPE=SHAPE`
    /// or `GEMM1:GEMM2` (each `narrow|wide|deep|half|half4|auto`, `auto` the rule above) overrides
    /// it for every launch of that GEMM, one expert and bf16 weights included (a tuning knob
    /// for benchmarks; `deep1` / `deep2` read `deep:wide` / `wide:deep`). A forced half shape
    /// runs on NVFP4 weights ([`GemmShape::Half`]), else wide; a forced `half4` is
    /// [`GemmShape::Half`] except for a gated layer's GEMM1.
    pub(super) fn chosen(
        tokens: usize,
        slots: usize,
        forced: Option<Self>,
        gemm1: bool,
        gated: bool,
        nvfp4: bool,
    ) -> Self {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let knob = tuning_knob(&KNOB, "FP4MOE_GEMM_SHAPE").and_then(|v| knob_shape(v, gemm1));
        let shape = match (forced, knob) {
            (Some(shape), _) | (None, Some(Some(shape))) => shape,
            _ => Self::rule(tokens, slots, gemm1, gated, nvfp4),
        };
        // The half shape has kernels for NVFP4 weights only; at four blocks per SM for a
        // gated GEMM1 only (the others' half kernels already run four).
        match shape {
            GemmShape::Half | GemmShape::Half4 if !nvfp4 => GemmShape::Wide,
            GemmShape::Half4 if !(gemm1 && gated) => GemmShape::Half,
            shape => shape,
        }
    }

    /// The default rule of [`GemmShape::chosen`].
    fn rule(tokens: usize, slots: usize, gemm1: bool, gated: bool, nvfp4: bool) -> Self {
        if slots <= 1 {
            return if tokens <= 2 {
                GemmShape::Narrow
            } else {
                GemmShape::Wide
            };
        }
        let deep_from = match (gated, gemm1) {
            (true, true) => DEEP_GATED_GEMM1_FROM_TOKENS,
            (true, false) => DEEP_GATED_FROM_TOKENS,
            (false, _) => DEEP_NONGATED_FROM_TOKENS,
        };
        if nvfp4 && tokens >= deep_from {
            GemmShape::Deep
        } else if nvfp4 && gated && gemm1 && tokens >= HALF4_GATED_GEMM1_FROM_TOKENS {
            GemmShape::Half4
        } else if nvfp4 && tokens >= HALF_FROM_TOKENS {
            GemmShape::Half
        } else {
            GemmShape::Wide
        }
    }
}

/// `FP4MOE_GEMM_SHAPE`'s shape for GEMM1 (`gemm1`) or GEMM2: `Some(None)` for `auto` (the
/// rule), `None` for a value it does not name.
fn knob_shape(value: &str, gemm1: bool) -> Option<Option<GemmShape>> {
    let value = match value {
        "deep1" => "deep:wide",
        "deep2" => "wide:deep",
        v => v,
    };
    let (one, two) = value.split_once(':').unwrap_or((value, value));
    match if gemm1 { one } else { two } {
        "narrow" => Some(Some(GemmShape::Narrow)),
        "wide" => Some(Some(GemmShape::Wide)),
        "deep" => Some(Some(GemmShape::Deep)),
        "half" => Some(Some(GemmShape::Half)),
        "half4" => Some(Some(GemmShape::Half4)),
        "auto" => Some(None),
        _ => None,
    }
}

/// `FP4MOE_PREFILL_FEED`'s feed for GEMM1 (`gemm1`) or GEMM2; `None` for `auto` and for a
/// value it does not name.
fn knob_feed(value: &str, gemm1: bool) -> Option<PrefillFeed> {
    let (one, two) = value.split_once(':').unwrap_or((value, value));
    match if gemm1 { one } else { two } {
        "cp" => Some(PrefillFeed::CpAsync),
        "tma" => Some(PrefillFeed::Tma),
        "tma2" => Some(PrefillFeed::TmaMulticast),
        _ => None,
    }
}

/// Mean tokens per routed expert below which the prefill tiles hand GEMM1's rows to GEMM2 per
/// expert by default (run 145, two rounds: 1.9-2.4 % faster at 12-16 per expert (256 tokens,
/// both presets), 1.4 % at 64 (Qwen3 1024 tokens), level at 48 (Nemotron 1024), 0.3-0.8 %
/// slower at 192-1024 (4096-16384 tokens)).
pub const PREFILL_HANDOFF_BELOW: usize = 128;

/// Whether routed GEMMs on `path` over `pairs` routed pairs of `experts` experts take the
/// expert-ready handoff unless forced: the decode kernels always (bf16 weights take them on
/// either path), the prefill tiles below [`PREFILL_HANDOFF_BELOW`] mean tokens per expert.
pub(super) fn handoff_by_default(
    path: GemmPath,
    nvfp4: bool,
    pairs: usize,
    experts: usize,
) -> bool {
    let prefill_tiles = path == GemmPath::Prefill && nvfp4;
    !prefill_tiles || pairs < PREFILL_HANDOFF_BELOW * experts
}

/// Routed NVFP4 experts: both decode GEMMs take the half shape from this many tokens until
/// their deep threshold ([`DEEP_GATED_GEMM1_FROM_TOKENS`], [`DEEP_GATED_FROM_TOKENS`],
/// [`DEEP_NONGATED_FROM_TOKENS`]); wide below. Runs 178–180 (H200, µs, mean of two rounds,
/// GEMM1:GEMM2 shapes forced by `FP4MOE_GEMM_SHAPE`, one call each):
/// - Qwen3-30B-A3B (gated), half:half / half:deep / half:wide / wide:wide / deep:deep (the
///   rule before: wide:wide up to 3 tokens, deep:deep from 4; deep:deep at 2–3 from run 181):
///   2 tokens 37.5 / 38.9 / 37.5 / **35.2** / 43.5; 3 **42.0** / 42.5 / 42.4 / 45.7 / 51.8
///   (`--stages` at 3, half:wide against wide:wide: GEMM1 18.4 against 25.2: the wide gated
///   GEMM1's ~137 one-per-SM blocks run a second wave on 132 SMs); 4 45.4 / **44.8** / 46.2 /
///   50.2 / 48.3; 5 50.9 / 51.4 / 51.6 / 56.0 / 52.3; 6 56.7 / 55.6 / 57.7 / 62.4 / **55.3**;
///   8 63.9 / 61.3 / 65.6 / 70.9 / **60.7**.
/// - Nemotron-3 Nano (non-gated), half:half / wide:half / half:wide / wide:wide (deep:deep
///   from 5): 2 tokens 41.1 / 41.1 / 41.2 / **40.4**; 3 **47.9** / **47.9** / 49.0 / 49.2; 4
///   **54.9** / 55.3 / 56.8 / 55.0; 5 62.5 / 63.2 / 63.6 / 62.7 (deep).
pub const HALF_FROM_TOKENS: usize = 3;

/// Routed NVFP4 experts of a gated layer: GEMM2 takes the deep shape from this many tokens (run
/// 138: 4.8-11 % faster at 4-64 tokens on Qwen3-30B-A3B with both GEMMs deep; run 137: 19 %
/// slower at 2; run 179: half GEMM1 with deep GEMM2 at 4 tokens 44.8 against 45.4 half:half).
pub const DEEP_GATED_FROM_TOKENS: usize = 4;

/// Routed NVFP4 experts of a gated layer: GEMM1 takes the deep shape from this many tokens
/// (the half shape before it, from [`HALF_FROM_TOKENS`], at four blocks per SM from
/// [`HALF4_GATED_GEMM1_FROM_TOKENS`]). Run 184 (Qwen3-30B-A3B, W4A16, GEMM2 by the rule,
/// GEMM1 half4 / deep, µs, mean of two rounds): 6 tokens 51.9 / 55.2, 7 58.3 / 58.3, 8 60.0 /
/// 60.5, 10 66.4 / 65.8, 12 72.8 / 73.7, 14 76.4 / 76.8, 16 81.5 / 81.5, 20 91.7 / 89.9 (the
/// crossover is 10-16, where the two are within 1 %); run 183: 24 96.2 / 94.5, 32 104.1 /
/// 102.3. Run 179 (GEMM1 half at three blocks / deep): 4 tokens 44.8 / 48.3, 5 51.4 / 52.3,
/// 6 55.6 / 55.3, 8 61.3 / 60.7, 12 76.2 / 73.8. Was 6 in session 40, 4 (with GEMM2) before.
pub const DEEP_GATED_GEMM1_FROM_TOKENS: usize = 14;

/// Routed NVFP4 experts of a gated layer: GEMM1 takes the half shape at four blocks per SM
/// ([`GemmShape::Half4`]) from this many tokens until [`DEEP_GATED_GEMM1_FROM_TOKENS`]. Run 183
/// (Qwen3-30B-A3B, GEMM2 by the rule, GEMM1 half at three / four blocks per SM, µs, mean of
/// two rounds): 3 tokens **41.8** / 44.1, 4 44.5 / 44.7, 5 51.3 / **48.2**, 6 54.9 / **52.0**,
/// 8 60.9 / 60.1, 12 75.8 / 73.0; run 184 alike (3 42.1 / 43.9, 4 44.7 / 44.4, 5 51.4 / 48.2;
/// W4A4 5 51.7 / 48.6). Three blocks per SM below (the gated half kernel since session 40).
pub const HALF4_GATED_GEMM1_FROM_TOKENS: usize = 5;

/// Routed NVFP4 experts of a non-gated layer: both decode GEMMs take the deep shape from this
/// many tokens (one token subtile only: above [`DEEP_NONGATED_ONE_SUBTILE_UP_TO_QUARTERS`]
/// quarter tokens per expert, the wide kernels with two or four subtiles run). Run 153 (H200, Nemotron-3 Nano,
/// µs, mean of two rounds, both GEMMs deep against the rule before it, GEMM2 deep from 8 and
/// GEMM1 from 40): 4 tokens 60.1 / 57.6, 6 73.7 / 75.0, 8 84.3 / 87.8, 12 102.8 / 106.1, 16
/// 127.8 / 128.9, 24 151.8 / 157.4, 32 163.2 / 170.3, 40 176.0 / 175.0; 2 tokens 53.6 / 41.4
/// (less than a wave). Run 177 (three k groups in the deep and wide kernels; deep forced /
/// default): 3 tokens 57.8 / 49.4, 4 55.5 / 55.1, **5 63.1 / 64.5** → from 5 (was 6). Until
/// session 35: GEMM2 from 8 (run 138, on the nibble-planar layout: GEMM1 deep 4-7 % slower at
/// 8-12 tokens then) and GEMM1 from 40 (run 148: 2.4-2.6 % faster at 48-80 tokens).
pub const DEEP_NONGATED_FROM_TOKENS: usize = 5;

/// Mean tokens per routed expert up to which a gated layer's deep decode GEMMs keep one token
/// subtile (busier experts take several passes) instead of the wide kernels' two. Run 148 (H200,
/// Qwen3-30B-A3B, forced decode, one subtile deep against the default two wide): 5 per expert
/// 139.2 / 170.6 µs, 6 152.9 / 174.8, 8 178.8 / 179.0.
pub const DEEP_GATED_ONE_SUBTILE_UP_TO: usize = 8;

/// Mean tokens per routed expert, in quarters (rounded up), up to which a non-gated layer's deep
/// decode GEMMs keep one token subtile: 4.75. Runs 176–177 (H200, Nemotron-3 Nano, µs, mean of
/// two rounds, one subtile deep against two wide, both at three k groups in flight): 88 tokens
/// (4.1 per expert) 231.3 / 237.7, 96 (4.5) 231.7 / 232.9, 100 (4.7) 243.4 / 246.6, 104 (4.9)
/// 263.6 / 254.7 and 250.2 / 248.2, 112 (5.25) 258.1 / 252.8. Was 5 per expert (run 150, two k
/// groups in the wide kernels: 104 tokens 270.1 / 275.8) and 4 until session 35.
pub const DEEP_NONGATED_ONE_SUBTILE_UP_TO_QUARTERS: usize = 19;

/// Mean routed tokens per expert in quarters, rounded up, at least 1: `⌈4·tokens·top_k /
/// experts⌉` (a rule "at most N per expert" reads `≤ 4N` here, the same batches).
pub(super) fn per_expert_quarters(tokens: usize, top_k: usize, experts: usize) -> usize {
    (4 * tokens * top_k).div_ceil(experts.max(1)).max(1)
}

/// Token subtiles (8 tokens each) per pass of the mma decode GEMMs, from the mean tokens per
/// expert under uniform routing in quarters (`per_expert_quarters`, from
/// [`per_expert_quarters`]): 1 for a batch of at most 8 tokens or up to 4 tokens per expert (on
/// the deep shape, which exists for one subtile, up to [`DEEP_GATED_ONE_SUBTILE_UP_TO`] tokens
/// for both GEMMs of a gated layer (`gated`), [`DEEP_NONGATED_ONE_SUBTILE_UP_TO_QUARTERS`]
/// quarters for a non-gated one), 2 up to 12 tokens, else 4. Busier
/// experts take several passes (their weights come from L2 the second time; the grouping
/// dispatches them first, `sort_pairs.cuh`); larger tiles cost more than that in occupancy
/// (measured: docs/KERNEL_NOTES.md).
pub(super) fn subtiles_wanted(
    tokens: usize,
    per_expert_quarters: usize,
    gated: bool,
    shape: GemmShape,
) -> usize {
    let one_up_to = match (shape, gated) {
        (GemmShape::Deep, true) => 4 * DEEP_GATED_ONE_SUBTILE_UP_TO,
        (GemmShape::Deep, false) => DEEP_NONGATED_ONE_SUBTILE_UP_TO_QUARTERS,
        _ => 4 * 4,
    };
    if tokens <= 8 || per_expert_quarters <= one_up_to {
        1
    } else if per_expert_quarters <= 4 * 12 {
        2
    } else {
        4
    }
}

/// Which expert-GEMM kernels run a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// `expert_gemm.cu`: split-K mma.sync streaming, for few tokens per expert.
    Decode,
    /// `prefill_gemm.cu`: tensor-core tiles (wgmma on sm_90a) of 32 or 128 tokens over 256
    /// weight rows, or 128 (two blocks per SM) or 256 tokens over 128 rows ([`PrefillTile`]).
    Prefill,
}

/// Mean tokens per routed expert, in quarters, from which gated layers take the prefill
/// kernels. Measured (docs/KERNEL_NOTES.md run 149, µs, Qwen3-30B-A3B, E 128, top-8, decode on
/// the deep shape with one token subtile up to [`DEEP_GATED_ONE_SUBTILE_UP_TO`] per expert /
/// prefill): 80 tokens (5 per expert) 137.7 / 157.2, 96 (6) 151.6 / 159.3, 104 (6.5) 157.4 /
/// 160.4, 112 (7) 166.0 / 161.1, 120 (7.5) 173.0 / 163.4, 128 (8) 176.9 / 158.3 → prefill from
/// 7. Run 176 (the decode GEMMs since sessions 37–38, forced decode / default): 112 tokens
/// 151.3 / 153.9, 120 (7.5) 154.8 / 154.8, 128 162.7 / 154.9 → prefill from 7.25. Until session
/// 39 from 7; until session 34 from 4.75 (runs 133–135, where forced decode ran the wide
/// two-subtile kernels from 5 per expert: 169.4 / 168.0 at 5), from 3 until session 30.
pub const PREFILL_GATED_FROM_QUARTERS: usize = 29;

/// Mean tokens per routed expert, in quarters, from which non-gated layers take the prefill
/// kernels. Measured (runs 134–135, µs, forced decode / forced prefill, Nemotron-3 Nano, E 128,
/// top-6): 80 tokens (3.75 per expert) 252.5 / 273.9, 96 (4.5) 266.0 / 276.7, 112 (5.25) 284.9
/// / 291.9, 128 (6) 287.9 / 286.1, 160 (7.5) 318.1 / 303.6: decode ahead by 2.4 % at 5.25,
/// behind by 0.6 % at 6 → prefill from 5.75. Was 3.75 (session 29), 3 (run 125).
pub const PREFILL_NONGATED_FROM_QUARTERS: usize = 23;

/// Tokens, in quarters, from which one gated expert holding every token (a dense layer, the
/// shared expert) takes the prefill kernels: 3 tokens, the routed layers' rule until run 125.
/// Not re-measured since the decode kernels' sessions 28–30: one expert gives either path a
/// small grid.
pub const PREFILL_DENSE_GATED_FROM_QUARTERS: usize = 12;

/// The same for one non-gated expert: from 4 tokens (the 3.75 per expert of session 29's
/// routed rule), not re-measured either.
pub const PREFILL_DENSE_NONGATED_FROM_QUARTERS: usize = 15;

/// Mean tokens per expert (`pairs / experts`, rounded down) from which a gated layer's prefill
/// path uses the 128-token tiles instead of the 32-token ones. docs/KERNEL_NOTES.md run 159
/// (H200, Qwen3-30B-A3B, the layer, µs, dual 128-token against 32-token tiles, two rounds): 32
/// per expert (512 tokens) 263.5 / 238.0, 36 (576) 266.7 / 272.9, 40 (640) 268.9 / 293.4, 48 (768)
/// 278.2 / 318.0. Was 32 for both kinds from run 15 (on kernels long replaced) to session 35.
pub const PREFILL_LARGE_TILE_FROM_GATED: usize = 33;

/// The same for a non-gated layer. Run 159 (Nemotron-3 Nano, µs, as above): 33 per expert (704
/// tokens) 502.4 / 483.7, 36 (768) 515.7 / 512.0, 39 (832) 522.1 / 545.4, 42 (896) 534.7 /
/// 565.5.
pub const PREFILL_LARGE_TILE_FROM_NONGATED: usize = 37;

/// [`PREFILL_LARGE_TILE_FROM_GATED`] or [`PREFILL_LARGE_TILE_FROM_NONGATED`].
pub const fn prefill_large_tile_from(gated: bool) -> usize {
    if gated {
        PREFILL_LARGE_TILE_FROM_GATED
    } else {
        PREFILL_LARGE_TILE_FROM_NONGATED
    }
}

/// Mean tokens per expert from which GEMM1 uses 256-token tiles where they apply (sm_90a, TMA
/// feed, K from [`PREFILL_WIDE_MIN_K`]); below it, and for GEMM2 always (since run 106), the
/// two-per-SM 128-token tiles run (docs/KERNEL_NOTES.md runs 58–59, µs per GEMM: dual faster
/// at 48 tokens per expert by 9–15 % and at 192 by 0–4 %, level at 384, wide faster at 768 by
/// 1–6 %, where converting each weight fragment once for 256 tokens outweighs the overlap of
/// two blocks).
pub const PREFILL_WIDE_TILE_FROM: usize = 256;

/// Smallest K (the GEMM's reduction length) for which the default picks 256-token tiles. A
/// wide block has half the warps of a dual one and one block per SM, so its fill and epilogue
/// are exposed; what it saves (each weight fragment converted once for 256 tokens) grows with
/// K. docs/KERNEL_NOTES.md run 109 (the layer against the dual tiles, two rounds): K = 2048
/// (Qwen3-30B's GEMM1) dual faster at 256–768 tokens per expert (4096–12288 tokens: −0.5 to
/// −5 %), level at 1024 (run 108); K = 2688 (Nemotron's GEMM1) wide faster at 288–768 per
/// expert (1–4 %). Run 45, against the older 128-token tiles: K = 768 (Qwen3's GEMM2) 12 %
/// slower with them.
pub const PREFILL_WIDE_MIN_K: usize = 2304;

/// Mean tokens per expert from which the 32-token tiles take their activations by TMA (one
/// 32-row box per chunk, both GEMMs; GEMM1 then reads the sorted copy of the input) instead of
/// cp.async. docs/KERNEL_NOTES.md run 106 (Nemotron / Qwen3, the layer, against cp.async): TMA
/// 0.5–0.6 % faster at 8 tokens per expert (Qwen3, 128 tokens), 0.7–3.0 % at 12–24; run 103:
/// level at 6 (Nemotron, 128 tokens) and 0.9–2.9 % slower at 0.4–4, where the sorted copy's
/// fixed cost (one more launch and a `T·k·H` write) outweighs the kernels' gain (no cp.async
/// per activation piece, no proxy fence per chunk).
pub const PREFILL_SMALL_TMA_FROM: usize = 8;

/// Token-tile size of the prefill kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillTile {
    /// `prefill_small_*`: 32-token tiles over 256 weight rows, two blocks per SM streaming the
    /// weights.
    Small,
    /// `prefill_gemm*` / `prefill_tma*`: 128-token tiles over 256 weight rows, one block per SM.
    Large,
    /// `prefill_wide_*`: 256-token tiles over 128 weight rows, one block of 8 warps per SM; each
    /// converted weight fragment feeds 256 token columns. TMA-fed only (sm_90a): where the TMA
    /// feed does not apply, [`PrefillTile::Large`] runs instead.
    Wide,
    /// `prefill_dual_*`: 128-token tiles over 128 weight rows, two blocks of 8 warps per SM, so
    /// one block's fill and epilogue overlap the other's MMAs. TMA-fed only, like
    /// [`PrefillTile::Wide`]: where that feed does not apply, [`PrefillTile::Large`] runs
    /// instead. The default from [`prefill_large_tile_from`] tokens per expert.
    Dual,
}

impl PrefillTile {
    /// `FP4MOE_PREFILL_TILE=32|128|256|128x2`, a benchmark knob.
    pub(super) fn from_env() -> Option<Self> {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let choices = [
            ("32", PrefillTile::Small),
            ("128", PrefillTile::Large),
            ("256", PrefillTile::Wide),
            ("128x2", PrefillTile::Dual),
        ];
        tuning_choice(&KNOB, "FP4MOE_PREFILL_TILE", &choices)
    }

    /// The tile for `pairs` pairs over `experts` experts of a gated (`gated`) or non-gated
    /// layer: `forced` when given, else the dual 128-token tiles from
    /// [`prefill_large_tile_from`] mean tokens per expert (a GEMM may still
    /// take wide ones: `PrefillTile::for_gemm`), 32-token tiles below; the next smaller tile
    /// whenever the device lacks a tile's shared memory (sm_86/89's 99 KB hold only the
    /// 32-token tiles, A100's 163 KB the 128-token ones). Wide and dual tiles also need the TMA
    /// feed: [`PrefillTile::for_feed`].
    pub fn choose(
        pairs: usize,
        experts: usize,
        gated: bool,
        max_shared_bytes: usize,
        forced: Option<Self>,
    ) -> Self {
        let per_expert = pairs / experts.max(1);
        let wanted = forced.unwrap_or(if per_expert >= prefill_large_tile_from(gated) {
            PrefillTile::Dual
        } else {
            PrefillTile::Small
        });
        // A TMA-only tile falls back to a 128-token one where the TMA feed does not apply
        // (`for_feed`), so it needs a device that holds that one too.
        let fits = |t: PrefillTile| {
            t.shared_bytes() <= max_shared_bytes
                && (!t.tma_only() || PrefillTile::Large.shared_bytes() <= max_shared_bytes)
        };
        [wanted, PrefillTile::Large, PrefillTile::Small]
            .into_iter()
            .find(|&t| t.tokens() <= wanted.tokens() && fits(t))
            .unwrap_or(PrefillTile::Small)
    }

    /// The default rule per GEMM (a forced tile skips it): GEMM1 of reduction length `k` from
    /// [`PREFILL_WIDE_MIN_K`] takes the wide tiles in place of the dual ones from
    /// [`PREFILL_WIDE_TILE_FROM`] mean tokens per expert, where the device holds them. GEMM2
    /// keeps the dual tiles: its epilogue (the pair outputs, f32 when measured) overlaps the
    /// other block's MMAs there, where one wide block per SM exposes it (docs/KERNEL_NOTES.md
    /// run 104: 718 of 2008 µs at 16384 tokens, Nemotron). Run 106, Nemotron's GEMM2:
    /// 1128–1150 → 1049–1054 µs at 8192 tokens (384 per expert), level at 16384 (768 per
    /// expert).
    pub(super) fn for_gemm(
        self,
        gemm: PrefillGemm,
        k: usize,
        per_expert: usize,
        max_shared_bytes: usize,
    ) -> Self {
        let wide = self == PrefillTile::Dual
            && gemm != PrefillGemm::Gemm2
            && k >= PREFILL_WIDE_MIN_K
            && per_expert >= PREFILL_WIDE_TILE_FROM
            && PrefillTile::Wide.shared_bytes() <= max_shared_bytes;
        if wide {
            PrefillTile::Wide
        } else {
            self
        }
    }

    /// Rows of one TMA box of the tile's activation feed (`prefill_gemm.cu`'s `PF_BOX_ROWS`):
    /// 32 for the 32-token tiles (their 8- and 16-column tiles load the whole box too); 64 for
    /// the others, whose widths are multiples of 64.
    pub const fn box_rows(self) -> u32 {
        match self {
            PrefillTile::Small => 32,
            _ => 64,
        }
    }

    /// Whether the tile's kernels exist only TMA-fed with one CTA (the 8-slot wide and dual
    /// tiles: no cp.async or multicast variants).
    pub const fn tma_only(self) -> bool {
        matches!(self, PrefillTile::Wide | PrefillTile::Dual)
    }

    /// This tile, or the 128-token one where a TMA-only tile ([`PrefillTile::tma_only`]) would
    /// need the TMA feed and `feed` is cp.async.
    pub fn for_feed(self, feed: PrefillFeed) -> Self {
        if self.tma_only() && feed == PrefillFeed::CpAsync {
            PrefillTile::Large
        } else {
            self
        }
    }

    /// Tokens per tile (`PF_NT`, `PF_NT_SMALL`, `PF_NT_WIDE`).
    pub const fn tokens(self) -> usize {
        match self {
            PrefillTile::Small => 32,
            PrefillTile::Large | PrefillTile::Dual => 128,
            PrefillTile::Wide => 256,
        }
    }

    /// 16-row weight slots per block: 16 (256 rows), 8 for the wide and dual tiles.
    pub const fn slots(self) -> usize {
        match self {
            PrefillTile::Small | PrefillTile::Large => 16,
            PrefillTile::Wide | PrefillTile::Dual => 8,
        }
    }

    /// Threads per block (`PF_THREADS`, `PF_THREADS_SMALL`, `PF_THREADS_WIDE`,
    /// `PF_THREADS_DUAL`): 16 warps of one 16-row slot each for the large tiles, 8 warps of two
    /// slots for the small ones (two blocks per SM), 8 warps of one slot for the wide and dual
    /// ones.
    pub const fn threads(self) -> usize {
        match self {
            PrefillTile::Small | PrefillTile::Wide | PrefillTile::Dual => 256,
            PrefillTile::Large => 512,
        }
    }

    /// Blocks per SM the kernels are built for (`__launch_bounds__`).
    pub const fn blocks_per_sm(self) -> usize {
        match self {
            PrefillTile::Small | PrefillTile::Dual => 2,
            PrefillTile::Large | PrefillTile::Wide => 1,
        }
    }

    /// Dynamic shared memory of a block: 3 KB of row table, barriers and GEMM2's per-column
    /// pairs and router weights, then 5 ring stages of the tile's activations (128 bytes per
    /// token) and the slots' weights (576 bytes each), rounded up to 1 KB (`pf_stage_bytes`).
    pub const fn shared_bytes(self) -> usize {
        3072 + 5 * (self.tokens() * 128 + self.slots() * 576).div_ceil(1024) * 1024
    }

    /// Output row groups of a block: the slots, half of them for the gated GEMM1 (a g row
    /// group takes a gate and an up slot).
    pub(super) fn row_groups(self, gemm: PrefillGemm) -> usize {
        match gemm {
            PrefillGemm::Gemm1Gated => self.slots() / 2,
            PrefillGemm::Gemm1Plain | PrefillGemm::Gemm2 => self.slots(),
        }
    }
}

impl PrefillGemm {
    /// The kernel that runs this GEMM on `tile` fed by `feed` (static names: no allocation per
    /// launch); `None` for the pairs no kernel implements: multicast on 32-token tiles, wide and
    /// dual tiles fed by cp.async or multicast ([`PrefillTile::for_feed`] and
    /// [`PrefillFeed::choose`] never pick them).
    pub(super) fn kernel(self, tile: PrefillTile, feed: PrefillFeed) -> Option<&'static str> {
        use PrefillFeed::{CpAsync, Tma, TmaMulticast};
        use PrefillGemm::{Gemm1Gated, Gemm1Plain, Gemm2};
        use PrefillTile::{Dual, Large, Small, Wide};
        Some(match (tile, feed, self) {
            (Small, CpAsync, Gemm1Gated) => "prefill_small_gemm1_gated",
            (Small, CpAsync, Gemm1Plain) => "prefill_small_gemm1_plain",
            (Small, CpAsync, Gemm2) => "prefill_small_gemm2",
            (Small, Tma, Gemm1Gated) => "prefill_small_tma_gemm1_gated",
            (Small, Tma, Gemm1Plain) => "prefill_small_tma_gemm1_plain",
            (Small, Tma, Gemm2) => "prefill_small_tma_gemm2",
            (Large, CpAsync, Gemm1Gated) => "prefill_gemm1_gated",
            (Large, CpAsync, Gemm1Plain) => "prefill_gemm1_plain",
            (Large, CpAsync, Gemm2) => "prefill_gemm2",
            (Large, Tma, Gemm1Gated) => "prefill_tma1_gemm1_gated",
            (Large, Tma, Gemm1Plain) => "prefill_tma1_gemm1_plain",
            (Large, Tma, Gemm2) => "prefill_tma1_gemm2",
            (Large, TmaMulticast, Gemm1Gated) => "prefill_tma2_gemm1_gated",
            (Large, TmaMulticast, Gemm1Plain) => "prefill_tma2_gemm1_plain",
            (Large, TmaMulticast, Gemm2) => "prefill_tma2_gemm2",
            (Wide, Tma, Gemm1Gated) => "prefill_wide_gemm1_gated",
            (Wide, Tma, Gemm1Plain) => "prefill_wide_gemm1_plain",
            (Wide, Tma, Gemm2) => "prefill_wide_gemm2",
            (Dual, Tma, Gemm1Gated) => "prefill_dual_gemm1_gated",
            (Dual, Tma, Gemm1Plain) => "prefill_dual_gemm1_plain",
            (Dual, Tma, Gemm2) => "prefill_dual_gemm2",
            (Small, TmaMulticast, _) | (Wide | Dual, CpAsync | TmaMulticast, _) => return None,
        })
    }
}

/// How the prefill tiles receive their activation rows (`prefill_gemm.cu`'s `TMA`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillFeed {
    /// Every thread gathers rows through the sorted pairs with cp.async.
    CpAsync,
    /// The bulk-copy engine loads the tile from a row-sorted copy (TMA, 128-byte swizzle).
    Tma,
    /// As `Tma`, on 2-CTA clusters that share the token tile: each CTA loads half of it and
    /// multicasts it to both, halving the activation reads from L2.
    TmaMulticast,
}

impl PrefillFeed {
    /// `FP4MOE_PREFILL_FEED=FEED` or `GEMM1:GEMM2` (each `cp|tma|tma2|auto`, `auto` the
    /// rule), a benchmark knob, for GEMM1 (`gemm1`) or GEMM2.
    pub(super) fn from_env(gemm1: bool) -> Option<Self> {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        knob_feed(tuning_knob(&KNOB, "FP4MOE_PREFILL_FEED")?, gemm1)
    }

    /// The feed for `tile` over an operand of `rows` rows of K = `k` bf16 and `row_tiles`
    /// weight-row tiles on `arch`, at `per_expert` mean tokens per expert: `forced`, else
    /// [`PrefillFeed::preferred`], where it applies. TMA needs sm_90a, a row stride that is a
    /// multiple of 16 bytes and an operand at least one box (64 k × [`PrefillTile::box_rows`]) large;
    /// multicast pairs row tiles, so it needs an even count (an odd one would add a tile of zero
    /// rows), and runs on the 128-token tiles (not the dual, wide or 32-token ones) only. Every
    /// feed uses the tile's ring ([`PrefillTile::shared_bytes`]).
    pub(super) fn choose(
        tile: PrefillTile,
        per_expert: usize,
        k: usize,
        rows: usize,
        row_tiles: usize,
        arch: &str,
        forced: Option<Self>,
    ) -> Self {
        if arch != "sm_90a" || k % 8 != 0 || k < 64 || rows < tile.box_rows() as usize {
            return PrefillFeed::CpAsync;
        }
        match forced.unwrap_or(Self::preferred(tile, per_expert)) {
            // Multicast kernels exist for the 128-token tiles only.
            PrefillFeed::TmaMulticast if row_tiles % 2 == 1 || tile != PrefillTile::Large => {
                PrefillFeed::Tma
            }
            feed => feed,
        }
    }

    /// The feed asked for when none is forced: TMA, but cp.async for the 32-token tiles below
    /// [`PREFILL_SMALL_TMA_FROM`] mean tokens per expert, where GEMM1's TMA feed costs more in
    /// its sorted copy of the input (`invert_pairs` and `prepare_input_sorted`: a near-constant
    /// 3.2–4.6 µs, run 102) than the kernels gain.
    pub(super) const fn preferred(tile: PrefillTile, per_expert: usize) -> Self {
        match tile {
            PrefillTile::Small if per_expert < PREFILL_SMALL_TMA_FROM => PrefillFeed::CpAsync,
            _ => PrefillFeed::Tma,
        }
    }

    /// CTAs per cluster.
    pub(super) fn cluster(self) -> u32 {
        if self == PrefillFeed::TmaMulticast {
            2
        } else {
            1
        }
    }
}

/// Grid y of a prefill GEMM: an upper bound of the (expert, token tile) work items of `pairs`
/// pairs over at most `slots` experts, which the grid's 65535 limits.
pub(super) fn prefill_token_tiles(tile: PrefillTile, pairs: usize, slots: usize) -> Result<usize> {
    let tiles = pairs.div_ceil(tile.tokens()) + slots;
    if tiles > 65_535 {
        return Err(Error::Unsupported {
            backend: "cuda".into(),
            reason: format!(
                "{pairs} routed pairs need {tiles} token tiles of {}; the prefill grid allows 65535",
                tile.tokens()
            ),
        });
    }
    Ok(tiles)
}

/// Which prefill GEMM a launch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PrefillGemm {
    Gemm1Gated,
    Gemm1Plain,
    Gemm2,
}

/// Dynamic shared memory of the smallest prefill block; the prefill path needs it.
pub const PREFILL_SMEM: usize = PrefillTile::Small.shared_bytes();

impl GemmPath {
    /// `FP4MOE_GEMM_PATH=decode|prefill`, a benchmark knob.
    pub(super) fn from_env() -> Option<Self> {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let choices = [("decode", GemmPath::Decode), ("prefill", GemmPath::Prefill)];
        tuning_choice(&KNOB, "FP4MOE_GEMM_PATH", &choices)
    }

    /// The path for `pairs` routed pairs over `experts` experts (`gated`: SwiGLU-style experts,
    /// whose decode GEMMs run two weight rows per output): `forced` when given, else prefill
    /// from [`PREFILL_GATED_FROM_QUARTERS`] or [`PREFILL_NONGATED_FROM_QUARTERS`] quarter
    /// tokens per expert ([`PREFILL_DENSE_GATED_FROM_QUARTERS`] or
    /// [`PREFILL_DENSE_NONGATED_FROM_QUARTERS`] for one expert); decode whenever the device
    /// lacks even the small prefill tiles' shared memory.
    pub fn choose(
        pairs: usize,
        experts: usize,
        gated: bool,
        max_shared_bytes: usize,
        forced: Option<Self>,
    ) -> Self {
        if PREFILL_SMEM > max_shared_bytes {
            return GemmPath::Decode;
        }
        if let Some(path) = forced {
            return path;
        }
        let quarters = match (experts <= 1, gated) {
            (true, true) => PREFILL_DENSE_GATED_FROM_QUARTERS,
            (true, false) => PREFILL_DENSE_NONGATED_FROM_QUARTERS,
            (false, true) => PREFILL_GATED_FROM_QUARTERS,
            (false, false) => PREFILL_NONGATED_FROM_QUARTERS,
        };
        if 4 * pairs >= quarters * experts.max(1) {
            GemmPath::Prefill
        } else {
            GemmPath::Decode
        }
    }
}

/// Which decode kernels run NVFP4 expert GEMMs (bf16 weights always take `expert_gemm.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeKernel {
    /// `expert_stream.cu`: each block copies its weight rows, whole K, into shared memory at
    /// once (one DRAM wait per block), then runs split-K mma.sync over 8 warps.
    Stream,
    /// `expert_gemm.cu`: weights through registers two or three k groups ahead, split-K
    /// mma.sync over 16 warps (8 in the deep shape), one to four 8-token subtiles per pass.
    Mma,
}

/// Threads of a streaming decode block (`STREAM_WARPS` warps).
pub(super) const STREAM_THREADS: usize = 256;

/// Most activation rows a streaming block stages per pass (`STREAM_TILE`).
pub(super) const STREAM_TILE: usize = 8;

/// Largest batch whose NVFP4 decode GEMMs stream by default. Measured on the H200 (graph
/// replays, µs per layer, stream / mma): run 28 Nemotron 46.7 / 51.9 at 1 token, 78.1 / 81.6 at
/// 2, 122.8 / 124.9 at 4, 207.6 / 165.6 at 8; Qwen3 39.6 / 43.7, 59.3 / 63.0, 104.7 / 101.4,
/// 163.2 / 123.1. Run 128, after the mma GEMMs' one-subtile loop lost a third of its
/// instructions (runs 122, 127): Nemotron 2 tokens 62.0 / 60.0, Qwen3 1 token 31.7 / 33.5, 2
/// tokens 52.8 / 52.0; with the mma kernels' wide block shape (runs 131–132): 2 tokens
/// Nemotron 50.3, Qwen3 41.5; 1 token stream (Nemotron: `one_token`) / wide mma 34.4 / 35.0 and
/// 31.3 / 35.1. A streaming block loads all its weights before it computes; with more
/// experts per SM the mma kernels' per-warp prefetch overlaps better. At one token a layer
/// without a shared expert runs `one_token.cu` (which takes this choice as its condition).
pub const STREAM_MAX_TOKENS: usize = 1;

impl DecodeKernel {
    /// The default for a batch of `tokens`: [`DecodeKernel::Stream`] up to
    /// [`STREAM_MAX_TOKENS`], else [`DecodeKernel::Mma`].
    pub fn for_tokens(tokens: usize) -> Self {
        if tokens <= STREAM_MAX_TOKENS {
            DecodeKernel::Stream
        } else {
            DecodeKernel::Mma
        }
    }

    /// `FP4MOE_DECODE_KERNEL=stream|mma`, a benchmark knob.
    pub(super) fn from_env() -> Option<Self> {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let choices = [("stream", DecodeKernel::Stream), ("mma", DecodeKernel::Mma)];
        tuning_choice(&KNOB, "FP4MOE_DECODE_KERNEL", &choices)
    }
}

/// Launch shape of a streaming decode GEMM (`expert_stream.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StreamShape {
    /// Row-group units per block (`_r1`, `_r2`, `_r4`); a gated unit is a gate and an up row group.
    pub(super) rb: usize,
    /// Dynamic shared memory per block.
    pub(super) smem: usize,
}

impl StreamShape {
    /// `FP4MOE_STREAM_UNITS=1|2|4` forces the units per block, a benchmark knob.
    pub(super) fn from_env() -> Option<usize> {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        tuning_choice(
            &KNOB,
            "FP4MOE_STREAM_UNITS",
            &[("1", 1), ("2", 2), ("4", 4)],
        )
    }

    /// The shape of `rb` units per block for K = `k` and `tokens` tokens in the batch (at most 8
    /// activation rows staged), or `None` when it exceeds `max_shared_bytes`.
    pub(super) fn new(
        rb: usize,
        k: usize,
        gated: bool,
        tokens: usize,
        max_shared_bytes: usize,
    ) -> Option<Self> {
        let kg = pack::padded_k(k) / 64;
        let units = if gated { 2 } else { 1 };
        let smem = Self::weight_bytes(rb, units, kg)
            + Self::partial_bytes(rb, units)
            + tokens.clamp(1, STREAM_TILE) * Self::row_bytes(kg);
        (smem <= max_shared_bytes).then_some(StreamShape { rb, smem })
    }

    /// Shared bytes of `rb` row-group units of `units` projections each (gated: 2), whole K
    /// (`kg` 64-wide k groups): data and scales as `expert_stream.cuh` lays them out.
    pub(super) fn weight_bytes(rb: usize, units: usize, kg: usize) -> usize {
        rb * units * kg * (512 + 64)
    }

    /// Shared bytes of the split-K partial sums of `rb` units (slices 1 .. KSPLIT − 1 park theirs).
    pub(super) fn partial_bytes(rb: usize, units: usize) -> usize {
        let ksplit = STREAM_THREADS / 32 / rb;
        (ksplit - 1) * rb * 32 * 4 * units * 4
    }

    /// Shared bytes of one staged activation row (bf16, 8 elements of padding).
    pub(super) fn row_bytes(kg: usize) -> usize {
        (kg * 64 + 8) * 2
    }

    /// The shapes that fit, fewest units per block first.
    pub(super) fn candidates(
        k: usize,
        gated: bool,
        tokens: usize,
        max_shared_bytes: usize,
    ) -> Vec<Self> {
        [1, 2, 4]
            .into_iter()
            .filter_map(|rb| Self::new(rb, k, gated, tokens, max_shared_bytes))
            .collect()
    }

    /// Among `candidates`, the fewest units per block whose `blocks(shape)` blocks all fit on the
    /// device at once (`resident(shape)`: blocks per SM times SMs), so no block waits for
    /// another to finish (a second wave costs a whole block lifetime: DRAM latency, staging,
    /// reduction); when none does, one unit per block (the finest split).
    pub(super) fn choose(
        candidates: &[Self],
        blocks: impl Fn(&Self) -> usize,
        resident: impl Fn(&Self) -> usize,
    ) -> Option<Self> {
        candidates
            .iter()
            .find(|c| blocks(c) <= resident(c))
            .or_else(|| candidates.first())
            .copied()
    }
}

/// Dynamic shared memory of a decode GEMM block: `8·nsub` activation rows, reused afterwards
/// for the split-K partial sums (whichever is larger). A non-gated deep block whose row groups
/// end within its first half runs as a half block (`expert_gemm.cu`'s `decode_body`), so the
/// non-gated deep shape also holds the half shape's sums.
pub(super) fn gemm_smem(nsub: usize, k: usize, gated: bool, shape: GemmShape) -> usize {
    let act = 8 * nsub * (pack::padded_k(k) + 8) * 2;
    let red_of = |shape: GemmShape| {
        let rgpb = shape.rgpb(nsub);
        let ksplit = shape.warps(nsub) / rgpb;
        (ksplit - 1) * rgpb * 32 * nsub * 4 * if gated { 2 } else { 1 } * 4
    };
    let red = match shape.resolve(nsub) {
        GemmShape::Deep if !gated => red_of(GemmShape::Deep).max(red_of(GemmShape::Half)),
        shape => red_of(shape),
    };
    act.max(red)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::compile;

    #[test]
    fn gemm_shape_follows_tokens_gemm_and_expert_kind() {
        use GemmShape::{Deep, Half, Half4, Narrow, Wide};
        // (tokens, slots, GEMM1, gated layer, NVFP4)
        let shape = |t, s, g1, gated, fp4| GemmShape::chosen(t, s, None, g1, gated, fp4);
        // One expert: narrow up to 2 tokens, else wide, whatever the layer.
        for (g1, gated, fp4) in [
            (true, true, true),
            (false, false, true),
            (true, false, false),
        ] {
            assert_eq!(shape(1, 1, g1, gated, fp4), Narrow);
            assert_eq!(shape(2, 1, g1, gated, fp4), Narrow);
            assert_eq!(shape(3, 1, g1, gated, fp4), Wide);
            assert_eq!(shape(100, 1, g1, gated, fp4), Wide);
        }
        // Routed NVFP4 experts: wide below HALF_FROM_TOKENS, then half (a gated GEMM1's at
        // four blocks per SM from HALF4_GATED_GEMM1_FROM_TOKENS), then deep from each GEMM's
        // threshold; bf16 routed experts stay wide.
        let half = HALF_FROM_TOKENS;
        let half4 = HALF4_GATED_GEMM1_FROM_TOKENS;
        assert!(half < half4 && half4 < DEEP_GATED_GEMM1_FROM_TOKENS);
        for (g1, gated, from, k) in [
            (true, true, DEEP_GATED_GEMM1_FROM_TOKENS, 8),
            (false, true, DEEP_GATED_FROM_TOKENS, 8),
            (true, false, DEEP_NONGATED_FROM_TOKENS, 6),
            (false, false, DEEP_NONGATED_FROM_TOKENS, 6),
        ] {
            assert!(half < from);
            // Only a gated layer's GEMM1 has the four-block half kernel.
            let last_half = if g1 && gated {
                assert_eq!(shape(half4 - 1, k * (half4 - 1), g1, gated, true), Half);
                assert_eq!(shape(half4, k * half4, g1, gated, true), Half4);
                Half4
            } else {
                Half
            };
            assert_eq!(shape(1, k, g1, gated, true), Wide);
            assert_eq!(shape(half - 1, k * (half - 1), g1, gated, true), Wide);
            assert_eq!(shape(half, k * half, g1, gated, true), GemmShape::Half);
            assert_eq!(shape(from - 1, k * (from - 1), g1, gated, true), last_half);
            assert_eq!(shape(from, k * from, g1, gated, true), Deep);
            assert_eq!(shape(64, 128, g1, gated, true), Deep);
            assert_eq!(shape(half, k * half, g1, gated, false), Wide);
            assert_eq!(shape(64, 128, g1, gated, false), Wide);
        }
        assert_eq!(shape(64, 128, false, false, false), Wide);
        assert_eq!(shape(64, 128, true, false, false), Wide);
        // A shape forced on the layer wins.
        assert_eq!(GemmShape::chosen(1, 1, Some(Deep), true, false, true), Deep);
        assert_eq!(
            GemmShape::chosen(64, 128, Some(Wide), true, true, true),
            Wide
        );
        // The half shape runs one subtile on 8 warps, 4 row groups x 2 K slices (the wide
        // split); more subtiles fall back to the wide kernels.
        let half_wide = |n| {
            (
                GemmShape::Half.name(n),
                GemmShape::Half.warps(n),
                GemmShape::Half.rgpb(n),
            )
        };
        assert_eq!(half_wide(1), ("half", 8, 4));
        assert_eq!(half_wide(2), ("wide", 16, 8));
        assert_eq!(half_wide(4), ("wide", 8, 4));
        // Its four-block kernel: the same block shape.
        for n in [1, 2, 4] {
            assert_eq!(Half4.warps(n), Half.warps(n));
            assert_eq!(Half4.rgpb(n), Half.rgpb(n));
            assert_eq!(
                gemm_smem(n, 2048, true, Half4),
                gemm_smem(n, 2048, true, Half)
            );
        }
        assert_eq!(Half4.name(1), "half4");
        assert_eq!(Half4.name(2), "wide");
        // Its reduction buffer holds one K slice of 4 row groups; beyond one subtile it is the
        // wide shape's.
        assert_eq!(gemm_smem(1, 2048, true, GemmShape::Half), 8 * 2056 * 2);
        assert_eq!(gemm_smem(1, 64, true, GemmShape::Half), 4 * 32 * 8 * 4);
        for (n, k, g) in [(2, 2048, true), (4, 768, false), (2, 64, true)] {
            assert_eq!(
                gemm_smem(n, k, g, GemmShape::Half),
                gemm_smem(n, k, g, Wide)
            );
        }
        // Forced half runs on NVFP4 weights only.
        let half = Some(GemmShape::Half);
        for (g1, gated) in [(true, true), (false, true), (true, false), (false, false)] {
            assert_eq!(
                GemmShape::chosen(3, 23, half, g1, gated, true),
                GemmShape::Half
            );
        }
        assert_eq!(
            GemmShape::chosen(3, 23, half, true, true, false),
            GemmShape::Wide
        );
        // Forced half4: a gated GEMM1's four-block kernel, the half shape elsewhere (the other
        // half kernels run four blocks per SM already), wide on bf16 weights.
        let h4 = Some(Half4);
        assert_eq!(GemmShape::chosen(3, 23, h4, true, true, true), Half4);
        for (g1, gated) in [(false, true), (true, false), (false, false)] {
            assert_eq!(GemmShape::chosen(3, 23, h4, g1, gated, true), Half);
        }
        assert_eq!(GemmShape::chosen(3, 23, h4, true, true, false), Wide);
        assert_eq!(knob_shape("half4:deep", true), Some(Some(Half4)));
        assert_eq!(knob_shape("half4:deep", false), Some(Some(Deep)));
        // The knob: one shape for both GEMMs, or GEMM1:GEMM2 with `auto` for the rule.
        assert_eq!(knob_shape("deep", true), Some(Some(Deep)));
        assert_eq!(knob_shape("deep", false), Some(Some(Deep)));
        assert_eq!(knob_shape("half:auto", true), Some(Some(GemmShape::Half)));
        assert_eq!(knob_shape("half:auto", false), Some(None));
        assert_eq!(knob_shape("deep1", true), Some(Some(Deep)));
        assert_eq!(knob_shape("deep1", false), Some(Some(Wide)));
        assert_eq!(knob_shape("deep2", true), Some(Some(Wide)));
        assert_eq!(knob_shape("deep2", false), Some(Some(Deep)));
        assert_eq!(knob_shape("Deep", true), None);
        assert_eq!(knob_shape("wide:bogus", false), None);
        assert_eq!(knob_shape("wide:bogus", true), Some(Some(Wide)));
        // The feed knob likewise: one feed, or GEMM1:GEMM2 with `auto` for the rule.
        assert_eq!(knob_feed("cp", true), Some(PrefillFeed::CpAsync));
        assert_eq!(knob_feed("cp", false), Some(PrefillFeed::CpAsync));
        assert_eq!(knob_feed("cp:auto", true), Some(PrefillFeed::CpAsync));
        assert_eq!(knob_feed("cp:auto", false), None);
        assert_eq!(
            knob_feed("tma:tma2", false),
            Some(PrefillFeed::TmaMulticast)
        );
        assert_eq!(knob_feed("TMA", true), None);
        // The deep shape runs one subtile on 8 warps of one K slice each; more subtiles fall
        // back to the wide kernels.
        assert_eq!(GemmShape::Deep.name(1), "deep");
        assert_eq!((GemmShape::Deep.warps(1), GemmShape::Deep.rgpb(1)), (8, 8));
        assert_eq!(GemmShape::Deep.name(2), "wide");
        assert_eq!((GemmShape::Deep.warps(2), GemmShape::Deep.rgpb(2)), (16, 8));
        assert_eq!((GemmShape::Deep.warps(4), GemmShape::Deep.rgpb(4)), (8, 4));
        // No split-K exchange of its own: its shared memory is the activation rows, or, non-gated
        // and for a short K, the half shape's sums (a block whose rows end in its first half
        // runs as one).
        assert_eq!(gemm_smem(1, 2688, true, GemmShape::Deep), 8 * 2696 * 2);
        assert_eq!(gemm_smem(1, 64, true, GemmShape::Deep), 8 * 72 * 2);
        assert_eq!(gemm_smem(1, 64, false, GemmShape::Deep), 4 * 32 * 4 * 4);
    }

    #[test]
    fn subtiles_follow_tokens_per_expert_and_the_deep_shape() {
        use GemmShape::{Deep, Half, Half4, Wide};
        // (tokens, mean tokens per expert in quarters rounded up, gated layer, shape)
        for gated in [true, false] {
            // The half shapes ask what the wide one asks (they exist for one subtile, else wide).
            for q in [1, 4 * 4, 4 * 4 + 1, 4 * 12, 4 * 12 + 1] {
                let t = 100;
                for half in [Half, Half4] {
                    assert_eq!(
                        subtiles_wanted(t, q, gated, half),
                        subtiles_wanted(t, q, gated, Wide)
                    );
                }
            }
            for shape in [Wide, Deep, Half, Half4] {
                assert_eq!(
                    subtiles_wanted(8, 4 * 64, gated, shape),
                    1,
                    "a batch of 8 fits one"
                );
                assert_eq!(subtiles_wanted(64, 4 * 4, gated, shape), 1);
                assert_eq!(subtiles_wanted(300, 4 * 12 + 1, gated, shape), 4);
            }
            assert_eq!(subtiles_wanted(80, 4 * 4 + 1, gated, Wide), 2);
            assert_eq!(subtiles_wanted(300, 4 * 12, gated, Deep), 2);
        }
        // A gated layer's deep GEMMs keep one subtile up to DEEP_GATED_ONE_SUBTILE_UP_TO.
        let up_to = 4 * DEEP_GATED_ONE_SUBTILE_UP_TO;
        assert_eq!(subtiles_wanted(80, 4 * 5, true, Deep), 1);
        assert_eq!(subtiles_wanted(200, up_to, true, Deep), 1);
        assert_eq!(subtiles_wanted(200, up_to + 1, true, Deep), 2);
        // A non-gated layer's up to DEEP_NONGATED_ONE_SUBTILE_UP_TO_QUARTERS: Nemotron-3 Nano
        // (E 128, top-6) keeps one at 100 tokens (18.75 quarters per expert, rounded up 19),
        // two at 104 (19.5, rounded up 20).
        let nemotron = |t| per_expert_quarters(t, 6, 128);
        assert_eq!((nemotron(100), nemotron(104)), (19, 20));
        assert_eq!(subtiles_wanted(100, nemotron(100), false, Deep), 1);
        assert_eq!(subtiles_wanted(104, nemotron(104), false, Deep), 2);
        assert_eq!(subtiles_wanted(100, nemotron(100), false, Wide), 2);
        // The integer rules read the same in quarters: at most 4 per expert (Qwen3-30B-A3B, E
        // 128, top-8: 64 tokens, 16 quarters) one wide subtile, 65 tokens (16.25) two.
        let qwen3 = |t| per_expert_quarters(t, 8, 128);
        assert_eq!((qwen3(64), qwen3(65), qwen3(1)), (16, 17, 1));
        assert_eq!(subtiles_wanted(64, qwen3(64), true, Wide), 1);
        assert_eq!(subtiles_wanted(65, qwen3(65), true, Wide), 2);
        assert_eq!(per_expert_quarters(0, 8, 128), 1);
    }

    #[test]
    fn gemm_path_follows_tokens_per_expert_and_shared_memory() {
        let h200 = 227 * 1024;
        let choose = |pairs, experts, gated, smem, forced| {
            GemmPath::choose(pairs, experts, gated, smem, forced)
        };
        // Qwen3 (E 128, top-8, gated): decode below 7.25 tokens per expert (115 tokens = 920
        // pairs), prefill from 928 pairs (116 tokens).
        assert_eq!(choose(8 * 8, 128, true, h200, None), GemmPath::Decode);
        assert_eq!(choose(112 * 8, 128, true, h200, None), GemmPath::Decode);
        assert_eq!(choose(927, 128, true, h200, None), GemmPath::Decode);
        assert_eq!(choose(116 * 8, 128, true, h200, None), GemmPath::Prefill);
        // Nemotron-3 Nano (E 128, top-6, non-gated): decode below 5.75 tokens per expert (122
        // tokens = 732 pairs), prefill from 736 pairs (123 tokens).
        assert_eq!(choose(8 * 6, 128, false, h200, None), GemmPath::Decode);
        assert_eq!(choose(112 * 6, 128, false, h200, None), GemmPath::Decode);
        assert_eq!(choose(735, 128, false, h200, None), GemmPath::Decode);
        assert_eq!(choose(123 * 6, 128, false, h200, None), GemmPath::Prefill);
        // The same 800 pairs non-gated take prefill, gated decode.
        assert_eq!(choose(800, 128, false, h200, None), GemmPath::Prefill);
        assert_eq!(choose(800, 128, true, h200, None), GemmPath::Decode);
        // Other expert counts scale the same per-expert thresholds: 256 experts, gated, from
        // 1856 pairs; non-gated from 1472; 8 experts, gated, from 58 pairs.
        assert_eq!(choose(1855, 256, true, h200, None), GemmPath::Decode);
        assert_eq!(choose(1856, 256, true, h200, None), GemmPath::Prefill);
        assert_eq!(choose(1471, 256, false, h200, None), GemmPath::Decode);
        assert_eq!(choose(1472, 256, false, h200, None), GemmPath::Prefill);
        assert_eq!(choose(57, 8, true, h200, None), GemmPath::Decode);
        assert_eq!(choose(58, 8, true, h200, None), GemmPath::Prefill);
        // A shared expert is one expert holding every token.
        assert_eq!(choose(2, 1, true, h200, None), GemmPath::Decode);
        assert_eq!(choose(3, 1, false, h200, None), GemmPath::Decode);
        assert_eq!(choose(4, 1, false, h200, None), GemmPath::Prefill);
        assert_eq!(choose(3, 1, true, h200, None), GemmPath::Prefill);
        // Forced either way.
        let forced = Some(GemmPath::Prefill);
        assert_eq!(choose(1, 128, false, h200, forced), GemmPath::Prefill);
        let forced = Some(GemmPath::Decode);
        assert_eq!(choose(1 << 20, 128, true, h200, forced), GemmPath::Decode);
        // sm_86/89 (99 KB) run the small tiles; nothing smaller than them runs prefill.
        let sm89 = 99 * 1024;
        assert_eq!(choose(1 << 20, 128, true, sm89, None), GemmPath::Prefill);
        let tiny = PREFILL_SMEM - 1;
        assert_eq!(
            choose(1 << 20, 128, false, tiny, Some(GemmPath::Prefill)),
            GemmPath::Decode
        );
        assert_eq!(choose(0, 0, true, h200, None), GemmPath::Decode);
    }

    #[test]
    fn stream_shape_sizes_shared_memory_and_prefers_one_wave() {
        let threads = compile::kernel_define("expert_stream.cuh", "STREAM_WARPS") * 32;
        assert_eq!(threads, STREAM_THREADS);
        let tile = compile::kernel_define("expert_stream.cuh", "STREAM_TILE");
        assert_eq!(tile, STREAM_TILE);
        let h200 = 227 * 1024;
        // Nemotron GEMM1 at 1 token: 42 k groups of 576 bytes per unit, one activation row.
        let c = StreamShape::candidates(2688, false, 1, h200);
        assert_eq!(c.iter().map(|s| s.rb).collect::<Vec<_>>(), [1, 2, 4]);
        assert_eq!(c[0].smem, 42 * 576 + 7 * 32 * 4 * 4 + (2688 + 8) * 2);
        assert_eq!(
            c[1].smem,
            2 * 42 * 576 + 3 * 2 * 32 * 4 * 4 + (2688 + 8) * 2
        );
        // At most 8 activation rows; gated units hold a gate and an up row group.
        let c = StreamShape::candidates(2048, true, 300, h200);
        let want = 4 * 2 * 32 * 576 + 4 * 32 * 8 * 4 + 8 * (2048 + 8) * 2;
        assert_eq!((c[2].rb, c[2].smem), (4, want));
        // A unit larger than the device's shared memory: no candidate, the mma kernels run.
        assert!(StreamShape::candidates(16384, true, 8, h200).is_empty());
        // One wave when some shape allows it, fewest units per block first; else one unit.
        let c = StreamShape::candidates(2688, false, 1, h200);
        let blocks = |s: &StreamShape| 116usize.div_ceil(s.rb) * 6;
        let resident = |s: &StreamShape| 132 * (h200 / s.smem).min(5);
        assert_eq!(
            StreamShape::choose(&c, blocks, resident).map(|s| s.rb),
            Some(2)
        );
        let many = |s: &StreamShape| 116usize.div_ceil(s.rb) * 48;
        assert_eq!(
            StreamShape::choose(&c, many, resident).map(|s| s.rb),
            Some(1)
        );
        assert_eq!(StreamShape::choose(&[], blocks, resident), None);
    }

    #[test]
    fn handoff_default_follows_the_path_and_tokens_per_expert() {
        use GemmPath::{Decode, Prefill};
        // Nemotron-3 Nano (top-6 of 128): 256 tokens = 12 per expert, 2730 = 127.97, 2731 = 128.02.
        let nemotron = |t: usize| t * 6;
        assert!(handoff_by_default(Decode, true, nemotron(64), 128));
        assert!(handoff_by_default(Prefill, true, nemotron(256), 128));
        assert!(handoff_by_default(Prefill, true, nemotron(2730), 128));
        assert!(!handoff_by_default(Prefill, true, nemotron(2731), 128));
        assert!(!handoff_by_default(Prefill, true, nemotron(4096), 128));
        // bf16 weights run the decode kernels at any size.
        assert!(handoff_by_default(Prefill, false, nemotron(16384), 128));
        assert!(handoff_by_default(Decode, true, nemotron(16384), 128));
    }

    #[test]
    fn prefill_tile_follows_tokens_per_expert_and_shared_memory() {
        let (h200, sm89) = (227 * 1024, 99 * 1024);
        // Nemotron-3 Nano: 512 tokens = 24 per expert, 1024 = 48, 4096 = 192.
        let tile = |pairs, smem, forced| PrefillTile::choose(pairs, 128, false, smem, forced);
        let (dual, wide) = (PrefillTile::Dual, PrefillTile::Wide);
        assert_eq!(tile(512 * 6, h200, None), PrefillTile::Small);
        assert_eq!(tile(1024 * 6, h200, None), dual);
        assert_eq!(tile(4096 * 6, h200, None), dual);
        assert_eq!(tile(16384 * 6, h200, None), dual);
        assert_eq!(tile(4096 * 6, sm89, None), PrefillTile::Small);
        assert_eq!(tile(6, h200, Some(wide)), wide);
        // A100 (163 KB) holds a 128-token tile (dual ones fall back to it: no TMA there), not
        // a wide one.
        assert_eq!(tile(4096 * 6, 163 * 1024, None), dual);
        assert_eq!(dual.for_feed(PrefillFeed::CpAsync), PrefillTile::Large);
        assert!(wide.shared_bytes() <= h200);
        // The thresholds per expert kind (mean tokens per expert, rounded down).
        assert_eq!(tile(37 * 128, h200, None), dual);
        assert_eq!(tile(37 * 128 - 1, h200, None), PrefillTile::Small);
        let gated = |pairs| PrefillTile::choose(pairs, 128, true, h200, None);
        assert_eq!(gated(33 * 128), dual);
        assert_eq!(gated(33 * 128 - 1), PrefillTile::Small);
        // Qwen3-30B-A3B (top-8): 512 tokens = 32 per expert, 576 = 36.
        assert_eq!(gated(512 * 8), PrefillTile::Small);
        assert_eq!(gated(576 * 8), dual);
        assert_eq!(tile(1024 * 6, sm89, None), PrefillTile::Small);
        assert_eq!(tile(1024 * 6, 120 * 1024, None), PrefillTile::Small);
        let forced = Some(PrefillTile::Large);
        assert_eq!(tile(6, h200, forced), PrefillTile::Large);
        assert_eq!(tile(6, sm89, forced), PrefillTile::Small);
        assert_eq!(
            tile(1 << 20, h200, Some(PrefillTile::Small)),
            PrefillTile::Small
        );
        // GEMM1's wide tiles from 256 tokens per expert and K = 2304 where they fit; GEMM2
        // keeps the dual ones.
        let (g1, g1g, g2) = (
            PrefillGemm::Gemm1Plain,
            PrefillGemm::Gemm1Gated,
            PrefillGemm::Gemm2,
        );
        assert_eq!(dual.for_gemm(g1, 2688, 768, h200), wide);
        assert_eq!(dual.for_gemm(g1g, 2688, 768, h200), wide);
        assert_eq!(dual.for_gemm(g1, 2304, 256, h200), wide);
        assert_eq!(dual.for_gemm(g1, 2688, 255, h200), dual);
        assert_eq!(dual.for_gemm(g1, 2303, 768, h200), dual);
        // Qwen3-30B's GEMM1 (K = H = 2048): dual at every batch (run 109).
        assert_eq!(dual.for_gemm(g1g, 2048, 1024, h200), dual);
        assert_eq!(dual.for_gemm(g1, 2688, 768, 163 * 1024), dual);
        assert_eq!(dual.for_gemm(g2, 1856, 768, h200), dual);
        assert_eq!(dual.for_gemm(g2, 4096, 4096, h200), dual);
        let small = PrefillTile::Small;
        assert_eq!(small.for_gemm(g1, 2688, 768, h200), small);
        assert_eq!(wide.for_feed(PrefillFeed::CpAsync), PrefillTile::Large);
        assert_eq!(wide.for_feed(PrefillFeed::Tma), wide);
        // Dual tiles are TMA-fed only (elsewhere the 128-token tiles run, so a device must
        // hold those too).
        assert_eq!(tile(4096 * 6, h200, Some(dual)), dual);
        assert_eq!(tile(4096 * 6, 163 * 1024, Some(dual)), dual);
        assert_eq!(tile(4096 * 6, 120 * 1024, Some(dual)), PrefillTile::Small);
        assert_eq!(tile(4096 * 6, sm89, Some(dual)), PrefillTile::Small);
        assert_eq!(dual.for_feed(PrefillFeed::Tma), dual);
        // Two blocks (and their 1 KB of reserved shared memory each) fit an H100/H200 SM.
        assert!(2 * (dual.shared_bytes() + 1024) <= 228 * 1024);
        assert_eq!(
            PrefillTile::Large.for_feed(PrefillFeed::CpAsync),
            PrefillTile::Large
        );
    }

    #[test]
    fn prefill_kernels_exist() {
        // Every (tile, feed) pair the host can launch names a kernel of the source; the others
        // none, so a mismatched pair is an error, not a kernel of another block shape.
        use PrefillFeed::*;
        use PrefillTile::*;
        let names = compile::kernel_names("prefill_gemm.cu");
        let mut launched = 0;
        for tile in [Small, Large, Wide, Dual] {
            for feed in [CpAsync, Tma, TmaMulticast] {
                for gemm in [
                    PrefillGemm::Gemm1Gated,
                    PrefillGemm::Gemm1Plain,
                    PrefillGemm::Gemm2,
                ] {
                    let valid = matches!(
                        (tile, feed),
                        (Small, CpAsync | Tma) | (Large, _) | (Wide | Dual, Tma)
                    );
                    match gemm.kernel(tile, feed) {
                        Some(name) => {
                            assert!(valid, "{tile:?} {feed:?}");
                            assert!(names.iter().any(|n| n == name), "{name}");
                            launched += 1;
                        }
                        None => assert!(!valid, "{tile:?} {feed:?} {gemm:?}"),
                    }
                }
            }
        }
        assert_eq!(launched, names.len());
    }
}
