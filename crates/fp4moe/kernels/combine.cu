// Combine: y[t, h] = Σ_j f32(o[t·k + j, h]) (+ f32(shared[t, h])), summed in f32 from 0 in slot
// order so the result is bitwise reproducible. `o` holds each pair's routed weight (rsf included)
// times its expert output, rounded once to bf16 by GEMM2 (gemm_common.cuh); `shared` the shared
// expert's output, the same way with weight 1.
// Grid: x = token, y = column blocks; a thread owns 8 consecutive columns (one 16-byte load per
// slot, issued 4 slots at a time; hidden % 16 == 0, which the spec checks). `o` is read once:
// streaming loads (evict first), so the combine does not push the layer's weights out of L2.
#include "common.cuh"

// acc[i] += the i-th of the 8 bf16 in `v` (bf16 → f32 is exact: the high half of the word).
// Shifts, not __bfloat1622float2(bits_bf16x2(w)): that compiles to ~2.5 times the bit
// operations in this loop (sm_90a SASS, session 26).
__device__ __forceinline__ void add8(float (&acc)[8], uint4 v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc[2 * i] += __uint_as_float(w[i] << 16);
        acc[2 * i + 1] += __uint_as_float(w[i] & 0xFFFF0000u);
    }
}

extern "C" __global__ void combine(const __nv_bfloat16* __restrict__ o, const __nv_bfloat16* __restrict__ shared,
                                   float* __restrict__ y, int tokens, int top_k, int hidden) {
    pdl_wait();
    pdl_launch_dependents();
    const int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x, n8 = hidden >> 3;
    if (c >= n8) return;
    const size_t row = (size_t)t * hidden;
    const uint4* p = reinterpret_cast<const uint4*>(o + row * top_k) + c;
    float acc[8] = {};
    int j = 0;
    for (; j + 4 <= top_k; j += 4, p += 4 * (size_t)n8) {
        const uint4 v0 = __ldcs(p), v1 = __ldcs(p + n8), v2 = __ldcs(p + 2 * (size_t)n8),
                    v3 = __ldcs(p + 3 * (size_t)n8);
        add8(acc, v0);
        add8(acc, v1);
        add8(acc, v2);
        add8(acc, v3);
    }
    for (; j < top_k; j++, p += n8) add8(acc, __ldcs(p));
    if (shared) add8(acc, reinterpret_cast<const uint4*>(shared + row)[c]);
    float4* out = reinterpret_cast<float4*>(y + row) + 2 * c;
    out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}
