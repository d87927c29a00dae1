// Combine: y[t, h] = Σ_j o[t·k + j, h] (+ shared[t, h]), summed in slot order so the result is
// bitwise reproducible. `o` already holds the routed weight (rsf included) times the expert output.
#include "common.cuh"

extern "C" __global__ void combine(const float* __restrict__ o, const float* __restrict__ shared,
                                   float* __restrict__ y, int tokens, int top_k, int hidden) {
    pdl_wait();
    pdl_launch_dependents();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tokens * hidden) return;
    size_t t = i / hidden, h = i % hidden;
    float acc = 0.0f;
    for (int j = 0; j < top_k; j++) acc += o[(t * top_k + j) * hidden + h];
    if (shared) acc += shared[i];
    y[i] = acc;
}
