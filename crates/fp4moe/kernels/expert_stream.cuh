// The streaming decode GEMMs' per-warp steps, shared by expert_stream.cu (one launch per GEMM)
// and one_token.cu (the whole one-token layer in one launch), so both compute a unit with the
// very same instructions: the same bits, whichever launch runs a token.
//
// A block of STREAM_WARPS warps computes RB weight row groups ("units", 16 rows each; gated:
// the gate and the up row group of the same g rows, U = 2) for a few tokens. Warp w owns unit
// w % RB and k groups [ks·kg/KSPLIT, (ks+1)·kg/KSPLIT), ks = w / RB, KSPLIT = STREAM_WARPS / RB,
// copies exactly the bytes of that slice into shared memory (cp.async) and runs mma.sync
// m16n8k16 over it (A: table-free exact dequantization, gemm_common.cuh; B: the staged token
// row g, zero past the tile). The KSPLIT partial sums are added in slice order by slice 0.
//
// Shared layout of one block's units (kg = padded K / 64): data [RB·U][kg·512], then scales
// [RB·U][kg·64], unit (rgl, u) at index rgl·U + u: the global layout of cuda/pack.rs per row
// group, copied verbatim.
#pragma once
#include "gemm_common.cuh"

#define STREAM_WARPS 8
#define STREAM_TILE 8  // most activation rows per pass (one mma column tile)

__device__ __forceinline__ void cp_async_wait_upto(int pending) {
    // wait_group takes an immediate.
    if (pending >= 7) cp_async_wait<7>();
    else if (pending == 6) cp_async_wait<6>();
    else if (pending == 5) cp_async_wait<5>();
    else if (pending == 4) cp_async_wait<4>();
    else if (pending == 3) cp_async_wait<3>();
    else if (pending == 2) cp_async_wait<2>();
    else if (pending == 1) cp_async_wait<1>();
    else cp_async_wait<0>();
}

// This warp's k groups [lo, hi) of expert e's output row group rg (all U units) into the
// block's unit region (sdata / sscale, `units` = RB·U units): lane L copies data pieces L, L + 32,
// … of each k group, i.e. exactly the 16 bytes it reads back; the scale pieces are read by
// other lanes of the warp (a __syncwarp after the wait).
template <bool GATED>
__device__ __forceinline__ void stream_copy_slice(const GemmParams& p, int e, int rg, int rgl, int lo, int hi,
                                                  u8* sdata, u8* sscale, int lane) {
    constexpr int U = GATED ? 2 : 1;
    const int kg = p.kg;
#pragma unroll
    for (int u = 0; u < U; u++) {
        const size_t wr = (size_t)e * p.rg_w + rg + u * p.rg_out;
        const u8* gd = p.wdata + wr * kg * 512;
        const u8* gs = p.wscales + wr * kg * 64;
        u8* sd = sdata + (size_t)(rgl * U + u) * kg * 512;
        u8* ss = sscale + (size_t)(rgl * U + u) * kg * 64;
        for (int i = lo * 32 + lane; i < hi * 32; i += 32) cp_async16(sd + 16 * i, gd + 16 * i, 16);
        for (int i = lo * 4 + lane; i < hi * 4; i += 32) cp_async16(ss + 16 * i, gs + 16 * i, 16);
    }
}

// acc (accu: the up rows) += this warp's k groups [lo, hi) of its unit against token row g of
// the staged tile (`brow` = row g's element 2q, `has_token` = g below the tile's valid rows).
// wd0 / ws0: the unit's first data / scale byte this lane reads (its region + lane·16 / + g·8).
template <bool GATED>
__device__ __forceinline__ void stream_slice_mma(const u8* wd0, const u8* ws0, int kg, const __nv_bfloat16* brow,
                                                 bool has_token, int lo, int hi, float (&acc)[4],
                                                 float (&accu)[4]) {
    for (int kgi = lo; kgi < hi; kgi++) {
        const uint4 d = *reinterpret_cast<const uint4*>(wd0 + kgi * 512);
        const uint2 s = *reinterpret_cast<const uint2*>(ws0 + kgi * 64);
        uint4 du = make_uint4(0, 0, 0, 0);
        uint2 su = make_uint2(0, 0);
        if (GATED) {
            du = *reinterpret_cast<const uint4*>(wd0 + (size_t)kg * 512 + kgi * 512);
            su = *reinterpret_cast<const uint2*>(ws0 + (size_t)kg * 64 + kgi * 64);
        }
        const u32 dw[4] = {d.x, d.y, d.z, d.w};
        const u32 duw[4] = {du.x, du.y, du.z, du.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int kc = (kgi * 4 + j) * 16;
            u32 b0 = 0, b1 = 0;
            if (has_token) {
                b0 = *reinterpret_cast<const u32*>(brow + kc);
                b1 = *reinterpret_cast<const u32*>(brow + kc + 8);
            }
            u32 a[4];
            dequant_fragment_alu(dw[j], scale_pairs(s, j), a);
            mma_bf16_16816(acc, a, b0, b1);
            if (GATED) {
                dequant_fragment_alu(duw[j], scale_pairs(su, j), a);
                mma_bf16_16816(accu, a, b0, b1);
            }
        }
    }
}

// Split-K, first half: slice ks > 0 parks its sums in `red` ([(KSPLIT − 1)·RB][32 lanes][4·U]
// f32). The caller then synchronizes the block's warps and slice 0 calls stream_sum_slices.
template <bool GATED>
__device__ __forceinline__ void stream_park(float* red, int ks, int rb, int rgl, int lane, const float (&acc)[4],
                                            const float (&accu)[4]) {
    constexpr int NACC = GATED ? 8 : 4;
    if (ks == 0) return;
    float* dst = red + (((ks - 1) * rb + rgl) * 32 + lane) * NACC;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        dst[c] = acc[c];
        if (GATED) dst[4 + c] = accu[c];
    }
}

// Split-K, second half (slice 0): slices 1 .. ksplit − 1 added in order.
template <bool GATED>
__device__ __forceinline__ void stream_sum_slices(const float* red, int ksplit, int rb, int rgl, int lane,
                                                  float (&acc)[4], float (&accu)[4]) {
    constexpr int NACC = GATED ? 8 : 4;
    for (int o = 1; o < ksplit; o++) {
        const float* src = red + (((o - 1) * rb + rgl) * 32 + lane) * NACC;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            acc[c] += src[c];
            if (GATED) accu[c] += src[4 + c];
        }
    }
}
