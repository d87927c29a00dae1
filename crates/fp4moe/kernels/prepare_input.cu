// Layer input → bf16 GEMM operand, one block per token.
//
// W4A16 (gs <= 0): a = bf16(x). W4A4: a = e2m1(code) · f32(S), exact in bf16, where code and S are
// the NVFP4 activation quantization of x with global scale gs (DESIGN 1.2); the 1/gs factor is
// applied in the GEMM epilogue. `xs` (may be null) receives bf16(x) for the shared expert, which
// runs on the unquantized input.
#include "common.cuh"

extern "C" __global__ void prepare_input(const float* __restrict__ x, __nv_bfloat16* __restrict__ a,
                                         __nv_bfloat16* __restrict__ xs, int hidden, float gs) {
    const float* xr = x + (size_t)blockIdx.x * hidden;
    __nv_bfloat16* ar = a + (size_t)blockIdx.x * hidden;
    if (xs) {
        __nv_bfloat16* sr = xs + (size_t)blockIdx.x * hidden;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) sr[c] = __float2bfloat16_rn(xr[c]);
    }
    if (gs <= 0.0f) {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) ar[c] = __float2bfloat16_rn(xr[c]);
        return;
    }
    for (int b = threadIdx.x; b < hidden / 16; b += blockDim.x) {
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
