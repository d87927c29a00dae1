// Token/slot pairs grouped by expert, deterministically and without a host synchronization.
//
// Pair p = t·k + j routed to expert ids[p]. Output: offsets[E+1] (exclusive prefix of counts),
// sorted[offsets[e] + r] = the r-th pair of expert e in increasing p, active[0..n) the experts
// with at least one pair in increasing id, num_active[0] = n. One block of 1024 threads: warp w
// owns a contiguous chunk of pairs; a per-warp histogram (int [32][E] in shared memory, E <= 512)
// and match_any ranks place pairs stably with no atomics.
#include "common.cuh"

// Exclusive scan of v[0..n) in place by one warp; returns the total.
__device__ int warp_exclusive_scan(int* v, int n) {
    int lane = threadIdx.x & 31;
    int per = (n + 31) / 32;
    int lo = min(lane * per, n), hi = min(lo + per, n);
    int local = 0;
    for (int i = lo; i < hi; i++) local += v[i];
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
    }
    int run = incl - local;
    for (int i = lo; i < hi; i++) {
        int c = v[i];
        v[i] = run;
        run += c;
    }
    return __shfl_sync(FULL_MASK, incl, 31);
}

extern "C" __global__ void sort_pairs(const int* __restrict__ ids, int pairs, int experts,
                                      int* __restrict__ offsets, int* __restrict__ sorted,
                                      int* __restrict__ active, int* __restrict__ num_active) {
    extern __shared__ int hist[];  // [32][experts], then flags[experts]
    int* flags = hist + 32 * experts;
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < 32 * experts; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    int chunk = (pairs + 31) / 32;
    int lo = min(w * chunk, pairs), hi = min(lo + chunk, pairs);
    for (int base = lo; base < hi; base += 32) {
        int p = base + lane;
        bool valid = p < hi;
        int e = valid ? ids[p] : -1 - lane;  // invalid lanes never match anyone
        u32 peers = __match_any_sync(FULL_MASK, e);
        if (valid && lane == __ffs(peers) - 1) hist[w * experts + e] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    // Counts per expert, then bases: base[w][e] = offsets[e] + sum of earlier warps' counts.
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int c = 0;
        for (int v = 0; v < 32; v++) c += hist[v * experts + e];
        flags[e] = c;
    }
    __syncthreads();
    if (w == 0) {
        int total = warp_exclusive_scan(flags, experts);  // flags now holds offsets
        if (lane == 0) offsets[experts] = total;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int run = flags[e];
        offsets[e] = run;
        for (int v = 0; v < 32; v++) {
            int c = hist[v * experts + e];
            hist[v * experts + e] = run;
            run += c;
        }
    }
    __syncthreads();
    for (int base = lo; base < hi; base += 32) {
        int p = base + lane;
        bool valid = p < hi;
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
    __syncthreads();
    // Active experts in increasing id.
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
        flags[e] = (offsets[e + 1] - offsets[e]) > 0 ? 1 : 0;
    __syncthreads();
    if (w == 0) {
        int n = warp_exclusive_scan(flags, experts);
        if (lane == 0) num_active[0] = n;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
        if (offsets[e + 1] - offsets[e] > 0) active[flags[e]] = e;
}

// Metadata of the shared expert seen as one expert holding every token once.
extern "C" __global__ void shared_meta(int tokens, int* __restrict__ offsets, int* __restrict__ sorted,
                                       int* __restrict__ active, int* __restrict__ num_active,
                                       float* __restrict__ ones) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < tokens) {
        sorted[i] = i;
        ones[i] = 1.0f;
    }
    if (i == 0) {
        offsets[0] = 0;
        offsets[1] = tokens;
        active[0] = 0;
        num_active[0] = 1;
    }
}
