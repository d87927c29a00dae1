// Timing yardstick (`fp4moe bench --bare-reads`), not part of the layer: every byte of the routed
// experts' weights (w13's and w2's packed NVFP4 data and scales) read once from global memory,
// nothing computed. After the layer's own routing it is the least a layer that reads each
// weight once can spend past its routing; alone, the least its weights' bytes take.
//
// Work: the active experts of the grouping (`active[0 .. num_active)`) x four regions each
// (w13 data, w13 scales, w2 data, w2 scales; expert e's region r is `len[r]` 16-byte vectors at
// base[r] + e·len[r], cuda/pack.rs's per-expert layout), cut into chunks of BR_UNROLL·blockDim
// vectors (`chunks[r]` per expert); block b takes chunks b, b + gridDim.x, ... and each thread
// issues BR_UNROLL 16-byte streaming loads per chunk (ptxas keeps two or three in flight at 32
// registers; with BR_BLOCKS blocks of BR_THREADS threads per SM that is ~80 KB per SM, more than
// DRAM's latency needs). `sink[b]` += the vectors block b read (one store per block, no atomics
// on a shared word: the host checks the total); `sink[gridDim.x]` counts the threads whose XOR
// of everything they read equals a constant, so no load is dead code.
#include "common.cuh"

#define BR_UNROLL 8
#define BR_THREADS 256
#define BR_BLOCKS 8  // per SM: 2048 threads at 32 registers

extern "C" __global__ void __launch_bounds__(BR_THREADS, BR_BLOCKS) bare_read(
    const uint4* __restrict__ base0, const uint4* __restrict__ base1, const uint4* __restrict__ base2,
    const uint4* __restrict__ base3, unsigned long long len0, unsigned long long len1,
    unsigned long long len2, unsigned long long len3, int chunks0,
    int chunks1, int chunks2, int chunks3, const int* __restrict__ active, const int* __restrict__ num_active,
    unsigned* __restrict__ sink) {
    pdl_wait();
    pdl_launch_dependents();
    const int per = chunks0 + chunks1 + chunks2 + chunks3;
    const int total = *num_active * per;
    const unsigned long long span = (unsigned long long)BR_UNROLL * BR_THREADS;
    u32 acc = 0, read = 0;
    for (int c = blockIdx.x; c < total; c += gridDim.x) {
        const int j = c / per;
        int r = c - j * per;
        const uint4* src;
        unsigned long long len;
        if (r < chunks0) {
            src = base0, len = len0;
        } else if ((r -= chunks0) < chunks1) {
            src = base1, len = len1;
        } else if ((r -= chunks1) < chunks2) {
            src = base2, len = len2;
        } else {
            r -= chunks2;
            src = base3, len = len3;
        }
        src += (unsigned long long)active[j] * len;
        const unsigned long long lo = r * span + threadIdx.x;
        uint4 v[BR_UNROLL];
#pragma unroll
        for (int u = 0; u < BR_UNROLL; u++) {
            const unsigned long long i = lo + u * BR_THREADS;
            v[u] = i < len ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
            read += i < len;
        }
#pragma unroll
        for (int u = 0; u < BR_UNROLL; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9E3779B9u) atomicAdd(sink + gridDim.x, 1u);
    // The block's count: warp sums, then one thread adds them to the block's own word.
    __shared__ u32 warp_read[BR_THREADS / 32];
    read = __reduce_add_sync(0xffffffffu, read);
    if ((threadIdx.x & 31) == 0) warp_read[threadIdx.x >> 5] = read;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 n = 0;
        for (int w = 0; w < BR_THREADS / 32; w++) n += warp_read[w];
        sink[blockIdx.x] += n;
    }
}
