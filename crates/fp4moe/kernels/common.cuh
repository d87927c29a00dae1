// Shared device helpers for fp4moe kernels: NVFP4 element/scale conversions (DESIGN 1), the
// activation functions (DESIGN 2), warp reductions and the mma.sync tile wrapper.
//
// Numerics contract: every conversion here reproduces the CPU code bit for bit
// (crates/fp4moe/src/format): E2M1 round-half-to-even with saturation at 6, E4M3 RNE with
// SATFINITE, exact (IEEE) divisions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// bar.sync among `nthreads` threads of the block (named barrier `bar`, a multiple of 32 threads,
// every warp of the group calling; 0 with the whole block is __syncthreads).
__device__ __forceinline__ void group_sync(int bar, int nthreads) {
    asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(nthreads) : "memory");
}
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Activation ids, as the host passes them (spec::Activation order).
#define ACT_SILU 0
#define ACT_GELU_TANH 1
#define ACT_RELU2 2
#define ACT_SILU_NO_MUL 3

// |value| of an E2M1 code without a table (an indexed local array lives in local memory: a
// 32-byte stack frame and a load per value in every kernel that quantizes). Codes 2..7 are
// 2^(e-1)·(1 + m/2) with e = code >> 1, m = code & 1, i.e. the f32 bits ((e + 126) << 23) |
// (m << 22); code 1 is 0.5, code 0 is 0.
__device__ __forceinline__ float e2m1_magnitude(u32 code) {
    const u32 c = code & 7;
    const u32 bits = c >= 2 ? (((c >> 1) + 126u) << 23) | ((c & 1u) << 22) : (c ? 0x3F000000u : 0u);
    return __uint_as_float(bits);
}

// Signed value of a nibble; the negative-zero code decodes to +0.
__device__ __forceinline__ float e2m1_value(u32 nib) {
    float m = e2m1_magnitude(nib);
    return (nib & 8) ? -m : m;  // -0.0f only for m == 0, which callers treat as 0
}

__device__ __forceinline__ float e4m3_to_float(u8 b) {
    __nv_fp8_e4m3 v;
    v.__x = b;
    return float(v);
}

__device__ __forceinline__ u8 float_to_e4m3_sat(float x) {
    return (u8)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// One 16-block of the activation quantizer (DESIGN 1.2): its decoded E4M3 block scale for
// global scale `gs`, given the block's absolute max.
__device__ __forceinline__ float nvfp4_block_scale(float vmax, float gs) {
    return e4m3_to_float(float_to_e4m3_sat(fminf(gs * (vmax * (1.0f / 6.0f)), 448.0f)));
}

// The element multiplier 1 / (S · (1 / gs)) of a block with decoded scale S; `inv_gs` is
// 1.0f / gs, computed once by the caller (the same bits as dividing here each time).
__device__ __forceinline__ float nvfp4_out_scale(float sf, float inv_gs) {
    return sf != 0.0f ? 1.0f / (sf * inv_gs) : 0.0f;
}

// Quantize-dequantize of x in a block with element multiplier `os` and decoded scale `sf`:
// sf · e2m1(clamp(x · os, ±6)), where e2m1 rounds to the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} to
// nearest with ties to the even code (format/e2m1.rs's interval thresholds). The grid spacing
// is 2^(e − 1) within binade e (0.5 below 2, 1 below 4, 2 up to 6), so scaling |y| by the
// inverse spacing, rounding to the nearest integer with ties to even (an even integer is an even
// code) and scaling back is that rounding, exactly: both scalings are powers of two. A zero
// code gives +0 whatever the sign (as the code-and-table form did). ~10 instructions for the
// ~30 of a threshold chain plus a code-to-value decode. The test
// `rounding_by_spacing_equals_thresholds` (format/e2m1.rs) checks the formula against the
// thresholds for every f32 from 0 to 8. (NaN gives +6 here, -6 before, 0 on the CPU; inputs are finite.)
__device__ __forceinline__ float nvfp4_qdq(float x, float os, float sf) {
    const float y = x * os;
    const float a = fminf(fabsf(y), 6.0f);
    const bool lo = a < 2.0f, mid = a < 4.0f;
    const float r = rintf(a * (lo ? 2.0f : mid ? 1.0f : 0.5f)) * (lo ? 0.5f : mid ? 1.0f : 2.0f) * sf;
    return r != 0.0f && y < 0.0f ? -r : r;
}

// Quantize-dequantize of one 16-element block held as N values in each of LANES lanes whose
// ids differ in the bits of the xor masks FIRST, 2·FIRST, ... (every lane of the warp calls it):
// the block's absolute max across them, its E4M3 scale for global scale gs (inv_gs = 1.0f / gs),
// then nvfp4_qdq of each value. The max is exact in any order, so any lane layout gives the
// same bits.
template <int N, int FIRST, int LANES>
__device__ __forceinline__ void nvfp4_qdq_block(float (&v)[N], float gs, float inv_gs) {
    static_assert(N * LANES == 16, "an NVFP4 block has 16 elements");
    float vmax = fabsf(v[0]);
#pragma unroll
    for (int i = 1; i < N; i++) vmax = fmaxf(vmax, fabsf(v[i]));
#pragma unroll
    for (int o = FIRST; o < FIRST * LANES; o <<= 1) vmax = fmaxf(vmax, __shfl_xor_sync(FULL_MASK, vmax, o));
    const float sf = nvfp4_block_scale(vmax, gs);
    const float os = nvfp4_out_scale(sf, inv_gs);
#pragma unroll
    for (int i = 0; i < N; i++) v[i] = nvfp4_qdq(v[i], os, sf);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float gelu_tanh(float x) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

// g = act(h, up); `up` is ignored by non-gated activations.
__device__ __forceinline__ float apply_activation(int act, float h, float up) {
    switch (act) {
        case ACT_SILU: return silu(h) * up;
        case ACT_GELU_TANH: return gelu_tanh(h) * up;
        case ACT_RELU2: { float r = fmaxf(h, 0.0f); return r * r; }
        default: return silu(h);
    }
}

// Programmatic dependent launch (sm_90+; no-ops before). A kernel launched with programmatic
// stream serialization may start while its predecessor runs: pdl_wait() returns once the
// predecessor has completed and its writes are visible, so nothing the predecessor writes may be
// read (or anything it reads be written) before it. pdl_launch_dependents() lets the next kernel
// start once every block of this one has called it (or exited); every kernel launched so (the
// routing kernels, each GEMM and the combine) calls it right after its wait, so a successor never
// starts before this kernel's predecessor is done. Exceptions: the routed decode GEMM2 on the
// expert-ready handoff waits per expert instead, and every prefill GEMM2 (routed or shared,
// handoff or not) calls it at entry and waits later, after requesting its first weights; in
// both, one thread of block (0, 0) calls pdl_wait before exiting, so the GEMM2's completion
// still implies its predecessor's (gemm_common.cuh). Their successors (the shared expert's
// GEMM1, the combine) may thus start while the routed GEMM1 runs: each must wait before it
// reads anything.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The routing kernels' first statement (they may run as programmatic dependents, and every
// input they read or buffer they write belongs to earlier work on the stream): wait for the
// predecessor, then let the next kernel's blocks become resident while this one runs.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Inclusive prefix sum of v over the warp's lanes: lane l gets v of lanes 0..l (all 32 lanes
// take part).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

// D += A·B for one m16n8k16 bf16 tile (A row-major 16x16, B col-major 16x8, f32 accumulators).
// Fragments (g = lane/4, q = lane%4): a[0] = A(g, 2q..2q+1), a[1] = A(g+8, 2q..), a[2] = A(g, 2q+8..),
// a[3] = A(g+8, 2q+8..); b[0] = B(2q..2q+1, g), b[1] = B(2q+8.., g); d[0..1] = D(g, 2q..2q+1),
// d[2..3] = D(g+8, 2q..2q+1).
__device__ __forceinline__ void mma_bf16_16816(float d[4], const u32 a[4], u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 bf16x2_bits(__nv_bfloat162 v) {
    return *reinterpret_cast<u32*>(&v);
}
// Four floats rounded to bf16 (nearest even), packed in memory order for one 8-byte store.
__device__ __forceinline__ uint2 bf16x4_bits(float a, float b, float c, float d) {
    return make_uint2(bf16x2_bits(__floats2bfloat162_rn(a, b)), bf16x2_bits(__floats2bfloat162_rn(c, d)));
}
// Eight floats rounded to bf16 (nearest even), in memory order for one 16-byte store.
__device__ __forceinline__ uint4 bf16x8_bits(const float (&v)[8]) {
    const uint2 lo = bf16x4_bits(v[0], v[1], v[2], v[3]), hi = bf16x4_bits(v[4], v[5], v[6], v[7]);
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ __nv_bfloat162 bits_bf16x2(u32 v) {
    return *reinterpret_cast<__nv_bfloat162*>(&v);
}

// The global nanosecond timer (spin timeouts, traces).
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Read-only, not-L1-allocating loads for streamed weights. `volatile`: a non-volatile asm load
// counts as side-effect free and was speculated above its bounds guard (compute-sanitizer caught
// it); the MMAs are non-volatile asm, so the compiler still schedules them around these loads.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ uint2 ld_stream2(const uint2* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
