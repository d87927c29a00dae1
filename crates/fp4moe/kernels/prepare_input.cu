// Layer input → bf16 GEMM operand, one block per token (formulas: prepare_input.cuh).
#include "prepare_input.cuh"

extern "C" __global__ void prepare_input(const float* __restrict__ x, __nv_bfloat16* __restrict__ a,
                                         __nv_bfloat16* __restrict__ xs, int hidden, float gs) {
    size_t row = (size_t)blockIdx.x * hidden;
    prepare_row(x + row, a + row, xs ? xs + row : nullptr, hidden, gs, threadIdx.x, blockDim.x);
}
