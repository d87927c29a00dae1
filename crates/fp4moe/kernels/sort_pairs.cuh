// Pair-sort device code shared by sort_pairs.cu and route_small.cu (the same instructions in
// both launch paths: the same grouping).
//
// Pair p = t·k + j routed to expert ids[p]. Output: offsets[E+1] (exclusive prefix of counts),
// sorted[offsets[e] + r] = the r-th pair of expert e in increasing p, active[0..n) the experts
// with at least one pair, those needing most 8-token passes first (ties in increasing id;
// `slot_key`), num_active[0] = n. A 1024-thread block splits its pairs over its 32 warps; a
// per-warp histogram (int [32][E] in shared memory, E <= 512) and match_any ranks place pairs
// stably with no atomics. Up to 1024 pairs `sort_pairs_few` gives the same outputs with a pair
// per thread and no serial section (session 43); the chunked kernels of sort_pairs.cu take
// batches beyond one block.
#pragma once
#include "common.cuh"

// ACTIVE_BY_COUNT 0 (a timing knob): active experts in increasing id, the order before session 35.
// (1: by their 8-token passes, `slot_key`.)
#ifndef ACTIVE_BY_COUNT
#define ACTIVE_BY_COUNT 1
#endif

// The order of the active experts, i.e. of the decode GEMMs' grid rows (blockIdx.y), which the
// hardware dispatches roughly in order: by decreasing passes of an 8-token tile over the
// expert's pairs (⌈count / 8⌉), ties in increasing id. An expert with more tokens than a
// block's token tile makes its blocks loop over its weights again; dispatched first, those
// longer blocks overlap the later waves instead of ending the kernel's last one
// (longest-processing-time-first; KERNEL_NOTES session 35, run 150: −1.0 to −3.8 % where the
// deep one-subtile kernels make second passes). Passes, not counts: where every expert fits
// one pass the order stays by id (ordering by count was 0.6–0.9 % slower at 16–32 tokens on
// Nemotron, run 150). The key is passes·512 + (511 − e) (e < MAX_EXPERTS = 512); every
// grouping (block, chunked, warp) orders by it. Passes from SLOT_PASS_CAP up tie (248 tokens
// and more: ordered by id among themselves).
#define SLOT_PASS 8  // tokens per pass: the one-subtile decode kernels' token tile
#define SLOT_PASS_CAP 31
__device__ __forceinline__ int slot_passes(int count) {
    return ACTIVE_BY_COUNT ? min((count + SLOT_PASS - 1) / SLOT_PASS, SLOT_PASS_CAP) : 0;
}
__device__ __forceinline__ int slot_key(int count, int e) { return slot_passes(count) * 512 + (511 - e); }

// Shared ints the expert ordering uses past the block sort's 33·E (cuda::route_plan::
// SLOT_COUNT_INTS): `active_by_passes`' counts [MAX_EXPERTS / 32 chunks][SLOT_PASS_CAP + 1
// passes], or `sort_pairs_few`'s pass masks (as many), 16 warp totals and 33 pass sums.
#define SLOT_COUNT_INTS 576

// Exclusive scan of v[0..n) in place by one warp; returns the total.
__device__ int warp_exclusive_scan(int* v, int n) {
    int lane = threadIdx.x & 31;
    int per = (n + 31) / 32;
    int lo = min(lane * per, n), hi = min(lo + per, n);
    int local = 0;
    for (int i = lo; i < hi; i++) local += v[i];
    const int incl = warp_inclusive_sum(local);
    int run = incl - local;
    for (int i = lo; i < hi; i++) {
        int c = v[i];
        v[i] = run;
        run += c;
    }
    return __shfl_sync(FULL_MASK, incl, 31);
}

// Per-warp histogram of pairs [lo, hi) (warp w takes the w-th of 32 equal slices) into
// hist[w·E + e], which the caller zeroed.
__device__ void warp_histograms(const int* ids, int lo, int hi, int experts, int* hist) {
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int chunk = (hi - lo + 31) / 32;
    int wlo = min(lo + w * chunk, hi), whi = min(wlo + chunk, hi);
    for (int base = wlo; base < whi; base += 32) {
        int p = base + lane;
        bool valid = p < whi;
        int e = valid ? ids[p] : -1 - lane;  // invalid lanes never match anyone
        u32 peers = __match_any_sync(FULL_MASK, e);
        if (valid && lane == __ffs(peers) - 1) hist[w * experts + e] += __popc(peers);
        __syncwarp();
    }
}

// hist[w·E + e]: counts → the position of warp w's first pair of expert e, counting from
// start[e]. Needs a __syncthreads before and after.
__device__ void warp_bases(const int* start, int experts, int* hist) {
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int run = start[e];
        for (int v = 0; v < 32; v++) {
            int c = hist[v * experts + e];
            hist[v * experts + e] = run;
            run += c;
        }
    }
}

// sorted[position] = p for the pairs [lo, hi), warp slices as in warp_histograms, hist = bases.
__device__ void place(const int* ids, int lo, int hi, int experts, int* hist, int* sorted) {
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int chunk = (hi - lo + 31) / 32;
    int wlo = min(lo + w * chunk, hi), whi = min(wlo + chunk, hi);
    for (int base = wlo; base < whi; base += 32) {
        int p = base + lane;
        bool valid = p < whi;
        int e = valid ? ids[p] : -1 - lane;
        u32 peers = __match_any_sync(FULL_MASK, e);
        if (valid) {
            int rank = __popc(peers & ((1u << lane) - 1));
            sorted[hist[w * experts + e] + rank] = p;
        }
        __syncwarp();
        if (valid && lane == __ffs(peers) - 1) hist[w * experts + e] += __popc(peers);
        __syncwarp();
    }
}

// active[r] = the active experts (a pair or more: offsets complete, after a __syncthreads) in
// `slot_key` order, num_active[0] = their number, by a counting sort over the passes: an
// expert's slot is the number of active experts with more passes, plus those with as many in
// lower 32-expert chunks (per-chunk counts, scanned by warp 0, lane l for passes CAP − l), plus
// those in its own chunk below it (match_any). A few shared-memory rounds whatever E, where
// ranking each expert against every key took ~0.8 µs of the grouping's one block at E = 128
// (run 151) and grows with E. `counts`: SLOT_COUNT_INTS shared ints. Complete after the
// caller's next barrier.
__device__ void active_by_passes(int experts, const int* offsets, int* active, int* num_active, int* counts) {
    const int lane = threadIdx.x & 31, chunks = (experts + 31) >> 5, span = chunks * 32;
    // Expert e's passes, -1 without pairs (or past the last expert).
    auto passes_of = [&](int e) {
        const int c = e < experts ? offsets[e + 1] - offsets[e] : 0;
        return c > 0 ? slot_passes(c) : -1;
    };
    for (int i = threadIdx.x; i < span; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    // Whole warps (span is a multiple of 32): a warp's 32 experts are one chunk.
    for (int e = threadIdx.x; e < span; e += blockDim.x) {
        const int ps = passes_of(e);
        const u32 same = __match_any_sync(FULL_MASK, ps);
        if (ps >= 0 && lane == __ffs(same) - 1) counts[(e >> 5) * 32 + ps] = __popc(same);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const int ps = SLOT_PASS_CAP - lane;  // lane 0: the most passes, first
        int total = 0;
        for (int c = 0; c < chunks; c++) total += counts[c * 32 + ps];
        const int incl = warp_inclusive_sum(total);
        int run = incl - total;
        for (int c = 0; c < chunks; c++) {
            const int n = counts[c * 32 + ps];
            counts[c * 32 + ps] = run;
            run += n;
        }
        if (lane == 31) num_active[0] = incl;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < span; e += blockDim.x) {
        const int ps = passes_of(e);
        const u32 same = __match_any_sync(FULL_MASK, ps);
        if (ps >= 0) active[counts[(e >> 5) * 32 + ps] + __popc(same & ((1u << lane) - 1))] = e;
    }
}

// offsets (exclusive prefix of counts[e], with offsets[E] = total), the active experts in
// `slot_key` order and their number, from counts in flags[0..E) (overwritten). `slot_counts`:
// SLOT_COUNT_INTS shared ints. One block.
__device__ void finish_offsets(int experts, int* flags, int* offsets, int* active, int* num_active,
                               int* slot_counts) {
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (w == 0) {
        int total = warp_exclusive_scan(flags, experts);  // flags now holds offsets
        if (lane == 0) offsets[experts] = total;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) offsets[e] = flags[e];
    __syncthreads();
    active_by_passes(experts, offsets, active, num_active, slot_counts);
}

// SORT_FEW 0 (a timing knob): every one-block sort takes the general path of sort_pairs_block.
#ifndef SORT_FEW
#define SORT_FEW 1
#endif

// sort_pairs_block's outputs for at most 1024 pairs by a block of 1024 threads, in four phases
// between three block barriers after the zeroing, with no serial section longer than a warp's
// 32-value scan (the general version's offsets scan and active order run on warp 0 while 31
// warps wait: ~10 K cycles for 48 pairs under ncu, run 190). Thread i is pair i (warp w holds
// pairs [32w, 32w + 32)) and, for i < 32·⌈E/32⌉, expert i (warp c holds experts [32c, 32c + 32)):
//   hist[w][e]  = pairs of expert e in warp w (match_any; its rows: the warps holding pairs);
//   position(p) = offsets[e_p] + Σ_{v<w} hist[v][e_p] + #{lanes of w below p with e_p}, so the
//                 same stable order as the general version;
//   offsets     = a shuffle scan of the counts per expert warp plus the lower warps' totals;
//   slot(x)     = #{active y: passes_y > passes_x} + #{active y < x: passes_y = passes_x}, from
//                 masks[c][ps] (the chunk's active experts with ps passes: one match_any leader
//                 writes each) and their suffix sums over ps (warp 31, a lane per ps): the same
//                 `slot_key` order as active_by_passes.
// Shared memory: the block sort's 33·E + SLOT_COUNT_INTS ints.
__device__ void sort_pairs_few(const int* ids, int pairs, int experts, int* offsets, int* sorted, int* active,
                               int* num_active, int* smem) {
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const u32 below = (1u << lane) - 1;
    const int rows = (pairs + 31) >> 5, chunks = (experts + 31) >> 5;
    int* hist = smem;                  // [rows][E]
    int* off = smem + 32 * experts;    // [E] exclusive offsets
    int* masks = off + experts;        // [chunks][32 passes]
    int* totals = masks + 16 * 32;     // [chunks] counts of each expert warp
    int* sums = totals + 16;           // [33] active experts with ps passes or more
    const bool pair = tid < pairs;
    const int e = pair ? ids[tid] : -1 - lane;  // lanes past the pairs never match anyone
    for (int i = tid; i < rows * experts; i += blockDim.x) hist[i] = 0;
    for (int i = tid; i < chunks * 32; i += blockDim.x) masks[i] = 0;
    __syncthreads();
    const u32 peers = __match_any_sync(FULL_MASK, e);
    if (pair && (peers & below) == 0) hist[w * experts + e] = __popc(peers);
    __syncthreads();
    int pos = 0;
    if (pair) {
        pos = __popc(peers & below);
        for (int v = 0; v < w; v++) pos += hist[v * experts + e];
    }
    const bool expert_warp = w < chunks;
    int count = 0, incl = 0, ps = -1;
    if (expert_warp) {
        if (tid < experts)
            for (int v = 0; v < rows; v++) count += hist[v * experts + tid];
        incl = warp_inclusive_sum(count);
        if (lane == 31) totals[w] = incl;
        ps = count > 0 ? slot_passes(count) : -1;
        const u32 same = __match_any_sync(FULL_MASK, ps);
        if (ps >= 0 && (same & below) == 0) masks[w * 32 + ps] = same;
    }
    __syncthreads();
    if (expert_warp) {
        int base = 0;
        for (int v = 0; v < w; v++) base += totals[v];
        if (tid < experts) {
            off[tid] = base + incl - count;
            offsets[tid] = base + incl - count;
        }
        if (tid == experts - 1) offsets[experts] = base + incl;
    } else if (w == 31) {
        // Lane l: active experts with l passes or more (lane 0: all of them).
        int n = 0;
        for (int c = 0; c < chunks; c++) n += __popc(masks[c * 32 + lane]);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_down_sync(FULL_MASK, n, o);
            if (lane + o < 32) n += y;
        }
        sums[lane] = n;
        if (lane == 0) {
            sums[32] = 0;
            num_active[0] = n;
        }
    }
    __syncthreads();
    if (pair) sorted[off[e] + pos] = tid;
    if (ps >= 0) {
        int slot = sums[ps + 1] + __popc(masks[w * 32 + ps] & below);
        for (int c = 0; c < w; c++) slot += __popc(masks[c * 32 + ps]);
        active[slot] = tid;
    }
}

// The whole sort of `pairs` pairs by one block of 1024 threads (32 warps). Shared memory `hist`:
// 33·E + SLOT_COUNT_INTS ints ([32][E] histograms, flags[E], the pass counts). `ids` may have
// been written by this block before a __syncthreads (route_small): plain loads, no read-only
// cache.
__device__ void sort_pairs_block(const int* ids, int pairs, int experts, int* offsets, int* sorted,
                                 int* active, int* num_active, int* hist) {
    if (SORT_FEW && pairs <= 1024 && blockDim.x == 1024) {
        sort_pairs_few(ids, pairs, experts, offsets, sorted, active, num_active, hist);
        return;
    }
    int* flags = hist + 32 * experts;
    for (int i = threadIdx.x; i < 32 * experts; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    warp_histograms(ids, 0, pairs, experts, hist);
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int c = 0;
        for (int v = 0; v < 32; v++) c += hist[v * experts + e];
        flags[e] = c;
    }
    finish_offsets(experts, flags, offsets, active, num_active, flags + experts);
    __syncthreads();
    warp_bases(offsets, experts, hist);
    __syncthreads();
    place(ids, 0, pairs, experts, hist, sorted);
}

// The grouping sort_pairs_block computes, for at most 32 pairs, by one warp (pair p = lane p),
// with no shared memory or block barrier: rank(p) = #{q : e_q < e_p} + #{q < p : e_q = e_p},
// offsets[x] = #{q : e_q < x}, and an expert's first pair writes it to active[#{distinct
// experts with a larger slot_key}]. Same outputs as the block version (route_small's one-token
// batches spend no time in the block version's 33·E-int histograms and their barriers).
#define SORT_WARP_MAX_PAIRS 32
__device__ void sort_pairs_warp(const int* ids, int pairs, int experts, int* offsets, int* sorted, int* active,
                                int* num_active) {
    const int lane = threadIdx.x & 31;
    const int e = lane < pairs ? ids[lane] : experts;  // experts: above every valid id
    int rank = 0, count = 0;
    bool first = lane < pairs;
    for (int j = 0; j < pairs; j++) {
        const int ej = __shfl_sync(FULL_MASK, e, j);
        rank += (ej < e) || (ej == e && j < lane);
        count += ej == e;
        if (ej == e && j < lane) first = false;
    }
    const u32 firsts = __ballot_sync(FULL_MASK, first);
    const int key = first ? slot_key(count, e) : -1;
    int above = 0;
    for (int j = 0; j < pairs; j++) above += __shfl_sync(FULL_MASK, key, j) > key;
    if (lane < pairs) sorted[rank] = lane;
    if (first) active[above] = e;
    if (lane == 0) num_active[0] = __popc(firsts);
    for (int base = 0; base <= experts; base += 32) {
        const int x = base + lane;
        int c = 0;
        for (int j = 0; j < pairs; j++) c += __shfl_sync(FULL_MASK, e, j) < x;
        if (x <= experts) offsets[x] = c;
    }
}

// sort_pairs_warp's outputs by the first `nthreads` (> 32) threads of the block: warp 0 the
// ranks, sorted positions and active experts (sort_pairs_warp itself, its offsets loop given
// no expert to count), the others offsets[x] = #{pairs with an id below x}, each thread its
// own x, reading the ids (in shared memory, or written by this block before the caller's
// barrier) themselves, where the warp takes E/32 rounds of `pairs` shuffles. Complete after the
// caller's next barrier.
__device__ void sort_pairs_group(const int* ids, int pairs, int experts, int* offsets, int* sorted, int* active,
                                 int* num_active, int nthreads) {
    if (threadIdx.x < 32) {
        // experts = -1: no offsets; it is otherwise only the id of lanes past the pairs, which
        // write nothing.
        sort_pairs_warp(ids, pairs, -1, nullptr, sorted, active, num_active);
        return;
    }
    for (int x = threadIdx.x - 32; x <= experts; x += nthreads - 32) {
        int c = 0;
        for (int j = 0; j < pairs; j++) c += ids[j] < x;
        offsets[x] = c;
    }
}
