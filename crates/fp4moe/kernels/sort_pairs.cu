// Token/slot pairs grouped by expert, deterministically and without a host synchronization
// (layout and method: sort_pairs.cuh). Small batches run in one block (sort_pairs), large ones
// over chunks in three kernels (count_pairs, scan_pair_counts, place_pairs).
#include "sort_pairs.cuh"

// Small batches: everything in one block of 1024 threads.
extern "C" __global__ void sort_pairs(const int* __restrict__ ids, int pairs, int experts,
                                      int* __restrict__ offsets, int* __restrict__ sorted,
                                      int* __restrict__ active, int* __restrict__ num_active) {
    pdl_enter();
    extern __shared__ int hist[];  // [32][experts], flags[experts], SLOT_COUNT_INTS
    sort_pairs_block(ids, pairs, experts, offsets, sorted, active, num_active, hist);
}

// Large batches, three kernels over SORT_CHUNK-pair chunks (one 1024-thread block each):
// count_pairs writes counts[b·E + e]; scan_pair_counts (one block) turns them into each chunk's
// first position per expert and writes offsets/active/num_active; place_pairs places the chunk.
// Chunks in order, warps in order, lanes in order: the same sorted order as sort_pairs.
extern "C" __global__ void count_pairs(const int* __restrict__ ids, int pairs, int experts, int chunk,
                                       int* __restrict__ counts) {
    pdl_enter();
    extern __shared__ int hist[];  // [32][experts]
    for (int i = threadIdx.x; i < 32 * experts; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    int lo = min(blockIdx.x * chunk, pairs), hi = min(lo + chunk, pairs);
    warp_histograms(ids, lo, hi, experts, hist);
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int c = 0;
        for (int v = 0; v < 32; v++) c += hist[v * experts + e];
        counts[blockIdx.x * experts + e] = c;
    }
}

extern "C" __global__ void scan_pair_counts(int* __restrict__ counts, int chunks, int experts,
                                            int* __restrict__ offsets, int* __restrict__ active,
                                            int* __restrict__ num_active) {
    pdl_enter();
    extern __shared__ int flags[];  // [experts], then SLOT_COUNT_INTS
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int c = 0;
        for (int b = 0; b < chunks; b++) c += counts[b * experts + e];
        flags[e] = c;
    }
    finish_offsets(experts, flags, offsets, active, num_active, flags + experts);
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int run = offsets[e];
        for (int b = 0; b < chunks; b++) {
            int c = counts[b * experts + e];
            counts[b * experts + e] = run;
            run += c;
        }
    }
}

extern "C" __global__ void place_pairs(const int* __restrict__ ids, int pairs, int experts, int chunk,
                                       const int* __restrict__ bases, int* __restrict__ sorted) {
    pdl_enter();
    extern __shared__ int hist[];  // [32][experts]
    for (int i = threadIdx.x; i < 32 * experts; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    int lo = min(blockIdx.x * chunk, pairs), hi = min(lo + chunk, pairs);
    warp_histograms(ids, lo, hi, experts, hist);
    __syncthreads();
    warp_bases(bases + blockIdx.x * experts, experts, hist);
    __syncthreads();
    place(ids, lo, hi, experts, hist, sorted);
}
