// Layer input → bf16 GEMM operand, one token row at a time; shared by prepare_input.cu and
// route_small.cu (the same instructions in both launch paths).
//
// W4A16 (gs <= 0): a = bf16(x). W4A4: a = e2m1(code) · f32(S), exact in bf16, where code and S are
// the NVFP4 activation quantization of x with global scale gs (DESIGN 1.2); the 1/gs factor is
// applied in the GEMM epilogue. `xs` (may be null) receives bf16(x) for the shared expert, which
// runs on the unquantized input.
#pragma once
#include "common.cuh"

// Row xr[0..hidden) → ar (and sr unless null) by threads tid, tid + nthreads, ... of a group of
// nthreads. Each output depends only on its own element (bf16) or 16-block (W4A4), so any thread
// mapping gives the same bits.
__device__ void prepare_row(const float* xr, __nv_bfloat16* ar, __nv_bfloat16* sr, int hidden, float gs,
                            int tid, int nthreads) {
    if (sr) {
        for (int c = tid; c < hidden; c += nthreads) sr[c] = __float2bfloat16_rn(xr[c]);
    }
    if (gs <= 0.0f) {
        for (int c = tid; c < hidden; c += nthreads) ar[c] = __float2bfloat16_rn(xr[c]);
        return;
    }
    for (int b = tid; b < hidden / 16; b += nthreads) {
        float v[16];
        float vmax = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            v[i] = xr[b * 16 + i];
            vmax = fmaxf(vmax, fabsf(v[i]));
        }
        u8 sb;
        float sf = nvfp4_block_scale(vmax, gs, &sb);
        float os = nvfp4_out_scale(sf, gs);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u32 code = nvfp4_code(v[i], os);
            float q = (code & 7) ? e2m1_value(code) * sf : 0.0f;
            ar[b * 16 + i] = __float2bfloat16_rn(q);
        }
    }
}
