// Layer input → bf16 GEMM operand, one token row at a time; shared by prepare_input.cu and
// route_small.cu (the same instructions in both launch paths).
//
// W4A16 (gs <= 0): a = bf16(x). W4A4: a = e2m1(code) · f32(S), exact in bf16, where code and S are
// the NVFP4 activation quantization of x with global scale gs (DESIGN 1.2); the 1/gs factor is
// applied in the GEMM epilogue. `xs` (may be null) receives bf16(x) for the shared expert, which
// runs on the unquantized input.
#pragma once
#include "common.cuh"

// One destination row: the operand row of the token (prepare_input, route_small).
struct OneRow {
    uint2* a4;
    __device__ __forceinline__ void store(int q, uint2 b) const { a4[q] = b; }
};
// Several destination rows: the token's top_k rows of GEMM1's operand in sorted pair order
// (prepare_input_sorted), rows[j] < 0 never (each pair has one sorted position).
struct PairRows {
    __nv_bfloat16* base;
    const int* rows;  // shared memory, n entries
    int n, hidden;
    __device__ __forceinline__ void store(int q, uint2 b) const {
        for (int j = 0; j < n; j++) reinterpret_cast<uint2*>(base + (size_t)rows[j] * hidden)[q] = b;
    }
};

// Row xr[0..hidden) → dst (and sr unless null) by the threads tid = 0 .. nthreads − 1 of a group
// of whole warps (nthreads a multiple of 32, tid's lane = threadIdx's lane). hidden % 16 == 0
// (the spec checks it). Each thread takes 4 consecutive elements per step: 16-byte loads and
// 8-byte stores, coalesced across the warp (one element or one 16-block per thread made 2-byte
// stores 32 bytes apart: W4A4's input preparation cost 76 us more than W4A16's at 4096 tokens,
// KERNEL_NOTES run 49). A 16-block is 4 neighbouring lanes; its absolute max takes two shuffles,
// so every lane runs every step. Each output depends only on its own element (bf16) or
// 16-block (W4A4), so the thread mapping does not change the bits.
template <class Dst>
__device__ __forceinline__ void prepare_row_into(const float* xr, const Dst& dst, __nv_bfloat16* sr, int hidden, float gs,
                                                 int tid, int nthreads) {
    const int quads = hidden / 4;
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    uint2* s4 = reinterpret_cast<uint2*>(sr);
    if (gs <= 0.0f) {
        for (int q = tid; q < quads; q += nthreads) {
            const float4 v = x4[q];
            const uint2 b = bf16x4_bits(v.x, v.y, v.z, v.w);
            dst.store(q, b);
            if (sr) s4[q] = b;
        }
        return;
    }
    const float inv_gs = 1.0f / gs;
    for (int q0 = 0; q0 < quads; q0 += nthreads) {  // the same trips for every lane
        const int q = q0 + tid;
        const bool ok = q < quads;  // quads come in fours (hidden % 16 == 0): whole blocks
        const float4 x = ok ? x4[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (sr && ok) s4[q] = bf16x4_bits(x.x, x.y, x.z, x.w);
        float v[4] = {x.x, x.y, x.z, x.w};
        nvfp4_qdq_block<4, 1, 4>(v, gs, inv_gs);
        if (ok) dst.store(q, bf16x4_bits(v[0], v[1], v[2], v[3]));
    }
}
__device__ __forceinline__ void prepare_row(const float* xr, __nv_bfloat16* ar, __nv_bfloat16* sr, int hidden, float gs,
                                            int tid, int nthreads) {
    prepare_row_into(xr, OneRow{reinterpret_cast<uint2*>(ar)}, sr, hidden, gs, tid, nthreads);
}
