// The one-token layer in one launch: router logits, top-k, grouping, input preparation, GEMM1
// (+ activation, W4A4 QDQ), GEMM2 (+ router weight) and the combine, separated by per-logit
// flags and one grid-wide barrier instead of four kernel boundaries.
//
//   y = Σ_j bf16(w_j · W2_{e_j} · act(W13_{e_j} · a)),   j < k in slot order, summed in f32
//   (gemm_common.cuh's rounding and combine.cu's order)
//
// Why (KERNEL_NOTES, runs 34, 64, 75): at one token the split launch chain (route_small, two
// streaming GEMMs, combine) took 38 µs for 8 µs of weight bytes: the launches alone 6.8 µs,
// and each GEMM a latency chain over 0.66–0.95 of a wave that requests its weights only once
// it runs. Here every block requests its GEMM1 weights (into shared memory) as soon as the
// routing is known, and its GEMM2 weights while it waits at the second barrier; GEMM2's
// weights can also be prefetched into L2 during GEMM1 (`prefetch`, off by default: it competed
// with GEMM1's bytes, runs 83–86).
//
// Every unit is computed by the streaming kernels' own per-warp code (expert_stream.cuh) with
// the K split the host chose for them (rb1 / rb2 row groups per virtual block), so the bits are
// those of the split path (logits: the same per-logit slices as route_small; the operand row:
// prepare_input.cuh; top-k and grouping: routing.cuh, sort_pairs.cuh; the combine: a sum from
// 0 in slot order).
//
// Grid: G blocks of OT_TEAMS_* teams of STREAM_WARPS warps, all resident at once (the
// host sizes G from the occupancy it queried, and launches it without programmatic
// serialization, after the previous work on the stream), which the flags and the barrier need.
//   0. Router mode: logit e of the token by block e mod G (router_logits_block, one group of
//      eight warps), published through its flag; every block prepares the token's GEMM1 operand
//      row in shared memory and gathers the logits from their flags.
//   1. Every block runs top-k and the grouping from the same logits (same code: all agree) into
//      shared memory; block 0 writes ids, weights and the grouping out. GEMM1's virtual blocks
//      v = (slot, x) of the streaming grid (x-fastest), block b taking v = b + G·i, i < vbpb1,
//      team i % teams computing them: all copies first (sm_90: bulk copies onto one mbarrier per
//      virtual block; else one cp.async commit group per virtual block), then the units as their
//      copies land. Then GEMM2's copies into the freed shared memory, between the arrival at and
//      the wait for the barrier (GEMM1's g rows written).
//   2. GEMM2's operand rows (k of them) staged; its virtual blocks as in 1; per column block
//      x a ticket: the last of the k slots' virtual blocks to finish adds the pairs' rows into y.
// The tickets and the logit flags (`sync`) are back at 0 after every launch, and the barrier's
// arrival count at a multiple of G (graph replays).
//
// Shared memory (byte offsets from the host): header (OT_HDR_BYTES: ids, weights, sorted pairs,
// active experts, counts, logit slices, offsets [E + 1], the virtual blocks' mbarriers) | operand rows at smem_act (GEMM1: one
// row [kp1 + 8] bf16; GEMM2: k rows [kp2 + 8]) | split-K partials at smem_red (per team) |
// virtual-block regions at smem_w (128-byte aligned; region i: rb·U units' data then scales, expert_stream.cuh),
// which top-k's scratch ([2E + 64] floats) uses before any copy lands there.
#include "expert_stream.cuh"
#include "routing.cuh"
#include "sort_pairs.cuh"
#include "prepare_input.cuh"

// Teams of STREAM_WARPS warps per block, each computing one virtual block at a time: as many as
// the registers allow one block per SM (plain units fit 64 registers a thread, 1024 threads;
// gated ones need 80, 768 threads).
#define OT_TEAMS_PLAIN 4
#define OT_TEAMS_GATED 3
// Header layout (ints).
#define OT_IDS 0
#define OT_WEIGHTS 32
#define OT_SORTED 64
#define OT_ACTIVE 96
#define OT_NUM 128
#define OT_FLAG 130     // one per team (at most 8)
#define OT_PART 138     // one per warp (at most 32)
#define OT_OFFSETS 170  // E + 1 <= 513 ints
#define OT_BARS_BYTE 2736  // 2 x 32 mbarriers (GEMM1's, GEMM2's virtual blocks; sm_90)
#define OT_HDR_BYTES 3248
// Commit groups one thread may wait on (cp_async_wait_upto): virtual blocks per team.
#define OT_MAX_GROUPS 8
// Phase timestamps a traced launch records per block: entry, logits and operand row done,
// logits gathered, top-k and grouping done, GEMM1's copies issued, GEMM1 computed, GEMM2's
// copies issued, barrier 2 passed and GEMM2's operand staged, exit.
#define OT_TRACE_POINTS 9

// The layout matches the host's `OneTokenParams`.
struct OneTokenParams {
    GemmParams g1;         // GEMM1; its grouping pointers are where block 0 writes the grouping
    GemmParams g2;         // GEMM2 (o_out: the pairs' rows the combine adds)
    const float* x;        // [H]
    const float* router;   // [E, H]; null: the logits are given
    float* logits;         // [E]: written (router) or read
    const float* bias;     // [E] or null
    int* ids;              // [k]
    float* weights;        // [k]
    float* y;              // [H]
    unsigned* sync;        // [OT_LOGIT_FLAGS(column blocks) + 2E]: arrival count (u64), combine tickets, logit flags (u64)
    int experts, top_k, scoring, n_group, topk_group, renormalize;
    float rsf, gs;         // gs: W4A4 input global scale (0: W4A16)
    int rb1, rb2;          // row groups per virtual block of GEMM1 / GEMM2 (their K split)
    int vbpb1, vbpb2;      // virtual blocks per block (ceil(total / G))
    int smem_act, smem_red, smem_w;
    int prefetch;          // GEMM2's weights into L2 during GEMM1: 0 no, 1 early, 2 late (prefetch_l2)
    unsigned long long* trace;  // null, or [G][OT_TRACE_POINTS] %globaltimer ns per block (diagnostic)
};

// A barrier wait longer than this means some block never became resident (another stream's
// work holding SMs the host counted): the kernel traps, a sticky error that leaves the CUDA
// context unusable, instead of hanging forever. A legitimate wait is a few microseconds.
#define OT_BARRIER_TIMEOUT_NS 2000000000ull

// Thread 0's timestamp of phase point i, when tracing.
__device__ __forceinline__ void trace_point(unsigned long long* trace, int i) {
    if (trace && threadIdx.x == 0) trace[blockIdx.x * OT_TRACE_POINTS + i] = global_ns();
}

// Relaxed gpu-scope u64 accesses (the barrier's count, the logit flags).
__device__ __forceinline__ void st_relaxed_u64(unsigned long long* p, unsigned long long v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Grid barrier in two halves, so a block can issue GEMM2's copies between them: a monotonic
// u64 count of block arrivals at sync[OT_COUNT] (never reset; every launch adds G, so launch n
// finds n·G at entry: G is the device's SM count on every launch, see one_token_shape). Before
// its own arrival a block reads some value in [n·G, n·G + G − 1] and waits for the next
// multiple of G. The arrival is a reduction (no round trip): thread 32
// fences the block's writes (after the block barrier, as cooperative groups' grid sync does)
// and adds 1, while thread 0 goes on to issue the copies and then polls. A count and a
// generation flipped by the last block (runs 86–90) took a load, an atomic's round trip and the
// last block's release before any block saw the barrier pass. The acquire that ends the wait
// makes the other blocks' writes visible.
#define OT_COUNT 0
#define OT_TICKETS 64  // combine tickets, one per GEMM2 column block
__device__ __forceinline__ unsigned long long grid_arrive(unsigned* sync) {
    unsigned long long* count = reinterpret_cast<unsigned long long*>(sync + OT_COUNT);
    unsigned long long target = 0;
    if (threadIdx.x == 0)  // before the block's arrival, which follows the block barrier
        target = (ld_relaxed_u64(count) / gridDim.x + 1) * gridDim.x;
    __syncthreads();
    if (threadIdx.x == 32) {
        __threadfence();
        atomicAdd(count, 1ull);  // result unused: a reduction
    }
    return target;
}
__device__ __forceinline__ void grid_wait(const unsigned* sync, unsigned long long target) {
    if (threadIdx.x == 0) {
        const unsigned long long* count = reinterpret_cast<const unsigned long long*>(sync + OT_COUNT);
        const unsigned long long t0 = global_ns();
        for (;;) {
            unsigned long long c;
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(count) : "memory");
            if (c >= target) break;
            if (global_ns() - t0 > OT_BARRIER_TIMEOUT_NS) __trap();
        }
    }
    __syncthreads();
}

// Router mode's logits reach every block through flags instead of a grid barrier: sync words
// from OT_LOGIT_FLAGS(column blocks) on hold one u64 per expert, (1 << 32) | the logit's bits
// once its block has computed it this launch, 0 otherwise (block 0 clears them after barrier 2,
// when every block has read them). A block's warp 0 polls them until each is set: one L2 round
// trip after the last logit is written, where the barrier took an atomic, a fence and a release
// before the polls, and top-k then read the logits again (runs 86–90: barrier 1 passed ~1.8 µs
// after the logits). Relaxed accesses: the logit's bits travel in the flag itself.
#define OT_LOGIT_FLAGS(col_blocks) ((OT_TICKETS + (col_blocks) + 1) & ~1)

// Warp 0: the `experts` logits from their flags into `slog` (shared memory), eight per lane in
// flight at a time; traps after OT_BARRIER_TIMEOUT_NS like the barrier.
__device__ __forceinline__ void gather_logits(const unsigned long long* flags, float* slog, int experts) {
    const int lane = threadIdx.x & 31;
    const unsigned long long t0 = global_ns();
    for (int e0 = 0; e0 < experts; e0 += 32 * 8) {
        unsigned pending = 0;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (e0 + lane + 32 * j < experts) pending |= 1u << j;
        while (pending) {
            unsigned long long v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = (pending >> j) & 1u ? ld_relaxed_u64(flags + e0 + lane + 32 * j) : 0ull;
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (v[j] >> 32) {
                    slog[e0 + lane + 32 * j] = __uint_as_float((unsigned)v[j]);
                    pending &= ~(1u << j);
                }
            if (pending && global_ns() - t0 > OT_BARRIER_TIMEOUT_NS) __trap();
        }
    }
    __syncwarp();
}

// sm_90: the weights come through the bulk copy engine (one copy per unit's data and one per
// its scales, whole K, completing on the virtual block's mbarrier): 4–6 µs faster per layer
// than 16-byte cp.async per lane (runs 84–85), which the other architectures keep.
#if __CUDA_ARCH__ >= 900
#define OT_BULK 1
#else
#define OT_BULK 0
#endif
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// The 256 threads of team h (named barrier 1 + h).
__device__ __forceinline__ void team_sync(int h) {
    group_sync(1 + h, STREAM_WARPS * 32);
}

// A virtual block of a GEMM: slot (active expert index) and column block x of the streaming
// grid, x fastest.
struct VBlock {
    int slot, x;
};
__device__ __forceinline__ VBlock vblock_at(int v, int nvx) { return VBlock{v / nvx, v - (v / nvx) * nvx}; }

// This team's copies of its virtual blocks of GEMM p (one commit group each, also for a
// virtual block past the grid, so every thread counts the same groups); returns the groups.
template <bool GATED>
__device__ __forceinline__ int issue_copies(const GemmParams& p, int rb, int vbpb, int slots, const int* s_active,
                                            u8* sw, u64* bars) {
    constexpr int U = GATED ? 2 : 1;
#if OT_BULK
    // Thread 0: virtual block i's units onto bars[i] (0 bytes past the grid: the phase completes).
    if (threadIdx.x == 0) {
        fence_proxy_async();  // the regions' earlier generic accesses before the async writes
        const int kg = p.kg, nvx = (p.rg_out + rb - 1) / rb, total = nvx * slots;
        const size_t region = (size_t)rb * U * kg * 576;
        for (int i = 0; i < vbpb; i++) {
            const int v = blockIdx.x + gridDim.x * i;
            const VBlock b = vblock_at(v, nvx);
            const int units = v < total ? min(rb, p.rg_out - b.x * rb) : 0;
            mbar_expect_tx(bars + i, (u32)(units * U * kg * 576));
            u8* sd = sw + i * region;
            u8* ss = sd + (size_t)rb * U * kg * 512;
            for (int rgl = 0; rgl < units; rgl++)
#pragma unroll
                for (int u = 0; u < U; u++) {
                    const size_t wr = (size_t)s_active[b.slot] * p.rg_w + b.x * rb + rgl + u * p.rg_out;
                    bulk_copy(sd + (size_t)(rgl * U + u) * kg * 512, p.wdata + wr * kg * 512, kg * 512, bars + i);
                    bulk_copy(ss + (size_t)(rgl * U + u) * kg * 64, p.wscales + wr * kg * 64, kg * 64, bars + i);
                }
        }
    }
    return 0;
#else
    const int team = threadIdx.x / (STREAM_WARPS * 32), hw = (threadIdx.x >> 5) % STREAM_WARPS;
    const int lane = threadIdx.x & 31, ksplit = STREAM_WARPS / rb, rgl = hw % rb, ks = hw / rb;
    const int kg = p.kg, nvx = (p.rg_out + rb - 1) / rb, total = nvx * slots;
    const size_t region = (size_t)rb * U * kg * 576;
    int groups = 0;
    const int teams = blockDim.x / (STREAM_WARPS * 32);
    for (int i = team; i < vbpb; i += teams) {
        const int v = blockIdx.x + gridDim.x * i;
        if (v < total) {
            const VBlock b = vblock_at(v, nvx);
            const int rg = b.x * rb + rgl;
            if (rg < p.rg_out) {
                u8* sd = sw + i * region;
                stream_copy_slice<GATED>(p, s_active[b.slot], rg, rgl, ks * kg / ksplit, (ks + 1) * kg / ksplit, sd,
                                         sd + (size_t)rb * U * kg * 512, lane);
            }
        }
        cp_async_commit();
        groups++;
    }
    return groups;
#endif
}

// GEMM2's weight rows of this block's virtual blocks into L2 by threads tid < nthreads (a hint:
// their copies after GEMM1 then hit L2 instead of DRAM). `prefetch` 1: issued with GEMM1's
// copies (both GEMMs' bytes requested at once: slower, runs 83–85); 2: once the block's last
// GEMM1 virtual block has landed (DRAM otherwise idles while the block computes).
__device__ __forceinline__ void prefetch_l2(const GemmParams& p, int rb, int vbpb, int slots, const int* s_active,
                                            int tid, int nthreads) {
    const int kg = p.kg, nvx = (p.rg_out + rb - 1) / rb, total = nvx * slots;
    for (int i = 0; i < vbpb; i++) {
        const int v = blockIdx.x + gridDim.x * i;
        if (v >= total) break;
        const VBlock b = vblock_at(v, nvx);
        const size_t wr = (size_t)s_active[b.slot] * p.rg_w + b.x * rb;
        const size_t rows = min(rb, p.rg_out - b.x * rb);
        const u8* d = p.wdata + wr * kg * 512;
        const u8* s = p.wscales + wr * kg * 64;
#if OT_BULK
        // One thread, one bulk prefetch per span (a line per thread took ~2 µs to issue, run 84).
        if (tid == 0) {
            bulk_prefetch_l2(d, (u32)(rows * kg * 512));
            bulk_prefetch_l2(s, (u32)(rows * kg * 64));
        }
#else
        for (size_t o = tid * 128; o < rows * kg * 512; o += nthreads * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(d + o));
        for (size_t o = tid * 128; o < rows * kg * 64; o += nthreads * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(s + o));
#endif
    }
}

// This team's virtual blocks of GEMM STAGE, units computed as their copies land (`groups`:
// what issue_copies returned). B operand: row 0 of `sact` (GEMM1, the token) or row
// offsets[e] (GEMM2, the pair's g row). STAGE 2: per column block, the last slot to finish
// adds the pairs' rows into y.
template <int STAGE, bool GATED>
__device__ __forceinline__ void compute_units(const OneTokenParams& tp, const GemmParams& p, int rb, int vbpb,
                                              int slots, int groups, const int* s_active, const int* s_offsets,
                                              const __nv_bfloat16* sact, int stride, float* red_all, u8* sw,
                                              int* s_flag, u64* bars) {
    constexpr int U = GATED ? 2 : 1;
    const int team = threadIdx.x / (STREAM_WARPS * 32), hw = (threadIdx.x >> 5) % STREAM_WARPS;
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int ksplit = STREAM_WARPS / rb, rgl = hw % rb, ks = hw / rb;
    const int kg = p.kg, nvx = (p.rg_out + rb - 1) / rb, total = nvx * slots;
    const size_t region = (size_t)rb * U * kg * 576;
    float* red = red_all + team * (STREAM_WARPS - 1) * 32 * 4 * U;  // (ksplit − 1)·rb <= 7 slots
    int done = 0;
    const int teams = blockDim.x / (STREAM_WARPS * 32);
    for (int i = team; i < vbpb; i += teams, done++) {
        const int v = blockIdx.x + gridDim.x * i;
        if (v >= total) break;  // the same for the whole team
        const VBlock b = vblock_at(v, nvx);
        const int e = s_active[b.slot], rg = b.x * rb + rgl;
        const bool active_warp = rg < p.rg_out;
        const int base = s_offsets[e];  // one pair per expert
        float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}}, accu[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
#if OT_BULK
        mbar_wait<false>(bars + i, 0);  // each barrier completes one phase per launch
#else
        cp_async_wait_upto(groups - 1 - done);
        __syncwarp();
#endif
        if (STAGE == 1 && tp.prefetch == 2 && (i == vbpb - 1 || blockIdx.x + gridDim.x * (i + 1) >= total))
            prefetch_l2(tp.g2, tp.rb2, tp.vbpb2, slots, s_active, threadIdx.x & (STREAM_WARPS * 32 - 1),
                        STREAM_WARPS * 32);
        if (active_warp) {
            const u8* sd = sw + i * region;
            const u8* wd0 = sd + (size_t)(rgl * U) * kg * 512 + lane * 16;
            const u8* ws0 = sd + (size_t)rb * U * kg * 512 + (size_t)(rgl * U) * kg * 64 + g * 8;
            const __nv_bfloat16* brow = sact + (STAGE == 1 ? 0 : base) * stride + 2 * q;
            stream_slice_mma<GATED>(wd0, ws0, kg, brow, g == 0, ks * kg / ksplit, (ks + 1) * kg / ksplit, acc[0],
                                    accu[0]);
        }
        stream_park<GATED>(red, ks, rb, rgl, lane, acc[0], accu[0]);
        team_sync(team);
        if (ks == 0 && active_warp) {
            stream_sum_slices<GATED>(red, ksplit, rb, rgl, lane, acc[0], accu[0]);
            if (STAGE == 1)
                store_gemm1<1, GATED>(p, acc, accu, e, base, 1, 0, rg, 1, NVFP4_DEQ_UNSCALE);
            else
                store_gemm2<1>(p, acc, e, base, 1, 0, rg, 1, NVFP4_DEQ_UNSCALE);
            if (STAGE == 2) __threadfence();  // the pair's rows before this slot's ticket
        }
        if (STAGE == 2) {
            const int hid = p.rg_out * 16, r0 = b.x * rb * 16, r1 = min(r0 + rb * 16, hid);
            team_sync(team);
            if (hw == 0 && lane == 0) {
                const int last = atomicAdd(tp.sync + OT_TICKETS + b.x, 1u) == (unsigned)(slots - 1);
                if (last) {
                    tp.sync[OT_TICKETS + b.x] = 0;  // every slot has drawn: ready for the next launch
                    __threadfence();       // acquire: the other slots' rows are read after their tickets
                }
                s_flag[team] = last;
            }
            team_sync(team);
            if (s_flag[team]) {
                const int t = threadIdx.x - team * STREAM_WARPS * 32;
                for (int r = r0 + t; r < r1; r += STREAM_WARPS * 32) {
                    float acc_y = 0.0f;
                    for (int j = 0; j < tp.top_k; j++) acc_y += __bfloat162float(__ldcg(p.o_out + (size_t)j * hid + r));
                    tp.y[r] = acc_y;
                }
            }
        }
        team_sync(team);  // `red` and s_flag are reused by this team's next virtual block
    }
}

template <bool GATED>
__device__ __forceinline__ void one_token(const OneTokenParams& p) {
    extern __shared__ __align__(16) unsigned char smem[];
    int* hdr = reinterpret_cast<int*>(smem);
    int* s_ids = hdr + OT_IDS;
    float* s_w = reinterpret_cast<float*>(hdr + OT_WEIGHTS);
    int* s_sorted = hdr + OT_SORTED;
    int* s_active = hdr + OT_ACTIVE;
    int* s_num = hdr + OT_NUM;
    int* s_flag = hdr + OT_FLAG;
    float* part = reinterpret_cast<float*>(hdr + OT_PART);
    int* s_offsets = hdr + OT_OFFSETS;
    __nv_bfloat16* sact = reinterpret_cast<__nv_bfloat16*>(smem + p.smem_act);
    float* red = reinterpret_cast<float*>(smem + p.smem_red);
    u8* sw = smem + p.smem_w;
    u64* bars = reinterpret_cast<u64*>(smem + OT_BARS_BYTE);
    const int warp = threadIdx.x >> 5;
    const int experts = p.experts, k = p.top_k, hidden = p.g1.k;
    trace_point(p.trace, 0);
#if OT_BULK
    if (threadIdx.x == 0) {
        for (int i = 0; i < 64; i++) mbar_init(bars + i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#endif

    // 0. Logits (router mode) and the token's GEMM1 operand row, zero over the k padding.
    // One logit per block at a time (router_logits_block with one group: route_small's
    // arithmetic), so the logits spread over the blocks (four per block kept 32 blocks busy
    // until 3.1 µs, run 85's trace; one per block: 2.8, run 86).
    // Top-k's scratch (2E + 64 floats), then the gathered logits and the bias, in sw.
    float* scratch = reinterpret_cast<float*>(sw);
    float* slog = scratch + 2 * experts + 64;
    float* sbias = slog + experts;
    unsigned long long* flags =
        reinterpret_cast<unsigned long long*>(p.sync + OT_LOGIT_FLAGS(p.g2.rg_out));
    // The bias is requested now and stored after the logits, so its DRAM latency hides behind them.
    const bool bias_smem = p.bias && experts <= (int)blockDim.x;
    const float bias_e = bias_smem && (int)threadIdx.x < experts ? p.bias[threadIdx.x] : 0.0f;
    if (p.router) {
        for (int e = blockIdx.x; e < experts; e += gridDim.x) {
            const float v = router_logits_block(p.x, p.router, p.logits, experts, experts, hidden, part, e, 1);
            // One group: the logit's writer is thread 0 (warp 0's lane 0).
            if (threadIdx.x == 0) st_relaxed_u64(flags + e, (1ull << 32) | __float_as_uint(v));
            __syncthreads();  // `part` is rewritten by the next logit
        }
    }
    prepare_row(p.x, sact, nullptr, hidden, p.gs, threadIdx.x, blockDim.x);
    for (int c = hidden + threadIdx.x; c < p.g1.kg * 64; c += blockDim.x) sact[c] = __float2bfloat16_rn(0.0f);
    if (bias_smem && (int)threadIdx.x < experts) sbias[threadIdx.x] = bias_e;
    __syncthreads();
    trace_point(p.trace, 1);
    if (p.router && warp == 0) gather_logits(flags, slog, experts);
    trace_point(p.trace, 2);

    // 1. Routing, the same in every block.
    if (warp == 0) {
        topk_token<false>(p.router ? slog : p.logits, bias_smem ? sbias : p.bias, s_ids, s_w, scratch, experts, k,
                          p.scoring, p.n_group, p.topk_group, p.renormalize, p.rsf);
        sort_pairs_warp(s_ids, k, experts, s_offsets, s_sorted, s_active, s_num);
#if OT_BULK
        fence_proxy_async();  // the top-k scratch in sw before the bulk copies overwrite it
#endif
    }
    __syncthreads();
    trace_point(p.trace, 3);
    const int slots = *s_num;
    if (blockIdx.x == 0) {
        // The routing and grouping outputs of the split path (the workspace's buffers).
        const int t = threadIdx.x;
        if (t < k) {
            p.ids[t] = s_ids[t];
            p.weights[t] = s_w[t];
            const_cast<int*>(p.g1.sorted)[t] = s_sorted[t];
        }
        if (t < slots) const_cast<int*>(p.g1.active)[t] = s_active[t];
        if (t == 0) *const_cast<int*>(p.g1.num_active) = slots;
        for (int x = t; x <= experts; x += blockDim.x) const_cast<int*>(p.g1.offsets)[x] = s_offsets[x];
    }
    // Top-k's scratch in sw is free (the __syncthreads above): the copies may land there.
    const int groups1 = issue_copies<GATED>(p.g1, p.rb1, p.vbpb1, slots, s_active, sw, bars);
    if (p.prefetch == 1) prefetch_l2(p.g2, p.rb2, p.vbpb2, slots, s_active, threadIdx.x, blockDim.x);
    trace_point(p.trace, 4);
    // GEMM2's operand rows are read by sorted position, where store_gemm2 finds the pair.
    GemmParams g2 = p.g2;
    g2.sorted = s_sorted;
    g2.topk_w = s_w;
    const int stride1 = p.g1.kg * 64 + 8;
    compute_units<1, GATED>(p, p.g1, p.rb1, p.vbpb1, slots, groups1, s_active, s_offsets, sact, stride1, red, sw,
                            s_flag, bars);
    __syncthreads();  // every region read: GEMM2's copies may overwrite them
    trace_point(p.trace, 5);
    // GEMM1's g rows are published at the arrival; GEMM2's weight copies run during the wait.
    const unsigned long long target = grid_arrive(p.sync);
    const int groups2 = issue_copies<false>(g2, p.rb2, p.vbpb2, slots, s_active, sw, bars + 32);
    trace_point(p.trace, 6);
    grid_wait(p.sync, target);
    if (p.router && blockIdx.x == 0)  // every block has read them (before its arrival)
        for (int e = threadIdx.x; e < experts; e += blockDim.x) st_relaxed_u64(flags + e, 0ull);

    // 2. GEMM2's operand: the k pairs' g rows (sorted order), zero over the k padding.
    const int kp2 = p.g2.kg * 64, stride2 = kp2 + 8, inter = p.g2.k;
    // Two 16-byte pieces per thread per pass, both loads before either store: one L2 round
    // trip for Nemotron's 6 x 232 pieces.
    {
        const int c8n = kp2 / 8, total = k * c8n;
        for (int i = threadIdx.x; i < total; i += 2 * blockDim.x) {
            const int j = i + blockDim.x;
            const int r0 = i / c8n, c0 = i - r0 * c8n, r1 = j / c8n, c1 = j - r1 * c8n;
            uint4 v0 = make_uint4(0, 0, 0, 0), v1 = make_uint4(0, 0, 0, 0);
            if (c0 * 8 < inter) v0 = __ldcg(reinterpret_cast<const uint4*>(p.g1.g_out + (size_t)r0 * inter + c0 * 8));
            if (j < total && c1 * 8 < inter)
                v1 = __ldcg(reinterpret_cast<const uint4*>(p.g1.g_out + (size_t)r1 * inter + c1 * 8));
            *reinterpret_cast<uint4*>(sact + r0 * stride2 + c0 * 8) = v0;
            if (j < total) *reinterpret_cast<uint4*>(sact + r1 * stride2 + c1 * 8) = v1;
        }
    }
    __syncthreads();
    trace_point(p.trace, 7);
    compute_units<2, false>(p, g2, p.rb2, p.vbpb2, slots, groups2, s_active, s_offsets, sact, stride2, red, sw,
                            s_flag, bars + 32);
    cp_async_wait<0>();
    __syncthreads();
    trace_point(p.trace, 8);
}

// The host launches OT_TEAMS_* · STREAM_WARPS · 32 threads.
extern "C" __global__ void __launch_bounds__(OT_TEAMS_PLAIN * STREAM_WARPS * 32, 1) one_token_plain(const OneTokenParams p) {
    one_token<false>(p);
}
extern "C" __global__ void __launch_bounds__(OT_TEAMS_GATED * STREAM_WARPS * 32, 1) one_token_gated(const OneTokenParams p) {
    one_token<true>(p);
}
