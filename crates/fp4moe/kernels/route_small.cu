// Small batches: router logits, top-k, pair sort and input preparation in one launch
// (router_logits → route_topk → sort_pairs → prepare_input of the split path, the same device
// code, so ids, weights, grouping and the GEMM operand are bitwise those of the split path).
//
// Blocks of 1024 threads. mode ROUTE_FROM_ROUTER: grid = ceil(T·E / n) blocks, each computing
// n logits (n = 4 with eight warps each up to 1024 logits, else 32 of one warp), as
// router_logits does; then each block takes a ticket (atomicAdd on a workspace int) and only the block that
// draws gridDim.x - 1, i.e. the last to finish its logits, goes on. It resets the counter to 0,
// so the next launch (CUDA-graph replays included) starts from 0: every launch passes
// pdl_enter() before it touches the counter, i.e. after the previous one has ended. No block ever waits on another, so residency does not matter. ROUTE_FROM_LOGITS (logits
// given, [T, E]) and ROUTE_FROM_IDS (ids and weights given, [T, k]) run one block.
// The continuing block then runs, for one token without expert groups among at most 128
// experts, topk_token_group and sort_pairs_group in its first RS_ONE_TOKEN_THREADS threads;
// for at most SORT_WARP_MAX_PAIRS (32) pairs, top-k and sort_pairs_warp in the first warps;
// either beside prepare_input in the others; beyond, separated by __syncthreads:
//   1. top-k (modes ROUTER/LOGITS): warps 0..topk_warps-1 take tokens t = w, w + topk_warps, ...
//      (routing.cuh), scratch [topk_warps][2·E + 64] floats;
//   2. the pair sort of T·k pairs (sort_pairs.cuh), scratch [32][E] + [E] ints;
//   3. prepare_input of every token (prepare_input.cuh), no scratch: tokens over up to 8 groups of
//      threads.
// Dynamic shared memory: the largest phase's scratch (the phases reuse it). Limits (checked by
// the host): E <= 512, top_k <= 32, T·k <= 4096, topk_warps in 1..16 (the warps beyond
// prepare the input of few-pair batches).
#include "routing.cuh"
#include "sort_pairs.cuh"
#include "prepare_input.cuh"

#define ROUTE_FROM_ROUTER 0
#define ROUTE_FROM_LOGITS 1
#define ROUTE_FROM_IDS 2

// The layout matches the host's `RouteSmallParams` (13 pointers, 10 ints, 2 floats).
struct RouteSmallParams {
    const float* x;          // [T, H]
    const float* router;     // [E, H]; ROUTE_FROM_ROUTER only
    float* logits;           // [T, E]: written (ROUTER), read (ROUTER, LOGITS)
    const float* bias;       // [E] or null
    int* ids;                // [T, k]: written (ROUTER, LOGITS) or read (IDS)
    float* weights;          // [T, k]
    int* offsets;            // [E + 1]
    int* sorted;             // [T·k]
    int* active;             // [E]
    int* num_active;         // [1]
    __nv_bfloat16* a;        // [T, H]
    __nv_bfloat16* xs;       // [T, H] or null (no shared expert)
    int* ticket;             // [1], 0 between launches
    int mode, tokens, hidden, experts, top_k, scoring, n_group, topk_group, renormalize, topk_warps;
    float rsf, gs;
};

// Top-k of every token by top-k warp w (< topk_warps): tokens w, w + topk_warps, ..., in the
// warp's own [2·E + 64]-float scratch.
__device__ __forceinline__ void topk_tokens(const RouteSmallParams& p, int w, float* smem) {
    for (int t = w; t < p.tokens; t += p.topk_warps)
        topk_token(p.logits + (size_t)t * p.experts, p.bias, p.ids + t * p.top_k, p.weights + t * p.top_k,
                   smem + w * (2 * p.experts + 64), p.experts, p.top_k, p.scoring, p.n_group, p.topk_group,
                   p.renormalize, p.rsf);
}

// Input rows t0, t0 + step, ... (prepare_input.cuh) by threads tid of a group of n.
__device__ __forceinline__ void prepare_rows(const RouteSmallParams& p, int t0, int step, int tid, int n) {
    for (int t = t0; t < p.tokens; t += step) {
        size_t row = (size_t)t * p.hidden;
        prepare_row(p.x + row, p.a + row, p.xs ? p.xs + row : nullptr, p.hidden, p.gs, tid, n);
    }
}

// Threads that select and group a lone token (the rest of the block prepares its input).
#define RS_ONE_TOKEN_THREADS 256

// One block per SM stated explicitly: with (1024) alone ptxas capped the kernel at 32 registers
// and spilled once prepare_row went to 4 elements per thread (it used ~55, as now).
extern "C" __global__ void __launch_bounds__(1024, 1) route_small(const RouteSmallParams p) {
    pdl_enter();
    extern __shared__ float smem[];
    const int tokens = p.tokens, experts = p.experts;
    const int w = threadIdx.x >> 5;
    if (p.mode == ROUTE_FROM_ROUTER) {
        // 32 warps, a logit per router_slices(T·E) of them (routing.cuh), as router_logits does.
        router_logits_block(p.x, p.router, p.logits, tokens * experts, experts, p.hidden, smem, blockIdx.x, 32);
        // Release: this block's logits reach L2 before its ticket is taken.
        __threadfence();
        __syncthreads();
        int ticket = 0;
        if (threadIdx.x == 0) {
            ticket = atomicAdd(p.ticket, 1);
            __threadfence();  // acquire: the other blocks' logits are read after their tickets
        }
        if (!__syncthreads_or(threadIdx.x == 0 && ticket == (int)gridDim.x - 1)) return;
        if (threadIdx.x == 0) *p.ticket = 0;  // every block has drawn: ready for the next launch
    }
    if (tokens == 1 && p.mode != ROUTE_FROM_IDS && p.n_group <= 1 && 2 * experts <= RS_ONE_TOKEN_THREADS) {
        // One token without groups: the first RS_ONE_TOKEN_THREADS threads select and group it
        // (topk_token_group, sort_pairs_group: the warp versions' outputs in a shorter chain,
        // named barrier 1 among them) while the others prepare its input. Up to 128 experts,
        // where it was measured (two threads rank each expert; with more experts each thread
        // would sweep every key once per expert it ranks: not measured, the warp stays).
        if (threadIdx.x < RS_ONE_TOKEN_THREADS) {
            topk_token_group(p.logits, p.bias, p.ids, p.weights, smem, experts, p.top_k, p.scoring, p.renormalize,
                             p.rsf, RS_ONE_TOKEN_THREADS, 1);
            sort_pairs_group(p.ids, p.top_k, experts, p.offsets, p.sorted, p.active, p.num_active,
                             RS_ONE_TOKEN_THREADS);
        } else {
            prepare_rows(p, 0, 1, threadIdx.x - RS_ONE_TOKEN_THREADS, blockDim.x - RS_ONE_TOKEN_THREADS);
        }
        return;
    }
    if (tokens * p.top_k <= SORT_WARP_MAX_PAIRS) {
        // A few pairs: warp 0 groups them right after the top-k warps are done (named barrier 1
        // among those warps), while the other warps (topk_warps <= 16 of 32) prepare the input.
        if (w < p.topk_warps) {
            if (p.mode != ROUTE_FROM_IDS) {
                topk_tokens(p, w, smem);
                if (p.topk_warps > 1) group_sync(1, 32 * p.topk_warps);
            }
            if (w == 0)
                sort_pairs_warp(p.ids, tokens * p.top_k, experts, p.offsets, p.sorted, p.active, p.num_active);
        } else {
            const int first = 32 * p.topk_warps;
            prepare_rows(p, 0, 1, threadIdx.x - first, blockDim.x - first);
        }
        return;
    }
    if (p.mode != ROUTE_FROM_IDS) {
        if (w < p.topk_warps) {
            topk_tokens(p, w, smem);
        }
        __syncthreads();  // ids are in global memory for the sort, the scratch is free
    }
    sort_pairs_block(p.ids, tokens * p.top_k, experts, p.offsets, p.sorted, p.active, p.num_active,
                     reinterpret_cast<int*>(smem));
    // Power-of-two thread groups (1024 / groups threads, warp-aligned), at most 8, one token each.
    int groups = 1;
    while (groups < tokens && groups < 8) groups <<= 1;
    const int size = blockDim.x / groups, g = threadIdx.x / size;
    prepare_rows(p, g, groups, threadIdx.x - g * size, size);
}
