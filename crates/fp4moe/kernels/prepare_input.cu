// Layer input → bf16 GEMM operand, one block per token (formulas: prepare_input.cuh).
#include "prepare_input.cuh"

// Launched right after the pair sort (`CudaLayer::group_device`), it prepares its rows without
// waiting for it, so the two overlap: it reads the layer input and writes `a` / `xs`, which only
// the previous forward's GEMMs read, and all of that was settled before this grid launched (its
// predecessor lets dependents launch only after its own wait, which follows top-k's, which
// follows the router's, which follows the previous forward's end). Block 0 waits at exit, so
// this grid completes after the sort: GEMM1 waits on this grid alone and reads both (the chain
// gemm_exit in gemm_common.cuh relies on too).
extern "C" __global__ void prepare_input(const float* __restrict__ x, __nv_bfloat16* __restrict__ a,
                                         __nv_bfloat16* __restrict__ xs, int hidden, float gs) {
    pdl_launch_dependents();
    size_t row = (size_t)blockIdx.x * hidden;
    prepare_row(x + row, a + row, xs ? xs + row : nullptr, hidden, gs, threadIdx.x, blockDim.x);
    if (blockIdx.x == 0 && threadIdx.x == 0) pdl_wait();
}

// inv[sorted[i]] = i: each routed pair's row in sorted order, for prepare_input_sorted.
extern "C" __global__ void invert_pairs(const int* __restrict__ sorted, int* __restrict__ inv, int pairs) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < pairs) inv[sorted[i]] = i;
}

// prepare_input for a TMA-fed prefill GEMM1: token t's prepared row goes straight to its top_k
// rows inv[t·top_k + j] of GEMM1's sorted operand (the bytes gather_rows would copy from `a`,
// which is then not written: T·k·H bf16 written once, where prepare_input and gather_rows wrote
// T·H, read T·k·H and wrote T·k·H). top_k <= 32 (check_limits).
extern "C" __global__ void prepare_input_sorted(const float* __restrict__ x, __nv_bfloat16* __restrict__ a_sorted,
                                                __nv_bfloat16* __restrict__ xs, const int* __restrict__ inv, int hidden,
                                                float gs, int top_k) {
    pdl_enter();
    __shared__ int rows[32];
    if (threadIdx.x < top_k) rows[threadIdx.x] = inv[(size_t)blockIdx.x * top_k + threadIdx.x];
    __syncthreads();
    size_t row = (size_t)blockIdx.x * hidden;
    prepare_row_into(x + row, PairRows{a_sorted, rows, top_k, hidden}, xs ? xs + row : nullptr, hidden, gs, threadIdx.x,
                     blockDim.x);
}

// The prefill GEMM1 operand in sorted order, for TMA: out[i] = a[sorted[i] / top_k] (rows of
// `hidden` bf16, hidden % 8 == 0), one warp per row, 16-byte copies.
extern "C" __global__ void gather_rows(const __nv_bfloat16* __restrict__ a, const int* __restrict__ sorted,
                                       __nv_bfloat16* __restrict__ out, int pairs, int top_k, int hidden) {
    pdl_enter();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= pairs) return;
    const uint4* src = reinterpret_cast<const uint4*>(a + (size_t)(sorted[row] / top_k) * hidden);
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)row * hidden);
    for (int i = lane; i < hidden / 8; i += 32) dst[i] = src[i];
}
