//! Routing on the device, the launches of [`CudaLayer::route_device`]: router logits (by the
//! kernel `RouterKernel` picks; its large-batch tiles split k where they alone would not fill
//! a wave), top-k, the pair sort by expert, the grouping (per-expert offsets, the active list) and
//! the input preparation, or all of them as one `route_small` launch for
//! small batches (`RoutePath`); the kernels are `routing.cu`, `sort_pairs.cu`, `prepare_input.cu`
//! and `route_small.cu`.

use super::*;

impl CudaLayer {
    /// Routing on the device: `ws.ids`, `ws.weights` from `logits` (`[T, E]`, or computed from the
    /// router weight when `None`) for the tokens in `ws.x`.
    pub fn route_device(
        &self,
        ws: &mut CudaWorkspace,
        logits: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        if ws.tokens == 0 {
            return Ok(());
        }
        let (t, h, e) = (
            ws.tokens as i32,
            self.spec.shape.hidden as i32,
            self.spec.shape.experts as i32,
        );
        let st = &self.dev.stream;
        let logits_ptr = match logits {
            Some(l) => ptr(l, st),
            None => {
                let router = self.router_weight()?;
                // A warp per logit keeps the latency low for a few tokens; from the tiled
                // threshold a shared-memory tiled kernel reads x and the router weight 32 to
                // 128 times less often: for a bf16 router the bf16 tensor-core tiles from 128
                // tokens (run 69), else from 1024 the wide kernel's 64 x 128 f32 tiles, faster
                // than the 64 x 64 SIMT and the TF32 tiles at every size measured (run 64).
                let kernel = self.router_kernel();
                let (x, l) = (ptr(&ws.x, st), ptr(&ws.logits, st));
                let rp = ptr(router, st);
                let tiled = ws.tokens >= router_tiled_from(kernel);
                if tiled {
                    if let (RouterKernel::Bf16, Some((wb, hp))) = (kernel, &self.router_bf16) {
                        self.router_logits_split_k(ws, RouterKernel::Bf16, x, ptr(wb, st), *hp, l)?;
                        return self.route_topk(ws, l);
                    }
                    if kernel == RouterKernel::Wide {
                        self.router_logits_split_k(ws, RouterKernel::Wide, x, rp, 0, l)?;
                        return self.route_topk(ws, l);
                    }
                }
                let (name, cfg) = if tiled {
                    // Tiles of 64 tokens x 64 experts (SIMT) or 32 x 32 (TF32).
                    let (name, tile, threads) = match kernel {
                        RouterKernel::Simt | RouterKernel::Wide | RouterKernel::Bf16 => {
                            ("router_logits_tiled", (64, 64), 256)
                        }
                        RouterKernel::Tf32x3 => {
                            ("router_logits_tf32x3", (32, 32), ROUTER_TF32_THREADS)
                        }
                    };
                    let cfg = LaunchConfig {
                        grid_dim: ((t as u32).div_ceil(tile.0), (e as u32).div_ceil(tile.1), 1),
                        block_dim: (threads, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    (name, cfg)
                } else if ws.tokens * self.spec.shape.experts <= ROUTER_SLICED_MAX_LOGITS {
                    // 32 warps, each logit's k split over ROUTER_SLICES of them.
                    let n = ws.tokens * self.spec.shape.experts;
                    let cfg = LaunchConfig {
                        grid_dim: (n.div_ceil(router_logits_per_block(n)) as u32, 1, 1),
                        block_dim: (32 * 32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    ("router_logits", cfg)
                } else {
                    // Beyond, a warp per 2 tokens x 4 experts (the bits of a warp per logit,
                    // the kernel until session 36, with a quarter of its L2 reads).
                    let (bt, be) = ROUTER_MULTI_TILE;
                    let cfg = LaunchConfig {
                        grid_dim: (
                            self.spec.shape.experts.div_ceil(be) as u32,
                            ws.tokens.div_ceil(bt) as u32,
                            1,
                        ),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    ("router_logits_multi", cfg)
                };
                self.launch(name, cfg, |b| {
                    b.arg(&x).arg(&rp).arg(&l).arg(&t).arg(&h).arg(&e);
                })?;
                l
            }
        };
        self.route_topk(ws, logits_ptr)
    }

    /// The 64 x 128 router tiles into `logits`, through `ws.router_part` and
    /// `router_sum_splits` where they split k: `router_logits_wide` (`router` the f32 weight)
    /// or `router_logits_bf16` (`router` the bf16 copy, `hidden_pad` its row stride).
    fn router_logits_split_k(
        &self,
        ws: &CudaWorkspace,
        kernel: RouterKernel,
        x: u64,
        router: u64,
        hidden_pad: usize,
        logits: u64,
    ) -> Result<()> {
        let st = &self.dev.stream;
        let (tokens, hidden, experts) =
            (ws.tokens, self.spec.shape.hidden, self.spec.shape.experts);
        let bf16 = kernel == RouterKernel::Bf16;
        let (splits, k_split) = if bf16 {
            router_bf16_splits(tokens, hidden, experts)
        } else {
            router_wide_splits(tokens, hidden, experts)
        };
        let out = if splits > 1 {
            // The kernel writes `splits` slices of T·E partial sums.
            if ws.router_part.len() < splits * tokens * experts {
                return Err(Error::arg(
                    "workspace",
                    "router_part is too small for this router kernel's k split: \
                     allocate the workspace with this layer's spec",
                ));
            }
            ptr(&ws.router_part, st)
        } else {
            logits
        };
        let tile = if bf16 {
            self.router_bf16_tile(tokens)
        } else {
            ROUTER_WIDE_TILE.0
        };
        let (name, threads, shared) = match (bf16, tile) {
            (true, 16) => (
                "router_logits_bf16_t16",
                32 * ROUTER_BF16_T16.1,
                router_bf16_shared(ROUTER_BF16_T16.0),
            ),
            (true, _) => (
                "router_logits_bf16",
                ROUTER_BF16_THREADS,
                ROUTER_BF16_SHARED,
            ),
            (false, _) => (
                "router_logits_wide",
                ROUTER_WIDE_THREADS,
                ROUTER_WIDE_SHARED,
            ),
        };
        let cfg = LaunchConfig {
            grid_dim: (
                tokens.div_ceil(tile) as u32,
                experts.div_ceil(ROUTER_WIDE_TILE.1) as u32,
                splits as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: shared,
        };
        let (t, h, hp, e, ks) = (
            tokens as i32,
            hidden as i32,
            hidden_pad as i32,
            experts as i32,
            k_split as i32,
        );
        self.launch(name, cfg, |b| {
            b.arg(&x).arg(&router).arg(&out).arg(&t).arg(&h);
            if bf16 {
                b.arg(&hp);
            }
            b.arg(&e).arg(&ks);
        })?;
        if splits > 1 {
            let n = (tokens * experts) as i32;
            let s = splits as i32;
            let cfg = LaunchConfig {
                grid_dim: ((n as u32).div_ceil(256).min(4 * self.dev.sms as u32), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch("router_sum_splits", cfg, |b| {
                b.arg(&out).arg(&logits).arg(&n).arg(&s);
            })?;
        }
        Ok(())
    }

    /// `route_topk`: `ws.ids`, `ws.weights` from the `[T, E]` logits at `logits_ptr`.
    fn route_topk(&self, ws: &CudaWorkspace, logits_ptr: u64) -> Result<()> {
        let st = &self.dev.stream;
        let r = self.spec.routing;
        let (t, e) = (ws.tokens as i32, self.spec.shape.experts as i32);
        let bias = self.bias.as_ref().map_or(0u64, |b| ptr(b, st));
        let (ids, w) = (ptr(&ws.ids, st), ptr(&ws.weights, st));
        let (k, scoring) = (r.top_k as i32, i32::from(r.scoring == Scoring::Sigmoid));
        let (ng, tg, renorm, rsf) = (
            r.n_group as i32,
            r.topk_group as i32,
            i32::from(r.renormalize),
            r.routed_scaling_factor,
        );
        let cfg = LaunchConfig {
            grid_dim: ((t as u32).div_ceil(4), 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 4 * 4 * (2 * e as u32 + 64),
        };
        self.launch("route_topk", cfg, |b| {
            b.arg(&logits_ptr)
                .arg(&bias)
                .arg(&ids)
                .arg(&w)
                .arg(&t)
                .arg(&e)
                .arg(&k)
                .arg(&scoring)
                .arg(&ng)
                .arg(&tg)
                .arg(&renorm)
                .arg(&rsf);
        })
    }

    /// Groups the `pairs` routed pairs of `ws.ids` by expert into `grouping` (`sort_pairs.cu`):
    /// one block up to `2·SORT_CHUNK` pairs, else count / scan / place over `SORT_CHUNK`-pair
    /// chunks.
    fn sort_pairs(
        &self,
        ws: &CudaWorkspace,
        grouping: Grouping,
        pairs: i32,
        experts: i32,
    ) -> Result<()> {
        let st = &self.dev.stream;
        let ids = ptr(&ws.ids, st);
        let Grouping {
            offsets: off,
            sorted,
            active,
            num_active: num,
            ..
        } = grouping;
        let block = |grid: usize, smem: usize| LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: (4 * smem) as u32,
        };
        let e = experts as usize;
        if pairs as usize <= SORT_ONE_BLOCK_MAX {
            return self.launch("sort_pairs", block(1, 33 * e + SLOT_COUNT_INTS), |b| {
                b.arg(&ids)
                    .arg(&pairs)
                    .arg(&experts)
                    .arg(&off)
                    .arg(&sorted)
                    .arg(&active)
                    .arg(&num);
            });
        }
        let chunks = (pairs as usize).div_ceil(SORT_CHUNK);
        let (chunk, nchunks) = (SORT_CHUNK as i32, chunks as i32);
        let counts = ptr(&ws.chunk_counts, st);
        self.launch("count_pairs", block(chunks, 32 * e), |b| {
            b.arg(&ids)
                .arg(&pairs)
                .arg(&experts)
                .arg(&chunk)
                .arg(&counts);
        })?;
        self.launch("scan_pair_counts", block(1, e + SLOT_COUNT_INTS), |b| {
            b.arg(&counts)
                .arg(&nchunks)
                .arg(&experts)
                .arg(&off)
                .arg(&active)
                .arg(&num);
        })?;
        self.launch("place_pairs", block(chunks, 32 * e), |b| {
            b.arg(&ids)
                .arg(&pairs)
                .arg(&experts)
                .arg(&chunk)
                .arg(&counts)
                .arg(&sorted);
        })
    }

    /// The routed pairs' grouping by expert in `ws`, as both GEMMs read it.
    pub(super) fn grouping(&self, ws: &CudaWorkspace) -> Grouping {
        let st = &self.dev.stream;
        Grouping {
            offsets: ptr(&ws.offsets, st),
            sorted: ptr(&ws.sorted, st),
            active: ptr(&ws.active, st),
            num_active: ptr(&ws.num_active, st),
            experts: self.spec.shape.experts as i32,
        }
    }

    /// Split path after routing: groups the pairs of `ws.ids` by expert (`sort_pairs.cu`) and
    /// prepares the GEMM operand from `ws.x`: `ws.a`, or, with `sorted`, GEMM1's rows in sorted
    /// pair order `ws.a_sorted` ([`CudaLayer::gemm1_reads_sorted`]); `ws.xs` for the shared
    /// expert either way.
    pub(super) fn group_device(&self, ws: &CudaWorkspace, sorted: bool) -> Result<()> {
        let st = &self.dev.stream;
        let s = &self.spec;
        let (t, h) = (ws.tokens, s.shape.hidden);
        let p = t * s.routing.top_k;
        self.sort_pairs(ws, self.grouping(ws), p as i32, s.shape.experts as i32)?;
        let (x, a) = (ptr(&ws.x, st), ptr(&ws.a, st));
        let xs = if self.shared.is_some() {
            ptr(&ws.xs, st)
        } else {
            0u64
        };
        let gs = self.gs1.unwrap_or(0.0);
        let hid = h as i32;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            // 256 threads: a few tokens' rows take a few loop trips each, not ~20.
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        if !sorted {
            return self.launch("prepare_input", cfg, |b| {
                b.arg(&x).arg(&a).arg(&xs).arg(&hid).arg(&gs);
            });
        }
        let (srt, rows, a_sorted) = (
            ptr(&ws.sorted, st),
            ptr(&ws.pair_rows, st),
            ptr(&ws.a_sorted, st),
        );
        let n = p as i32;
        let invert = LaunchConfig {
            grid_dim: (p.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("invert_pairs", invert, |b| {
            b.arg(&srt).arg(&rows).arg(&n);
        })?;
        let k = s.routing.top_k as i32;
        self.launch("prepare_input_sorted", cfg, |b| {
            b.arg(&x)
                .arg(&a_sorted)
                .arg(&xs)
                .arg(&rows)
                .arg(&hid)
                .arg(&gs)
                .arg(&k);
        })
    }

    /// The layer's selection rule for the routing kernels.
    pub(super) fn selection(&self) -> Selection {
        let r = &self.spec.routing;
        Selection {
            experts: self.spec.shape.experts as i32,
            top_k: r.top_k as i32,
            scoring: i32::from(r.scoring == Scoring::Sigmoid),
            n_group: r.n_group as i32,
            topk_group: r.topk_group as i32,
            renormalize: i32::from(r.renormalize),
        }
    }

    /// The routing's pointers over `ws` for `source`.
    pub(super) fn route_io(&self, ws: &CudaWorkspace, source: RouteSource) -> Result<RouteIo> {
        let st = &self.dev.stream;
        let (router, logits) = match source {
            RouteSource::Router => (ptr(self.router_weight()?, st), ptr(&ws.logits, st)),
            RouteSource::Logits(l) => (0u64, ptr(l, st)),
            RouteSource::Ids => (0u64, 0u64),
        };
        Ok(RouteIo {
            x: ptr(&ws.x, st),
            router,
            logits,
            bias: self.bias.as_ref().map_or(0u64, |b| ptr(b, st)),
            ids: ptr(&ws.ids, st),
            weights: ptr(&ws.weights, st),
        })
    }

    /// Fused path (`route_small.cu`, one launch): routing from `source`, then what
    /// [`CudaLayer::group_device`] does. The caller checked [`RoutePath::choose`]'s limits.
    pub(super) fn route_small(&self, ws: &CudaWorkspace, source: RouteSource) -> Result<()> {
        let st = &self.dev.stream;
        let s = &self.spec;
        let r = s.routing;
        let (t, e) = (ws.tokens, s.shape.experts);
        let params = RouteSmallParams {
            io: self.route_io(ws, source)?,
            a: ptr(&ws.a, st),
            xs: if self.shared.is_some() {
                ptr(&ws.xs, st)
            } else {
                0u64
            },
            ticket: ptr(&ws.route_ticket, st),
            mode: source.mode(),
            tokens: t as i32,
            hidden: s.shape.hidden as i32,
            select: self.selection(),
            topk_warps: route_topk_warps(t) as i32,
            rsf: r.routed_scaling_factor,
            gs: self.gs1.unwrap_or(0.0),
            ..self.grouping(ws).route_params()
        };
        // One warp per logit when computing them; otherwise the one continuing block only.
        let (grid, selects) = match source {
            RouteSource::Router => ((t * e).div_ceil(router_logits_per_block(t * e)), true),
            RouteSource::Logits(_) => (1, true),
            RouteSource::Ids => (1, false),
        };
        let cfg = LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: route_small_smem(t, e, selects) as u32,
        };
        self.launch("route_small", cfg, |b| {
            b.arg(&params);
        })
    }
}
