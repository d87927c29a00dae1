//! The expert GEMMs' launches: the routed GEMM1 → GEMM2 pair and the shared expert's, on the
//! decode kernels (`expert_gemm.cu`'s mma kernels or `expert_stream.cu`) or the prefill tiles
//! (`prefill_gemm.cu`, with their TMA tensor maps), as `gemm_plan`'s rules choose; each launch's
//! `GemmParams`, grid and shared memory, and the expert-ready handoff's counters.

use super::*;

impl CudaLayer {
    /// Token subtiles (8 tokens each) per pass ([`subtiles_wanted`]; `gated`: the kernel's
    /// two weight rows per output, for its shared memory), never more than shared memory allows.
    /// `FP4MOE_DECODE_NSUB=1|2|4` asks for another count (a benchmark knob; shared memory still
    /// bounds it).
    fn nsub(&self, tokens: usize, k: usize, gated: bool, shape: GemmShape) -> usize {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let quarters =
            per_expert_quarters(tokens, self.spec.routing.top_k, self.spec.shape.experts);
        let forced = tuning_choice(&KNOB, "FP4MOE_DECODE_NSUB", &[("1", 1), ("2", 2), ("4", 4)]);
        let gated_layer = self.spec.activation.is_gated();
        let want = forced.unwrap_or_else(|| subtiles_wanted(tokens, quarters, gated_layer, shape));
        [4, 2, 1]
            .into_iter()
            .filter(|&n| n <= want)
            .find(|&n| gemm_smem(n, k, gated, shape) <= self.dev.max_shared_bytes)
            .unwrap_or(1)
    }

    /// One decode GEMM: `stream` (the `expert_stream.cu` kernel family of an NVFP4 projection)
    /// where chosen and its shared memory fits, else `expert_gemm.cu`'s `name`. Returns the
    /// mma kernel's blocks per expert (grid x), 0 for a streaming kernel.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        name: &str,
        stream: Option<&str>,
        proj: &DeviceProjection,
        params: GemmParams,
        rg_out: usize,
        slots: usize,
        tokens: usize,
        one_token_slots: usize,
    ) -> Result<u32> {
        let gated = name.contains("gated");
        let kernel = self.decode_kernel_for(tokens);
        let streaming = match (stream, kernel) {
            (Some(stream), DecodeKernel::Stream) => self
                .stream_shape(stream, proj, gated, rg_out, tokens, one_token_slots)
                .map(|sh| (stream, sh)),
            _ => None,
        };
        if let Some((stream, sh)) = streaming {
            let cfg = LaunchConfig {
                grid_dim: (rg_out.div_ceil(sh.rb) as u32, slots as u32, 1),
                block_dim: (STREAM_THREADS as u32, 1, 1),
                shared_mem_bytes: sh.smem as u32,
            };
            let params = GemmParams {
                tile_rows: tokens.clamp(1, STREAM_TILE) as i32,
                ..params
            };
            return self
                .launch_gemm(&format!("{stream}_r{}", sh.rb), cfg, params)
                .map(|()| 0);
        }
        let shape = GemmShape::chosen(
            tokens,
            slots,
            self.gemm_shape,
            name.starts_with("gemm1"),
            self.spec.activation.is_gated(),
            proj.nvfp4,
        );
        let nsub = self.nsub(tokens, proj.k, gated, shape);
        let kname = format!("{name}_{}_n{nsub}", shape.name(nsub));
        let smem = gemm_smem(nsub, proj.k, gated, shape) as u32;
        if smem as usize > self.dev.max_shared_bytes {
            return Err(Error::Unsupported {
                backend: "cuda".into(),
                reason: format!(
                    "K = {} needs {smem} bytes of shared memory per block; the device allows {}",
                    proj.k, self.dev.max_shared_bytes
                ),
            });
        }
        // The kernels stage activation rows by 16-byte cp.async: every row must start 16-byte
        // aligned (the spec's multiples of 16 and buffers that start allocations make it so).
        if params.act % 16 != 0 || params.k % 8 != 0 {
            return Err(Error::Cuda {
                stage: "expert GEMMs",
                message: format!(
                    "internal: {kname} needs 16-byte aligned activation rows (K = {})",
                    params.k
                ),
            });
        }
        let blocks = rg_out.div_ceil(shape.rgpb(nsub)) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, slots as u32, 1),
            block_dim: ((shape.warps(nsub) * 32) as u32, 1, 1),
            shared_mem_bytes: smem,
        };
        self.launch_gemm(&kname, cfg, params).map(|()| blocks)
    }

    /// The streaming launch shape for `tokens` tokens, or `None` when it does not fit. Units per
    /// block: forced (layer, then `FP4MOE_STREAM_UNITS`), else [`StreamShape::choose`]'s for one
    /// token (`one_token_slots` experts), chosen once per projection: a property of the layer,
    /// not of the batch, so a token's bits do not depend on the batch (the units per block set
    /// the K split), and no occupancy query runs per forward.
    pub(super) fn stream_shape(
        &self,
        stream: &str,
        proj: &DeviceProjection,
        gated: bool,
        rg_out: usize,
        tokens: usize,
        one_token_slots: usize,
    ) -> Option<StreamShape> {
        let max = self.dev.max_shared_bytes;
        let rb = match self.stream_units.or_else(StreamShape::from_env) {
            Some(rb) => rb,
            None => {
                (*proj.stream_units.get_or_init(|| {
                    let one = StreamShape::candidates(proj.k, gated, 1, max);
                    StreamShape::choose(
                        &one,
                        |c| rg_out.div_ceil(c.rb) * one_token_slots,
                        |c| self.stream_resident(stream, c),
                    )
                    .map(|c| c.rb)
                }))?
            }
        };
        StreamShape::new(rb, proj.k, gated, tokens, max)
    }

    /// Blocks of streaming kernel family `stream` in shape `c` the whole device holds at once
    /// (0 when the driver cannot say).
    fn stream_resident(&self, stream: &str, c: &StreamShape) -> usize {
        let per_sm = self
            .dev
            .function(&format!("{stream}_r{}", c.rb))
            .ok()
            .and_then(|f| {
                f.occupancy_max_active_blocks_per_multiprocessor(
                    STREAM_THREADS as u32,
                    c.smem,
                    None,
                )
                .ok()
            })
            .unwrap_or(0);
        per_sm as usize * self.dev.sms
    }

    /// The layer's forced path, else `FP4MOE_GEMM_PATH`, else [`GemmPath::choose`]'s rule.
    pub(super) fn path_for(&self, pairs: usize, experts: usize) -> GemmPath {
        let forced = self.gemm_path.or_else(GemmPath::from_env);
        let gated = self.spec.activation.is_gated();
        GemmPath::choose(pairs, experts, gated, self.dev.max_shared_bytes, forced)
    }

    /// One prefill GEMM (`prefill_gemm.cu`): grid x over the tile's weight-row tiles
    /// ([`PrefillTile::row_groups`] row groups each), grid y over an upper bound of the (expert,
    /// token tile) work items of `pairs` pairs spread over at most `slots` experts.
    /// With a TMA `feed`, `sorted_rows` are the activation rows in sorted order. Returns the
    /// row tiles (grid x): the blocks of each token tile.
    #[allow(clippy::too_many_arguments)]
    fn prefill_gemm(
        &self,
        gemm: PrefillGemm,
        tile: PrefillTile,
        feed: PrefillFeed,
        sorted_rows: SortedRows,
        params: GemmParams,
        rg_out: usize,
        pairs: usize,
        slots: usize,
    ) -> Result<usize> {
        let tiles = prefill_token_tiles(tile, pairs, slots)?;
        let name = gemm.kernel(tile, feed).ok_or_else(|| Error::Cuda {
            stage: "kernel launch",
            message: format!("no prefill kernel runs {tile:?} tiles fed by {feed:?}"),
        })?;
        let cluster = feed.cluster();
        let row_tiles = rg_out.div_ceil(tile.row_groups(gemm));
        if row_tiles % cluster as usize != 0 {
            return Err(Error::Cuda {
                stage: "kernel launch",
                message: format!(
                    "{name}: {row_tiles} row tiles do not pair into clusters of {cluster}"
                ),
            });
        }
        let cfg = LaunchConfig {
            grid_dim: (row_tiles as u32, tiles as u32, 1),
            block_dim: (tile.threads() as u32, 1, 1),
            shared_mem_bytes: tile.shared_bytes() as u32,
        };
        if feed == PrefillFeed::CpAsync {
            return self.launch_gemm(name, cfg, params).map(|_| row_tiles);
        }
        let map =
            tensor_map(sorted_rows, params.k as usize, tile.box_rows()).map_err(|e| match e {
                Error::Cuda { stage, message } => Error::Cuda {
                    stage,
                    message: format!("{name}: {message}"),
                },
                e => e,
            })?;
        let mut args: [*mut c_void; 2] = [
            &params as *const GemmParams as *mut c_void,
            &map as *const dsys::CUtensorMap as *mut c_void,
        ];
        // SAFETY: the TMA kernels take (GemmParams, CUtensorMap) by value; both live on this
        // frame for the duration of the call. The map covers `sorted_rows.rows` rows of
        // `sorted_rows.stride` bf16 inside a workspace buffer (`a_sorted`, `xs`, `g`, `sh_g`)
        // that outlives the launch and any graph replaying it; the TMA never reads past it.
        unsafe { self.launch_ex(name, cfg, cluster, self.dev.pdl, &mut args) }?;
        Ok(row_tiles)
    }

    /// The tile and activation feed of one prefill GEMM of reduction length `k` and `rg` output
    /// row groups over `pairs` pairs of at most `slots` experts (wide and dual tiles need the
    /// TMA feed).
    fn prefill_plan(
        &self,
        gemm: PrefillGemm,
        k: usize,
        rg: usize,
        pairs: usize,
        slots: usize,
    ) -> (PrefillTile, PrefillFeed) {
        let forced_tile = self.prefill_tile.or_else(PrefillTile::from_env);
        let tile = PrefillTile::choose(
            pairs,
            slots,
            self.spec.activation.is_gated(),
            self.dev.max_shared_bytes,
            forced_tile,
        );
        let forced = self
            .prefill_feed
            .or_else(|| PrefillFeed::from_env(gemm != PrefillGemm::Gemm2));
        let per_expert = pairs / slots.max(1);
        let choose = |tile: PrefillTile| {
            let row_tiles = rg.div_ceil(tile.row_groups(gemm));
            PrefillFeed::choose(
                tile,
                per_expert,
                k,
                pairs,
                row_tiles,
                &self.dev.arch,
                forced,
            )
        };
        let tile = match forced_tile {
            None => tile.for_gemm(gemm, k, per_expert, self.dev.max_shared_bytes),
            Some(_) => tile,
        };
        let tile = tile.for_feed(choose(tile));
        (tile, choose(tile))
    }

    /// GEMM1's prefill kernel for this layer's activation.
    fn prefill_gemm1(&self) -> PrefillGemm {
        if self.spec.activation.is_gated() {
            PrefillGemm::Gemm1Gated
        } else {
            PrefillGemm::Gemm1Plain
        }
    }

    /// Whether the routed GEMM1 of a `tokens`-token batch reads its operand in sorted pair order
    /// (`a_sorted`: NVFP4 weights on the prefill path with a TMA feed), so that the input
    /// preparation writes it there directly (`prepare_input_sorted`) instead of `gather_rows`
    /// copying it from `a`.
    pub(super) fn gemm1_reads_sorted(&self, tokens: usize) -> bool {
        let (e, pairs) = (self.spec.shape.experts, tokens * self.spec.routing.top_k);
        let slots = pairs.min(e);
        let (h, rg1) = (self.spec.shape.hidden, self.spec.shape.intermediate / 16);
        self.w13.nvfp4
            && self.path_for(pairs, e) == GemmPath::Prefill
            && self
                .prefill_plan(self.prefill_gemm1(), h, rg1, pairs, slots)
                .1
                != PrefillFeed::CpAsync
    }

    /// GEMM1 then GEMM2 of one projection pair through the path `path` (bf16 weights always
    /// take the decode kernels). `gathered`: for the routed experts, `a_sorted` and whether the
    /// input preparation already wrote it (else `gather_rows` does, where GEMM1 reads it).
    #[allow(clippy::too_many_arguments)]
    fn expert_gemms(
        &self,
        path: GemmPath,
        w13: &DeviceProjection,
        w2: &DeviceProjection,
        p1: GemmParams,
        p2: GemmParams,
        pairs: usize,
        slots: usize,
        tokens: usize,
        gathered: Option<(u64, bool)>,
    ) -> Result<()> {
        let routed = gathered.is_some();
        let gated = self.spec.activation.is_gated();
        let kind = |proj: &DeviceProjection| if proj.nvfp4 { "nvfp4" } else { "bf16" };
        // Experts a one-token batch touches: top-k routed, the one shared expert.
        let one_token_slots = if routed { self.spec.routing.top_k } else { 1 };
        let (rg1, rg2) = (p1.rg_out as usize, p2.rg_out as usize);
        let gemm1 = self.prefill_gemm1();
        let (tile1, feed1) = self.prefill_plan(gemm1, p1.k as usize, rg1, pairs, slots);
        let (tile2, feed2) =
            self.prefill_plan(PrefillGemm::Gemm2, p2.k as usize, rg2, pairs, slots);
        // bf16 weights always take the decode kernels.
        let prefill1 = path == GemmPath::Prefill && w13.nvfp4;
        let prefill2 = path == GemmPath::Prefill && w2.nvfp4;
        let reads_sorted = prefill1 && feed1 != PrefillFeed::CpAsync;
        if let Some((_, true)) = gathered {
            // The input preparation wrote only `a_sorted`: `a` holds nothing for another path.
            if !reads_sorted {
                return Err(Error::Cuda {
                    stage: "expert GEMMs",
                    message: "internal: operand prepared in sorted order for a GEMM1 that reads it by token".into(),
                });
            }
        }
        // The expert-ready handoff (gemm_common.cuh) between the routed GEMMs (`routed_params`
        // points both at the counters); elsewhere no kernel touches them.
        let handoff = routed && self.expert_handoff_for(path, w13, w2, tokens);
        let ready = if handoff { p1.ready } else { 0 };
        let (p1, p2) = (GemmParams { ready, ..p1 }, GemmParams { ready, ..p2 });
        // Both grids are checked before either GEMM launches (the tiles may differ).
        if prefill1 {
            prefill_token_tiles(tile1, pairs, slots)?;
        }
        if prefill2 {
            prefill_token_tiles(tile2, pairs, slots)?;
        }
        // GEMM1's blocks per expert (per token tile of `nt1` rows on the prefill tiles; 0 for a
        // streaming kernel, which does not signal).
        let (blocks1, nt1) = if prefill1 {
            let gemm = gemm1;
            // The routed operand's rows in sorted order; the shared expert's already are.
            let mut rows = SortedRows {
                ptr: p1.act,
                rows: pairs,
                stride: p1.k as usize,
            };
            if let (Some((dst, prepared)), true) = (gathered, reads_sorted) {
                if !prepared {
                    self.gather_rows(p1, dst, pairs)?;
                }
                rows.ptr = dst;
            }
            let row_tiles = self.prefill_gemm(gemm, tile1, feed1, rows, p1, rg1, pairs, slots)?;
            (row_tiles, tile1.tokens())
        } else {
            let name = format!(
                "gemm1_{}_{}",
                kind(w13),
                if gated { "gated" } else { "plain" }
            );
            let stream = match (w13.nvfp4, gated) {
                (false, _) => None,
                (true, true) => Some("stream_gemm1_gated"),
                (true, false) => Some("stream_gemm1_plain"),
            };
            let blocks = self.gemm(&name, stream, w13, p1, rg1, slots, tokens, one_token_slots)?;
            (blocks as usize, 0)
        };
        if routed && self.stops_after(2) {
            return Ok(());
        }
        // GEMM1 signalled per expert only if it ran signalling kernels (blocks1 > 0), which the
        // handoff's rule makes so.
        let signalled = ready != 0 && blocks1 > 0;
        let p2 = GemmParams {
            wait_blocks: if signalled { blocks1 as i32 } else { 0 },
            wait_nt: if signalled { nt1 as i32 } else { 0 },
            ready: if signalled { ready } else { 0 },
            ..p2
        };
        let launched = if prefill2 {
            // GEMM2's operand is GEMM1's output, written in sorted order.
            let rows = SortedRows {
                ptr: p2.act,
                rows: pairs,
                stride: p2.k as usize,
            };
            self.prefill_gemm(
                PrefillGemm::Gemm2,
                tile2,
                feed2,
                rows,
                p2,
                rg2,
                pairs,
                slots,
            )
            .map(|_| ())
        } else {
            let stream = w2.nvfp4.then_some("stream_gemm2");
            let name = format!("gemm2_{}", kind(w2));
            self.gemm(&name, stream, w2, p2, rg2, slots, tokens, one_token_slots)
                .map(|_| ())
        };
        if launched.is_err() && signalled {
            // GEMM1 counted its blocks and no GEMM2 will zero the counters: zero them here so
            // the next forward's GEMM2 does not wait for counts it never reaches.
            let n = 2 * p1.experts.max(0) as usize;
            // SAFETY: `ready` is the workspace's `gemm_ready` buffer of 2·E i32 (p1.experts = E
            // for routed GEMMs), on this stream.
            let _ = unsafe { dsys::cuMemsetD32Async(ready, 0, n, self.dev.stream.cu_stream()) };
        }
        launched
    }

    /// `dst[i] = act[sorted[i] / top_k]` for the `pairs` sorted pairs of `p1` (`gather_rows`).
    fn gather_rows(&self, p1: GemmParams, dst: u64, pairs: usize) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (pairs.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, k, h) = (pairs as i32, p1.top_k, p1.k);
        self.launch("gather_rows", cfg, |b| {
            b.arg(&p1.act)
                .arg(&p1.sorted)
                .arg(&dst)
                .arg(&n)
                .arg(&k)
                .arg(&h);
        })
    }

    /// `GemmParams` of projection `proj` without the per-GEMM fields.
    fn projection_params(&self, proj: &DeviceProjection) -> GemmParams {
        let st = &self.dev.stream;
        let act = self.spec.activation;
        let act_id = crate::spec::Activation::ALL
            .iter()
            .position(|a| *a == act)
            .unwrap_or(0) as i32;
        GemmParams {
            wdata: ptr(&proj.data, st),
            wscales: ptr(&proj.scales, st),
            wscale2: ptr(&proj.scale_2, st),
            kg: (pack::padded_k(proj.k) / 64) as i32,
            k: proj.k as i32,
            shards: proj.shards as i32,
            rg_w: (proj.rows / 16) as i32,
            activation: act_id,
            ..Default::default()
        }
    }

    /// The routed experts' GEMM1 and GEMM2 parameters over `ws` (its grouping, `ws.a` as
    /// GEMM1's operand, `ws.g` between the GEMMs, `ws.o` the pairs' outputs).
    pub(super) fn routed_params(&self, ws: &CudaWorkspace) -> (GemmParams, GemmParams) {
        let st = &self.dev.stream;
        let s = &self.spec;
        let (h, i, k) = (s.shape.hidden, s.shape.intermediate, s.routing.top_k);
        let grouping = self.grouping(ws);
        let (g, o, tw) = (ptr(&ws.g, st), ptr(&ws.o, st), ptr(&ws.weights, st));
        let ready = ptr(&ws.gemm_ready, st);
        let p1 = GemmParams {
            act: ptr(&ws.a, st),
            ready,
            g_out: g,
            rg_out: (i / 16) as i32,
            top_k: k as i32,
            out_stride: i as i32,
            act_alpha: self.gs1.map_or(1.0, |gs| 1.0 / gs),
            gs_out: self.gs2.unwrap_or(0.0),
            ..grouping.params(self.projection_params(&self.w13))
        };
        let p2 = GemmParams {
            act: g,
            topk_w: tw,
            o_out: o,
            ready,
            rg_out: (h / 16) as i32,
            top_k: 0,
            out_stride: h as i32,
            act_alpha: self.gs2.map_or(1.0, |gs| 1.0 / gs),
            ..grouping.params(self.projection_params(&self.w2))
        };
        (p1, p2)
    }

    /// Expert GEMMs, shared expert and combine over a grouped and prepared batch (`ws.offsets`
    /// … and `ws.a` / `ws.xs` written by [`CudaLayer::group_device`] or `route_small`; with
    /// `sorted`, `ws.a_sorted` in place of `ws.a`).
    pub(super) fn gemms_device(&self, ws: &CudaWorkspace, sorted: bool) -> Result<()> {
        if self.stops_after(1) {
            return Ok(());
        }
        let st = &self.dev.stream;
        let s = &self.spec;
        let (t, h, e, k) = (ws.tokens, s.shape.hidden, s.shape.experts, s.routing.top_k);
        let p = t * k;
        let hid = h as i32;
        let slots = p.min(e);
        let path = self.path_for(p, e);
        let (p1, p2) = self.routed_params(ws);
        let gathered = Some((ptr(&ws.a_sorted, st), sorted));
        self.expert_gemms(path, &self.w13, &self.w2, p1, p2, p, slots, t, gathered)?;
        if self.stops_after(2) {
            return Ok(());
        }

        let mut sh_o = 0u64;
        if let Some((s13, s2)) = &self.shared {
            let width = s.shared_intermediate.unwrap_or(0);
            let sh = Grouping {
                offsets: ptr(&ws.sh_offsets, st),
                sorted: ptr(&ws.sh_sorted, st),
                active: ptr(&ws.sh_active, st),
                num_active: ptr(&ws.sh_num, st),
                experts: 1,
            };
            let ones = ptr(&ws.sh_ones, st);
            let (sg, xs_p) = (ptr(&ws.sh_g, st), ptr(&ws.xs, st));
            sh_o = ptr(&ws.sh_o, st);
            let q1 = GemmParams {
                act: xs_p,
                g_out: sg,
                rg_out: (width / 16) as i32,
                top_k: 1,
                out_stride: width as i32,
                act_alpha: 1.0,
                gs_out: 0.0,
                ..sh.params(self.projection_params(s13))
            };
            let q2 = GemmParams {
                act: sg,
                topk_w: ones,
                o_out: sh_o,
                rg_out: (h / 16) as i32,
                top_k: 0,
                out_stride: h as i32,
                act_alpha: 1.0,
                ..sh.params(self.projection_params(s2))
            };
            let path = self.path_for(t, 1);
            self.expert_gemms(path, s13, s2, q1, q2, t, 1, t, None)?;
        }
        if self.stops_after(3) {
            return Ok(());
        }

        let (o, y) = (p2.o_out, ptr(&ws.out, st));
        let (tt, kk) = (t as i32, k as i32);
        let cfg = combine_launch(t, h);
        // `combine(const bf16*, const bf16*, float*, int, int, int)`.
        self.launch("combine", cfg, |b| {
            b.arg(&o).arg(&sh_o).arg(&y).arg(&tt).arg(&kk).arg(&hid);
        })
    }
}

/// Rows of a prefill GEMM's activation operand in sorted pair order, for its tensor map.
#[derive(Clone, Copy, Debug)]
pub(super) struct SortedRows {
    ptr: u64,
    rows: usize,
    /// Row stride in bf16 elements.
    stride: usize,
}

/// 2D tensor map of `rows` (bf16, `k` valid columns): boxes of 64 k × `box_rows` rows, 128-byte
/// swizzle (what `smem_desc_sw128` reads), zero fill past K and past the last row.
pub(super) fn tensor_map(rows: SortedRows, k: usize, box_rows: u32) -> Result<dsys::CUtensorMap> {
    use dsys::{
        CUtensorMapDataType_enum as Ty, CUtensorMapFloatOOBfill_enum as Oob,
        CUtensorMapInterleave_enum as Il, CUtensorMapL2promotion_enum as L2,
        CUtensorMapSwizzle_enum as Sw,
    };
    let dims: [u64; 2] = [k as u64, rows.rows.max(1) as u64];
    let strides: [u64; 1] = [(rows.stride * 2) as u64];
    let boxes: [u32; 2] = [64, box_rows];
    let steps: [u32; 2] = [1, 1];
    // SAFETY: `map` is a plain 128-byte struct the call fills; the arrays hold rank (2) and
    // rank - 1 entries as the API requires; `ptr` is a device address the map only records.
    let mut map: dsys::CUtensorMap = unsafe { std::mem::zeroed() };
    unsafe {
        dsys::cuTensorMapEncodeTiled(
            &mut map,
            Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            rows.ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            Il::CU_TENSOR_MAP_INTERLEAVE_NONE,
            Sw::CU_TENSOR_MAP_SWIZZLE_128B,
            L2::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            Oob::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| Error::Cuda {
        stage: "tensor map",
        message: format!(
            "{} rows x {k} bf16 (stride {}): {e}",
            rows.rows, rows.stride
        ),
    })?;
    Ok(map)
}
