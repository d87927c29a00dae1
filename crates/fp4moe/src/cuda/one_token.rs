//! The one-token layer in one launch (`kernels/one_token.cu`): routing, both expert GEMMs and
//! the combine of a single token in one kernel, with grid-wide barriers between its phases, so
//! decode pays one launch and both GEMMs' weights stream at once.
//!
//! It runs where the split path would run `route_small` and the streaming GEMMs (one token,
//! routing from the router weight or caller logits, no shared expert, NVFP4 weights, the
//! streaming decode kernels chosen) and its shared memory fits; it computes each unit with the
//! streaming kernels' own code and K split, so its bits are the split path's. `FP4MOE_ONE_TOKEN=0`
//! or [`CudaLayer::set_one_token`] turns it off.
//!
//! Its blocks wait for one another, so they must all be resident at once: the grid is one
//! block per SM (the driver's occupancy for its shared memory is checked), and it launches
//! without programmatic serialization, so it starts on an idle device once the work before it
//! on the stream is done. Work submitted concurrently on other streams could hold SMs it
//! needs: a barrier wait beyond 2 s traps (a sticky error: the CUDA context is lost) rather
//! than hang; turn it off where that can happen. A cooperative launch would let the driver
//! refuse such a launch instead (not done: not yet measured inside graph captures).

use super::{
    ptr, tuning_choice, CudaLayer, CudaWorkspace, DecodeKernel, GemmParams, GemmPath, RouteIo,
    RoutePath, RouteSource, Selection, StreamShape,
};
use crate::error::Result;
use cudarc::driver::{DeviceRepr, LaunchConfig};
use std::sync::OnceLock;

/// Teams of eight warps per block (`OT_TEAMS_PLAIN`, `OT_TEAMS_GATED`), each computing one
/// virtual block at a time.
pub(super) const fn teams(gated: bool) -> usize {
    if gated {
        3
    } else {
        4
    }
}

/// Threads per block: the teams' eight warps each.
const fn threads(gated: bool) -> usize {
    teams(gated) * 8 * 32
}
/// Bytes of the kernel's shared header (`OT_HDR_BYTES`).
pub(super) const OT_HDR_BYTES: usize = 3248;
/// Most virtual blocks a half waits on (`OT_MAX_GROUPS`, cp.async commit groups).
pub(super) const OT_MAX_GROUPS: usize = 8;
/// Where the combine tickets start in the barrier buffer (`OT_TICKETS`; the barrier's u64
/// arrival count sits at 0, two lines before them).
pub(super) const SYNC_TICKETS: usize = 64;
/// Words of the barrier buffer for `col_blocks` GEMM2 column blocks (H / 16) and `experts`:
/// the tickets, then from an even word (`OT_LOGIT_FLAGS`) one u64 flag per expert's logit.
pub(super) const fn sync_len(col_blocks: usize, experts: usize) -> usize {
    ((SYNC_TICKETS + col_blocks + 1) & !1) + 2 * experts
}
/// Timestamps a traced launch records per block (`OT_TRACE_POINTS`), and their names.
pub(super) const OT_TRACE_POINTS: usize = 9;
const TRACE_NAMES: [&str; OT_TRACE_POINTS] = [
    "entry",
    "logits + operand row",
    "logits gathered",
    "top-k + grouping",
    "GEMM1 copies issued",
    "GEMM1 computed",
    "GEMM2 copies issued",
    "barrier 2, GEMM2 operand",
    "exit",
];

/// Trace buffer length (u64) of a workspace: a launch's blocks (one per SM) times the points,
/// when `FP4MOE_ONE_TOKEN_TRACE=1`; else 0.
pub(super) fn trace_len(sms: usize) -> usize {
    if tracing() {
        sms * OT_TRACE_POINTS
    } else {
        0
    }
}

/// `FP4MOE_ONE_TOKEN_TRACE=1`: launches record per-block phase timestamps (a diagnostic).
fn tracing() -> bool {
    static KNOB: OnceLock<Option<String>> = OnceLock::new();
    tuning_choice(&KNOB, "FP4MOE_ONE_TOKEN_TRACE", &[("1", true)]).unwrap_or(false)
}

/// Parameters of `one_token.cu`; the layout matches `struct OneTokenParams` there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct OneTokenParams {
    g1: GemmParams,
    g2: GemmParams,
    io: RouteIo,
    y: u64,
    sync: u64,
    select: Selection,
    rsf: f32,
    gs: f32,
    rb1: i32,
    rb2: i32,
    vbpb1: i32,
    vbpb2: i32,
    smem_act: i32,
    smem_red: i32,
    smem_w: i32,
    prefetch: i32,
    trace: u64,
}

// SAFETY: `OneTokenParams` is `repr(C)`, plain old data, and mirrors the kernel's parameter
// struct field for field (two `GemmParams` of 136 bytes, 8 pointers, 16 four-byte fields, one
// pointer; no implicit padding).
unsafe impl DeviceRepr for OneTokenParams {}

/// What the launch shape depends on: each GEMM's units per virtual block (`rb`), 64-wide k
/// groups and output row groups, and the routing's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct OneTokenGemms {
    pub rb1: usize,
    pub rb2: usize,
    pub kg1: usize,
    pub kg2: usize,
    pub rg1: usize,
    pub rg2: usize,
    pub gated: bool,
    pub top_k: usize,
    pub experts: usize,
}

/// A launch shape found for a pair of K splits (GEMM1's, GEMM2's units per virtual block);
/// `None`: the kernel does not fit.
pub(super) type CachedShape = ((usize, usize), Option<OneTokenShape>);

/// Grid and shared-memory layout of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct OneTokenShape {
    pub blocks: usize,
    pub smem: usize,
    pub vbpb1: usize,
    pub vbpb2: usize,
    pub smem_act: usize,
    pub smem_red: usize,
    pub smem_w: usize,
}

impl OneTokenShape {
    /// The layout for `blocks` blocks, or `None` when a team would wait on more virtual blocks
    /// than the kernel counts. Virtual blocks per GEMM: `ceil(rg / rb)` column blocks for each of
    /// the `top_k` experts (one token: `top_k` distinct experts).
    pub fn new(g: &OneTokenGemms, blocks: usize) -> Option<Self> {
        let u1 = if g.gated { 2 } else { 1 };
        let vbpb1 = (g.rg1.div_ceil(g.rb1) * g.top_k).div_ceil(blocks);
        let vbpb2 = (g.rg2.div_ceil(g.rb2) * g.top_k).div_ceil(blocks);
        let teams = teams(g.gated);
        if vbpb1.div_ceil(teams) > OT_MAX_GROUPS || vbpb2.div_ceil(teams) > OT_MAX_GROUPS {
            return None;
        }
        let act = StreamShape::row_bytes(g.kg1)
            .max(g.top_k * StreamShape::row_bytes(g.kg2))
            .next_multiple_of(16);
        // Per team the most split-K partials a virtual block parks (one unit per block: 7 slices).
        let red = teams * StreamShape::partial_bytes(1, u1);
        let w1 = vbpb1 * StreamShape::weight_bytes(g.rb1, u1, g.kg1);
        let w2 = vbpb2 * StreamShape::weight_bytes(g.rb2, 1, g.kg2);
        // Top-k's scratch, the gathered logits and the bias (`one_token`'s scratch, slog, sbias).
        let scratch = (4 * g.experts + 64) * 4;
        let smem_act = OT_HDR_BYTES;
        let smem_red = smem_act + act;
        // 128-byte aligned, so that every bulk copy lands on a 128-byte boundary (the regions
        // and their units are multiples of 128 bytes). KERNEL_NOTES runs 100-101 measured the
        // regions at 16 bytes past a boundary: GEMM1's copies were issued 0.45 µs later and the
        // median block left 1.9 µs later; Nemotron's layer took 0.5 µs longer. 1024 bytes was
        // level with 128.
        let smem_w = (smem_red + red).next_multiple_of(128);
        Some(Self {
            blocks,
            smem: smem_w + w1.max(w2).max(scratch),
            vbpb1,
            vbpb2,
            smem_act,
            smem_red,
            smem_w,
        })
    }
}

/// `FP4MOE_ONE_TOKEN=0|1` turns the one-launch layer off or on (a benchmark knob).
fn from_env() -> Option<bool> {
    static KNOB: OnceLock<Option<String>> = OnceLock::new();
    tuning_choice(&KNOB, "FP4MOE_ONE_TOKEN", &[("0", false), ("1", true)])
}

/// `FP4MOE_ONE_TOKEN_PREFETCH=1|2` prefetches GEMM2's weights into L2 with GEMM1's copies (1)
/// or once a block's GEMM1 weights have landed (2); default 0, none (a benchmark knob: 1 was
/// slower in runs 83–85).
fn prefetch_from_env() -> i32 {
    static KNOB: OnceLock<Option<String>> = OnceLock::new();
    tuning_choice(
        &KNOB,
        "FP4MOE_ONE_TOKEN_PREFETCH",
        &[("0", 0), ("1", 1), ("2", 2)],
    )
    .unwrap_or(0)
}

impl CudaLayer {
    /// Forces the one-token layer in one launch on or off for later forwards (`None`:
    /// `FP4MOE_ONE_TOKEN`, else on, where it measured faster for both expert kinds; see
    /// [`CudaLayer::one_token_applies`] for where it can run at all).
    pub fn set_one_token(&mut self, on: Option<bool>) {
        self.one_token = on;
    }

    /// Whether a forward of `tokens` tokens that routes on the device (from the router weight
    /// or caller logits) runs as the one `one_token` launch.
    pub fn one_token_applies(&self, tokens: usize) -> bool {
        self.one_token_plan(tokens).is_some()
    }

    /// The kernel and its launch shape, where the one-launch layer applies.
    fn one_token_plan(
        &self,
        tokens: usize,
    ) -> Option<(&'static str, OneTokenGemms, OneTokenShape)> {
        let s = &self.spec;
        let (h, i, e, k) = (
            s.shape.hidden,
            s.shape.intermediate,
            s.shape.experts,
            s.routing.top_k,
        );
        // On by default: run 86 (H200, T = 1) measured Nemotron-3 Nano 37.2 against 39.0–39.3
        // µs split (W4A16), 37.5 against 39.3–39.6 (W4A4). Gated experts were off until session
        // 40 (run 86: Qwen3-30B-A3B level in W4A16, slower in W4A4); run 179 measured Qwen3
        // 29.8 against 31.5 (W4A16) and 28.9 against 31.8 (W4A4), two rounds each.
        let wanted = self.one_token.or_else(from_env).unwrap_or(true);
        let decode = self
            .decode_kernel
            .or_else(DecodeKernel::from_env)
            .unwrap_or(DecodeKernel::for_tokens(tokens));
        if !wanted
            || tokens != 1
            || self.shared.is_some()
            || !self.w13.nvfp4
            || !self.w2.nvfp4
            || self.stage_limit.is_some()
            || self.route_path_for(tokens) != RoutePath::Fused
            || self.path_for(k, e) != GemmPath::Decode
            || decode != DecodeKernel::Stream
        {
            return None;
        }
        let gated = s.activation.is_gated();
        let (name, stream1) = if gated {
            ("one_token_gated", "stream_gemm1_gated")
        } else {
            ("one_token_plain", "stream_gemm1_plain")
        };
        let (rg1, rg2) = (i / 16, h / 16);
        // The streaming kernels' units per block for this layer: the same K split, the same bits.
        let rb1 = self.stream_shape(stream1, &self.w13, gated, rg1, 1, k)?.rb;
        let rb2 = self
            .stream_shape("stream_gemm2", &self.w2, false, rg2, 1, k)?
            .rb;
        let kg = |k: usize| super::pack::padded_k(k) / 64;
        let gemms = OneTokenGemms {
            rb1,
            rb2,
            kg1: kg(self.w13.k),
            kg2: kg(self.w2.k),
            rg1,
            rg2,
            gated,
            top_k: k,
            experts: e,
        };
        // The shape depends on the layer and the K splits only: found once per pair of splits
        // (no occupancy query per forward). A poisoned cache is recomputed, never fatal.
        let key = (rb1, rb2);
        let cached = self
            .one_token_shapes
            .lock()
            .ok()
            .and_then(|c| c.iter().find(|(k, _)| *k == key).map(|(_, s)| *s));
        let shape = match cached {
            Some(shape) => shape,
            None => {
                let shape = self.one_token_shape(name, &gemms);
                if let Ok(mut c) = self.one_token_shapes.lock() {
                    c.push((key, shape));
                }
                shape
            }
        }?;
        Some((name, gemms, shape))
    }

    /// One block per SM (the registers hold one: 1024 threads at 64 registers, gated 768 at 80),
    /// where its shared memory fits and the driver confirms that an SM takes it. The grid is
    /// always the device's SM count: the kernel's barrier counts arrivals across launches on a
    /// workspace and waits for the next multiple of the grid size.
    fn one_token_shape(&self, name: &str, gemms: &OneTokenGemms) -> Option<OneTokenShape> {
        let shape = OneTokenShape::new(gemms, self.dev.sms)?;
        if shape.smem > self.dev.max_shared_bytes {
            return None;
        }
        let resident = self
            .dev
            .function(name)
            .ok()?
            .occupancy_max_active_blocks_per_multiprocessor(
                threads(gemms.gated) as u32,
                shape.smem,
                None,
            )
            .ok()?;
        (resident >= 1).then_some(shape)
    }

    /// Runs the whole one-token layer from `source` as one launch where it applies; `false`
    /// (nothing launched) where it does not.
    pub(super) fn one_token(&self, ws: &CudaWorkspace, source: RouteSource) -> Result<bool> {
        if matches!(source, RouteSource::Ids) {
            return Ok(false);
        }
        let Some((name, g, shape)) = self.one_token_plan(ws.tokens) else {
            return Ok(false);
        };
        let st = &self.dev.stream;
        let r = self.spec.routing;
        let (g1, g2) = self.routed_params(ws);
        let params = OneTokenParams {
            g1,
            g2,
            io: self.route_io(ws, source)?,
            y: ptr(&ws.out, st),
            sync: ptr(&ws.one_token_sync, st),
            select: self.selection(),
            rsf: r.routed_scaling_factor,
            gs: self.gs1.unwrap_or(0.0),
            rb1: g.rb1 as i32,
            rb2: g.rb2 as i32,
            vbpb1: shape.vbpb1 as i32,
            vbpb2: shape.vbpb2 as i32,
            smem_act: shape.smem_act as i32,
            smem_red: shape.smem_red as i32,
            smem_w: shape.smem_w as i32,
            prefetch: prefetch_from_env(),
            trace: if tracing() {
                ptr(&ws.one_token_trace, st)
            } else {
                0
            },
        };
        let cfg = LaunchConfig {
            grid_dim: (shape.blocks as u32, 1, 1),
            block_dim: (threads(g.gated) as u32, 1, 1),
            shared_mem_bytes: shape.smem as u32,
        };
        self.launch_serialized(name, cfg, |b| {
            b.arg(&params);
        })?;
        Ok(true)
    }

    /// The phase timestamps of the last traced one-token launch on `ws`, as text: per phase
    /// point, µs after the earliest block entry (min / median / max over blocks). `None` when not
    /// tracing or the layer does not run one-token launches on `ws`. Synchronizes the stream.
    pub fn one_token_trace_report(&self, ws: &CudaWorkspace) -> Result<Option<String>> {
        if !tracing() {
            return Ok(None);
        }
        let Some((name, g, shape)) = self.one_token_plan(ws.tokens) else {
            return Ok(None);
        };
        let st = &self.dev.stream;
        let raw = st
            .clone_dtoh(&ws.one_token_trace)
            .map_err(super::driver_err("trace download"))?;
        let blocks: Vec<&[u64]> = raw
            .chunks_exact(OT_TRACE_POINTS)
            .take(shape.blocks)
            .filter(|b| b.iter().all(|&t| t > 0))
            .collect();
        let Some(t0) = blocks.iter().map(|b| b[0]).min() else {
            return Ok(None);
        };
        let mut report = format!(
            "{name}: {} blocks x {} threads, {} B shared; µs after the first block's entry (min / median / max over {} traced blocks)",
            shape.blocks,
            threads(g.gated),
            shape.smem,
            blocks.len()
        );
        for (i, what) in TRACE_NAMES.iter().enumerate() {
            let mut v: Vec<f64> = blocks.iter().map(|b| (b[i] - t0) as f64 / 1e3).collect();
            v.sort_by(f64::total_cmp);
            report += &format!(
                "\n  {what:<30} {:8.2} {:8.2} {:8.2}",
                v[0],
                v[v.len() / 2],
                v[v.len() - 1]
            );
        }
        Ok(Some(report))
    }
}

#[cfg(test)]
mod tests {
    use super::super::compile::{kernel_define, kernel_text};
    use super::*;

    #[test]
    fn constants_and_parameters_match_the_kernel() {
        assert_eq!(kernel_define("one_token.cu", "OT_HDR_BYTES"), OT_HDR_BYTES);
        assert_eq!(kernel_define("one_token.cu", "OT_TICKETS"), SYNC_TICKETS);
        // The logit flags follow the tickets from an even word (the kernel's OT_LOGIT_FLAGS).
        let text = kernel_text("one_token.cu");
        assert!(text
            .contains("#define OT_LOGIT_FLAGS(col_blocks) ((OT_TICKETS + (col_blocks) + 1) & ~1)"));
        for (cols, experts) in [(168, 128), (180, 128), (3, 64), (64, 512)] {
            let flags = sync_len(cols, experts) - 2 * experts;
            assert_eq!(flags % 2, 0);
            assert!(flags >= SYNC_TICKETS + cols && flags <= SYNC_TICKETS + cols + 1);
        }
        assert_eq!(
            kernel_define("one_token.cu", "OT_TRACE_POINTS"),
            OT_TRACE_POINTS
        );
        assert_eq!(
            kernel_define("one_token.cu", "OT_MAX_GROUPS"),
            OT_MAX_GROUPS
        );
        assert_eq!(
            kernel_define("one_token.cu", "OT_TEAMS_PLAIN"),
            teams(false)
        );
        assert_eq!(kernel_define("one_token.cu", "OT_TEAMS_GATED"), teams(true));
        assert_eq!(kernel_define("expert_stream.cuh", "STREAM_WARPS"), 8);
        // The header holds the offsets of 512 experts after OT_OFFSETS ints.
        let offsets = kernel_define("one_token.cu", "OT_OFFSETS");
        let bars = kernel_define("one_token.cu", "OT_BARS_BYTE");
        assert!(4 * (offsets + super::super::MAX_EXPERTS + 1) <= bars);
        // Two sets of mbarriers, one per virtual block a block takes: teams x OT_MAX_GROUPS.
        assert!(teams(false).max(teams(true)) * OT_MAX_GROUPS <= 32);
        assert!(bars % 8 == 0 && bars + 64 * 8 <= OT_HDR_BYTES);
        assert_eq!(OT_HDR_BYTES % 16, 0);
        assert_eq!(std::mem::size_of::<GemmParams>(), 152);
        assert_eq!(
            std::mem::size_of::<OneTokenParams>(),
            2 * 152 + 8 * 8 + 16 * 4 + 8
        );
        // Field order: the kernel's struct declares the same names in the same order.
        let src = kernel_text("one_token.cu");
        let body = &src[src.find("struct OneTokenParams {").unwrap()..];
        let body = &body[..body.find("};").unwrap()];
        let mut at = 0;
        for name in [
            "g1",
            "g2",
            "x",
            "router",
            "logits",
            "bias",
            "ids",
            "weights",
            "y",
            "sync",
            "experts",
            "top_k",
            "scoring",
            "n_group",
            "topk_group",
            "renormalize",
            "rsf",
            "gs",
            "rb1",
            "rb2",
            "vbpb1",
            "vbpb2",
            "smem_act",
            "smem_red",
            "smem_w",
            "prefetch",
            "trace",
        ] {
            let found = [";", ","]
                .iter()
                .filter_map(|end| body[at..].find(&format!(" {name}{end}")))
                .min();
            let Some(pos) = found else {
                panic!("one_token.cu's OneTokenParams lacks `{name}` after byte {at}")
            };
            at += pos + name.len() + 1;
        }
    }

    fn nemotron(rb1: usize, rb2: usize) -> OneTokenGemms {
        OneTokenGemms {
            rb1,
            rb2,
            kg1: 42,
            kg2: 29,
            rg1: 116,
            rg2: 168,
            gated: false,
            top_k: 6,
            experts: 128,
        }
    }

    #[test]
    fn shape_covers_every_virtual_block_and_lays_out_disjoint_regions() {
        for (g, blocks) in [
            (nemotron(2, 2), 132),
            (nemotron(1, 1), 264),
            (nemotron(4, 4), 132),
            (
                OneTokenGemms {
                    rb1: 1,
                    rb2: 2,
                    kg1: 32,
                    kg2: 12,
                    rg1: 48,
                    rg2: 128,
                    gated: true,
                    top_k: 8,
                    experts: 128,
                },
                132,
            ),
        ] {
            let s = OneTokenShape::new(&g, blocks).unwrap();
            assert!(s.vbpb1 * blocks >= g.rg1.div_ceil(g.rb1) * g.top_k);
            assert!((s.vbpb1 - 1) * blocks < g.rg1.div_ceil(g.rb1) * g.top_k);
            assert!(s.vbpb2 * blocks >= g.rg2.div_ceil(g.rb2) * g.top_k);
            let u1 = if g.gated { 2 } else { 1 };
            // Operand rows: GEMM1's one row and GEMM2's top_k rows fit before the partials.
            assert!(s.smem_act + (g.kg1 * 64 + 8) * 2 <= s.smem_red);
            assert!(s.smem_act + g.top_k * (g.kg2 * 64 + 8) * 2 <= s.smem_red);
            assert_eq!(s.smem_red % 16, 0);
            assert_eq!(s.smem_w % 128, 0);
            assert!(s.smem_red + teams(g.gated) * 7 * 32 * 4 * u1 * 4 <= s.smem_w);
            assert!(s.smem_w + s.vbpb1 * g.rb1 * u1 * g.kg1 * 576 <= s.smem);
            assert!(s.smem_w + s.vbpb2 * g.rb2 * g.kg2 * 576 <= s.smem);
            assert!(s.smem_w + (4 * g.experts + 64) * 4 <= s.smem);
        }
        // Nemotron at one block per SM: 3 GEMM1 virtual blocks of 2 units per block.
        let s = OneTokenShape::new(&nemotron(2, 2), 132).unwrap();
        assert_eq!((s.vbpb1, s.vbpb2), (3, 4));
        // Too many virtual blocks for the commit groups a team counts.
        assert!(OneTokenShape::new(&nemotron(1, 1), 4).is_none());
    }
}
