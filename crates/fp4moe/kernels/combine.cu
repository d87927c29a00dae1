// Combine: y[t, h] = Σ_j o[t·k + j, h] (+ shared[t, h]), summed from 0 in slot order so the
// result is bitwise reproducible. `o` already holds the routed weight (rsf included) times the
// expert output.
// Grid: x = token, y = column blocks; a thread owns 4 consecutive columns (one 16-byte load per
// slot, issued 4 slots at a time; hidden % 16 == 0, which the spec checks). `o` is read once:
// streaming loads (evict first), so the combine does not push the layer's weights out of L2.
#include "common.cuh"

__device__ __forceinline__ void add4(float4& a, float4 v) {
    a.x += v.x;
    a.y += v.y;
    a.z += v.z;
    a.w += v.w;
}

extern "C" __global__ void combine(const float* __restrict__ o, const float* __restrict__ shared,
                                   float* __restrict__ y, int tokens, int top_k, int hidden) {
    pdl_wait();
    pdl_launch_dependents();
    const int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x, n4 = hidden >> 2;
    if (c >= n4) return;
    const size_t row = (size_t)t * hidden;
    const float4* p = reinterpret_cast<const float4*>(o + row * top_k) + c;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    int j = 0;
    for (; j + 4 <= top_k; j += 4, p += 4 * (size_t)n4) {
        const float4 v0 = __ldcs(p), v1 = __ldcs(p + n4), v2 = __ldcs(p + 2 * (size_t)n4),
                     v3 = __ldcs(p + 3 * (size_t)n4);
        add4(acc, v0);
        add4(acc, v1);
        add4(acc, v2);
        add4(acc, v3);
    }
    for (; j < top_k; j++, p += n4) add4(acc, __ldcs(p));
    if (shared) add4(acc, reinterpret_cast<const float4*>(shared + row)[c]);
    reinterpret_cast<float4*>(y + row)[c] = acc;
}
