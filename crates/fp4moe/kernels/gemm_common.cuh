// What both expert-GEMM paths (expert_gemm.cu for decode, prefill_gemm.cu for prefill) share:
// the parameter block, the exact NVFP4 → bf16 fragment dequantization and the epilogues.
//
//   GEMM1: h = a · deq(w13_e)^T · alpha,   alpha = scale_2(shard) · act_alpha (1/gs1 in W4A4)
//          g = act(h_gate, h_up) (gated) or act(h) (non-gated; ReLU²: alpha before squaring);
//          W4A4: g goes through the NVFP4 QDQ of DESIGN 1.2 with global scale gs_out, its 16-blocks
//          being the 16 rows of one warp's row group, and is stored as the exact bf16 e2m1 · S.
//   GEMM2: o[pair] = bf16(g · deq(w2_e)^T · alpha · router weight) (rsf included): the f32 product
//          rounded once, as vLLM's, SGLang's and TensorRT-LLM's fused MoE store their per-pair
//          outputs; the combine sums them in f32 in slot order (half the bytes of f32 pairs,
//          written here and read there: T·k·H·2 each way).
//
// Accumulator fragments (both paths): acc[s][c] holds rows 16·rg + g (c = 0, 1) and g + 8 (c = 2, 3)
// of column (token) 8s + 2q + (c & 1) of the tile, g = lane / 4, q = lane % 4: the mma.sync D
// fragment of column tile s, which is also what wgmma.m64nN leaves in each warp.
#pragma once
#include "common.cuh"

struct GemmParams {
    const u8* wdata;
    const u8* wscales;
    const float* wscale2;
    const __nv_bfloat16* act;
    const int* offsets;
    const int* sorted;
    const int* active;
    const int* num_active;
    __nv_bfloat16* g_out;
    const float* topk_w;
    __nv_bfloat16* o_out;  // GEMM2: each pair's weighted output, rounded once to bf16
    int* ready;      // null, or [2·experts] counters of the expert-ready handoff (expert_ready_wait)
    int rg_out;      // output row groups: I/16 (GEMM1) or H/16 (GEMM2)
    int rg_w;        // weight row groups per expert
    int kg;          // 64-wide k groups (padded K / 64)
    int k;           // valid K (also the row stride of `act`)
    int shards;      // scale_2 values per expert
    int top_k;       // > 0: activation row = sorted pair / top_k (GEMM1); 0: row = sorted position
    int activation;
    int out_stride;  // row length of g_out / o_out
    float act_alpha;
    float gs_out;    // GEMM1 W4A4: global scale of the intermediate QDQ; 0: store bf16(g)
    int tile_rows;   // expert_stream.cu: activation rows per pass (the rows its shared memory holds)
    int experts;     // experts `offsets` covers (offsets[0] .. offsets[experts]; prefill_gemm.cu's find_tile)
    int wait_blocks; // GEMM2: > 0 waits for GEMM1's blocks of its expert on `ready` instead of pdl_wait
    int wait_nt;     // GEMM1's token tile (prefill: wait_blocks per tile of its expert), 0: decode
};

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// 16-byte global → shared copy through the async copy engine (cp.async; src_bytes 0: zero-fill).
// `s`: a shared-memory address (smem_u32).
__device__ __forceinline__ void cp_async16_s(u32 s, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    cp_async16_s(smem_u32(smem), gmem, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// mbarriers (sm_90: transaction counts for the bulk copy engine; prefill_gemm.cu, one_token.cu).
// fence_proxy_async orders this thread's generic-proxy shared-memory accesses (cp.async writes
// included) with later async-proxy ones (wgmma reads, bulk-copy writes).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Four 8x8 bf16 matrices from shared address `s` (ldmatrix .x4): lane l gives the address of row
// l % 8 of matrix l / 8 (16 bytes, 16-byte aligned) and receives, of each matrix i, row l / 4,
// elements 2(l % 4) and 2(l % 4) + 1 in r[i]: with rows = tokens and 8 consecutive k per row,
// an mma B fragment register. `volatile` and the "memory" clobber keep it between the
// __syncthreads that publish and retire the data (a non-volatile asm without memory operands
// counts as pure and was hoisted out of a loop with barriers; the clobber is what the inline-PTX
// guide names for memory ordering).
__device__ __forceinline__ void ldsm_x4(u32 r[4], u32 s) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
}
// The same for two matrices (lanes 0-15 give the addresses; r[0], r[1]).
__device__ __forceinline__ void ldsm_x2(u32 r[2], u32 s) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(s) : "memory");
}
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Spins until the phase of parity `parity` of `bar` has completed. CLUSTER: acquire at cluster
// scope, for arrivals from the other CTA of a cluster; else at CTA scope (a cluster-scope
// acquire invalidates L1 on every wait: `CCTL.IVALL`, 2 % of the one-CTA kernel's warp
// samples in run 43).
template <bool CLUSTER>
__device__ __forceinline__ void mbar_wait_s(u32 bar, u32 parity) {
    u32 done;
    do {
        if constexpr (CLUSTER)
            asm volatile(
                "{\n.reg .pred p;\n"
                "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                "selp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(done)
                : "r"(bar), "r"(parity)
                : "memory");
        else
            asm volatile(
                "{\n.reg .pred p;\n"
                "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
                "selp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(done)
                : "r"(bar), "r"(parity)
                : "memory");
    } while (!done);
}
template <bool CLUSTER>
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    mbar_wait_s<CLUSTER>(smem_u32(bar), parity);
}

// Expert-ready handoff between the routed GEMMs (p.ready non-null, sm_90 with programmatic
// launches; the decode kernels of expert_gemm.cu and the prefill tiles of prefill_gemm.cu):
// GEMM2's blocks launch once every GEMM1 block has started, and instead of pdl_wait (all of GEMM1
// finished) each waits only for its own expert's rows. ready[e] counts the GEMM1 blocks of
// expert e that have stored their rows (block barrier, fence, add: the pattern of cooperative
// groups' grid sync); a GEMM2 block of expert e proceeds when it reaches GEMM1's blocks of e
// (expert_ready_wait), so GEMM2 fills the SMs GEMM1's last partial wave leaves idle. The last
// GEMM2 block of e through the wait (ready[experts + e] counts them against `consumers`, GEMM2's
// blocks of e) zeroes both counters for the next forward: every GEMM1 add of e came before, and
// the next forward's GEMM1 runs after this GEMM2 has finished (every launch in between waits for
// its predecessor). No deadlock: every GEMM1 block has started (and passed its own wait) before
// any GEMM2 block launches. After the acquire and the block barrier a proxy fence in every
// thread orders the TMA reads of GEMM1's rows (prefill; the async proxy) after it. Before the
// wait GEMM2 reads routing's outputs only (the grouping; the prefill tiles also the router
// weights), through L2 (the routing that wrote them finished before GEMM1's blocks passed their
// wait), and the prefill tiles request their first weights (constant); the prefill GEMM2 waits
// the same way off the handoff (pdl_wait in the tile, gemm_enter's DEFER). Block (0, 0)'s
// thread 0 still calls pdl_wait before it exits (gemm_exit), so GEMM2's completion implies
// GEMM1's (the chain common.cuh's pdl_launch_dependents relies on): GEMM1's blocks of inactive
// slots or tiles read the grouping after they let GEMM2 launch, and the next forward's routing
// rewrites it. A count past the target, or a wait beyond EXPERT_READY_TIMEOUT_NS (a counter left
// behind by a forward that failed between the two launches), traps instead of racing or hanging.
#define EXPERT_READY_TIMEOUT_NS 2000000000ull
__device__ __forceinline__ void expert_ready_signal(const GemmParams& p, int e) {
    __syncthreads();  // every warp of the block has stored its rows
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(p.ready + e, 1);
    }
}
// Waits for GEMM1's blocks of expert e (n_e rows): wait_blocks per token tile of wait_nt rows
// (prefill tiles), or wait_blocks (wait_nt 0: a decode block covers all of its expert's rows).
__device__ __forceinline__ void expert_ready_wait(const GemmParams& p, int e, int n_e, int consumers) {
    if (threadIdx.x == 0) {
        const int target = p.wait_nt > 0 ? p.wait_blocks * ((n_e + p.wait_nt - 1) / p.wait_nt) : p.wait_blocks;
        const unsigned long long t0 = global_ns();
        for (;;) {
            int c;
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(c) : "l"(p.ready + e) : "memory");
            if (c == target) break;
            if (c > target) __trap();
            if (global_ns() - t0 > EXPERT_READY_TIMEOUT_NS) __trap();
            __nanosleep(100);
        }
        if (atomicAdd(p.ready + p.experts + e, 1) == consumers - 1) {
            p.ready[e] = 0;
            p.ready[p.experts + e] = 0;
        }
    }
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    // In every thread: any of them may issue the block's TMA copies (the 32-token prefill tiles
    // rotate the issuing warp).
    asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
}
// A GEMM kernel's first and last statements: GEMM2 on the handoff skips pdl_wait (each block
// waits for its expert instead) and block (0, 0) waits at exit (see above). DEFER (the prefill
// tiles): GEMM2 always waits in the tile, after requesting its first weights (pdl_wait off the
// handoff), so block (0, 0) also waits at exit, for a grid with no tile.
template <int STAGE, bool DEFER = false>
__device__ __forceinline__ void gemm_enter(const GemmParams& p) {
    if (STAGE == 1 || (!DEFER && p.wait_blocks == 0)) pdl_wait();
    pdl_launch_dependents();
}
template <int STAGE, bool DEFER = false>
__device__ __forceinline__ void gemm_exit(const GemmParams& p) {
    if (STAGE == 2 && (DEFER || p.wait_blocks > 0) && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
        pdl_wait();
}

// Exact NVFP4 → bf16 dequantization in registers, without tables (shared-memory lookups cost
// bank cycles the tensor cores and the activation staging need). An E2M1 code s·e1e0m placed in bf16 bits 15 and 8..6 reads
// as its value times 2^-126 (bf16 subnormal for code 1, which bf16 arithmetic keeps); the block
// scale enters as S' = S · 2^118, so each product is e2m1 · S · 2^-8, exact and normal in bf16.
// The epilogue multiplies by NVFP4_DEQ_UNSCALE = 2^8 (a power of two: the f32 sums are the same
// bits scaled, so results equal the unscaled ones unless a product a·w falls below 2^-118,
// where f32 turns subnormal).
#define NVFP4_DEQ_UNSCALE 256.0f

// bf16x2 of A-fragment register i's two codes, times 2^-126 (cuda/pack.rs, CODE_BITS): register
// 0's bits already sit at their bf16 places (m e0 e1 at 6..8, s at 15; +16 for the odd-k code),
// register 1's 3 lower, so a mask (and a shift, which ptxas issues as an integer multiply on the
// FMA pipe) gives them; registers 2 and 3 (the latter in the word shifted right by 8) carry
// magnitude and sign at different distances below their places, so one multiply by
// 2^mag + 2^sign puts two copies of the kept bits in the word, without overlap (no carries),
// and the mask keeps the right ones. Seven logic / shift operations and three multiplies per
// fragment; the nibble-planar layout before run 144 took nine and four (a multiply per register).
// The shift of register 3 as a high multiply (__umulhi by 2^24: IMAD.HI on the FMA pipe instead
// of SHF on the ALU one) was 1-10 % slower at 2-4096 tokens (run 146).
#define E2M1_BF16_MASK 0x81C081C0u
template <int I>
__device__ __forceinline__ u32 e2m1x2_scaled_bits(u32 w) {
    if (I == 0) return w & E2M1_BF16_MASK;
    if (I == 1) return (w * 8u) & E2M1_BF16_MASK;
    if (I == 2) return ((w & 0x40074007u) * ((1u << 6) | (1u << 1))) & E2M1_BF16_MASK;
    return (((w >> 8) & 0x002E002Eu) * ((1u << 5) | (1u << 10))) & E2M1_BF16_MASK;
}

// (S'_g, S'_g+8) = the block scales of rows g and g + 8 times 2^118 as a bf16 pair, for k block
// j of the lane's eight scale codes `s` (cuda/pack.rs scale_word: block j's codes at bits 4..12
// and 20..28 of word j / 2, rotated left by 8 for an odd j; each code re-encoded at upload so
// that its bf16 bits are the code times 16 OR constant bits): a mask and an OR, after a rotate
// for an odd block (a byte permute and a multiply-add before run 148; the E4M3 conversion they
// replaced took ~9 operations per two scales).
#define SCALE_PAIR_OR 0x70007000u
__device__ __forceinline__ u32 scale_pairs(uint2 s, int j) {
    const u32 w = j < 2 ? s.x : s.y;
    const u32 v = (j & 1) ? __funnelshift_r(w, w, 8) : w;
    // One three-input logic operation, (v & mask) | bits: written as lop3 so that ptxas keeps one
    // of its two constants in a register (from `&` and `|` it emitted two LOP3s, each with an
    // immediate).
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "n"(0x0FF00FF0u), "r"(SCALE_PAIR_OR));
    return r;
}

// One mma A fragment (16 rows x 16 k) times 2^-8: `word` is the lane's packed word for its k
// block (see cuda/pack.rs), s0 / s1 = the scales of rows g / g + 8 (registers 0 and 2 hold
// row g, 1 and 3 row g + 8) in both halves.
__device__ __forceinline__ void dequant_fragment_alu(u32 word, __nv_bfloat162 s0, __nv_bfloat162 s1, u32 a[4]) {
    a[0] = bf16x2_bits(__hmul2(bits_bf16x2(e2m1x2_scaled_bits<0>(word)), s0));
    a[1] = bf16x2_bits(__hmul2(bits_bf16x2(e2m1x2_scaled_bits<1>(word)), s1));
    a[2] = bf16x2_bits(__hmul2(bits_bf16x2(e2m1x2_scaled_bits<2>(word)), s0));
    a[3] = bf16x2_bits(__hmul2(bits_bf16x2(e2m1x2_scaled_bits<3>(word)), s1));
}

// The same from `sp` = scale_pairs of the block: each multiply takes its row's half of `sp`
// broadcast, which the bf16 multiply encodes as an operand swizzle (HMUL2 ... .H0_H0 /
// .H1_H1), so the scales cost two operations per fragment where a pair per row took four.
// Every table-free kernel uses it. The decode kernels took a pair per row until run 127 (this
// form 2.5-3.5 % faster at Nemotron 4-48 tokens; run 81 had measured it 8 % slower, before the
// decode GEMMs stopped rebuilding their shared window base) and run 129 (the streaming kernels
// and one_token: Nemotron one token -2.5 %, Qwen3 +0.6 %).
__device__ __forceinline__ void dequant_fragment_alu(u32 word, u32 sp, u32 a[4]) {
    const __nv_bfloat162 s = bits_bf16x2(sp);
    dequant_fragment_alu(word, __low2bfloat162(s), __high2bfloat162(s), a);
}

// GEMM1 epilogue of one warp: row group rg of expert e (gated: acc = gate, accu = up rows), the
// tile's first token t0 of the expert's n_e, column tiles s < nsub_valid.
// `unscale`: 1, or NVFP4_DEQ_UNSCALE after dequant_fragment_alu.
template <int NSUB, bool GATED>
__device__ __forceinline__ void store_gemm1(const GemmParams& p, const float (&acc)[NSUB][4],
                                            const float (&accu)[NSUB][4], int e, int base, int n_e,
                                            int t0, int rg, int nsub_valid, float unscale) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    float alpha_g = p.wscale2[e * p.shards] * p.act_alpha * unscale;
    float alpha_u = GATED ? p.wscale2[e * p.shards + 1] * p.act_alpha * unscale : 0.0f;
    const float inv_gs = p.gs_out > 0.0f ? 1.0f / p.gs_out : 0.0f;
#pragma unroll
    for (int s = 0; s < NSUB; s++) {
        if (s >= nsub_valid) continue;  // warp-uniform
#pragma unroll
        for (int c = 0; c < 2; c++) {
            float v0 = apply_activation(p.activation, acc[s][c] * alpha_g, GATED ? accu[s][c] * alpha_u : 0.0f);
            float v1 = apply_activation(p.activation, acc[s][2 + c] * alpha_g, GATED ? accu[s][2 + c] * alpha_u : 0.0f);
            if (p.gs_out > 0.0f) {
                // The 16 rows g of the block: 2 values in each of the 8 lanes of this q.
                float v[2] = {v0, v1};
                nvfp4_qdq_block<2, 4, 8>(v, p.gs_out, inv_gs);
                v0 = v[0];
                v1 = v[1];
            }
            int lt = t0 + s * 8 + 2 * q + c;
            if (lt < n_e) {
                __nv_bfloat16* out = p.g_out + (size_t)(base + lt) * p.out_stride + rg * 16 + g;
                out[0] = __float2bfloat16_rn(v0);
                out[8] = __float2bfloat16_rn(v1);
            }
        }
    }
}

// GEMM2 epilogue of one warp: o[pair, 16·rg + {g, g+8}] = bf16(acc · alpha · router weight).
template <int NSUB>
__device__ __forceinline__ void store_gemm2(const GemmParams& p, const float (&acc)[NSUB][4], int e,
                                            int base, int n_e, int t0, int rg, int nsub_valid,
                                            float unscale) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    float alpha = p.wscale2[e * p.shards] * p.act_alpha * unscale;
#pragma unroll
    for (int s = 0; s < NSUB; s++) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            int lt = t0 + s * 8 + 2 * q + c;
            if (s < nsub_valid && lt < n_e) {
                int pair = p.sorted[base + lt];
                float w = p.topk_w[pair] * alpha;
                __nv_bfloat16* out = p.o_out + (size_t)pair * p.out_stride + rg * 16 + g;
                out[0] = __float2bfloat16_rn(acc[s][c] * w);
                out[8] = __float2bfloat16_rn(acc[s][2 + c] * w);
            }
        }
    }
}
