// Expert GEMMs of the decode path (T <= a few hundred tokens): mma.sync m16n8k16 bf16 with the
// NVFP4 weights dequantized in registers, exactly (e2m1 · E4M3 has at most 6 significant bits).
//
// Work split: grid.y walks the active experts (slot s < num_active, expert active[s]); grid.x
// the output row groups, RGPB per block, each split over KSPLIT warps along K. A block stages NT = 8·NSUB of its
// expert's activation rows (bf16, k padded to 64, rows padded by 8 elements against bank
// conflicts) in shared memory and each warp streams its weight rows once per token tile (formulas
// and epilogues: gemm_common.cuh). Gated, a warp owns gate rows [16r, 16r+16) and up
// rows I + [16r, 16r+16), so g = act(h_gate) · h_up never leaves registers.
//
// Prepared weight layout (crates/fp4moe/src/cuda/pack.rs), per expert, row group rg and 64-wide k
// group kg: NVFP4 data 32 lanes x 16 bytes (lane L = 4g + q, bytes 4j..4j+3 for k block j:
// rows g, g+8 at k 2q..2q+1 and rows g, g+8 at k 2q+8..2q+9, i.e. the mma A fragment) and scales
// 8 x 8 bytes (byte 2j row g's code of k block j, 2j + 1 row g+8's). BF16 weights: per 16-wide k block, 32 lanes x the
// four A-fragment registers.
#include "gemm_common.cuh"

// Block shape: RGPB row groups x KSPLIT slices of K, one warp each (NWARPS = 16, or 8 for the
// 32-token variants so their accumulators fit in registers); the KSPLIT partial accumulators
// are summed in shared memory in a fixed order (deterministic). Four shapes: narrow (few row
// groups, many K slices: many blocks; since run 131 only for one expert at 1-2 tokens), wide
// (one activation staging serves 64 or 128 weight rows), deep (one subtile: one warp per row
// group runs both of the wide K slices into separate sums, no exchange) and half (one subtile:
// 4 row groups x the wide K slices in 8 warps). Which runs when: cuda/gemm_plan.rs.

// The B fragments of two consecutive 16-wide k blocks (j, j + 1) of every subtile, one
// ldmatrix.x4 each: b[s] = {b0, b1 of block j, b0, b1 of block j + 1} of subtile s, from shared
// address `bl_s` (this lane's ldmatrix row: token l % 8, k 8·(l / 8) of block j) + s · sub_bytes.
// Four 32-bit loads per subtile and block pair took four instructions where this takes one
// (1.5 of the ~22 a fragment cost at one subtile). Rows are 16 bytes past a 128-byte multiple
// apart (the staging's padding), so each 8-row matrix reads all 32 banks once. Subtile 0 always
// holds a token (t0 < n_e), so only the later ones are guarded.
// PAIR false: k block j only (ldmatrix.x2 into b[s][0..1]; the bf16-weight kernels, whose
// weight registers leave no room for a second block's B fragments).
template <int NSUB, bool PAIR = true>
__device__ __forceinline__ void load_b_pair(u32 (&b)[NSUB][4], u32 bl_s, int sub_bytes, int nsub_valid) {
#pragma unroll
    for (int s = 0; s < NSUB; s++) {
        if (s == 0 || s < nsub_valid) {
            if (PAIR) ldsm_x4(b[s], bl_s + s * sub_bytes);
            else ldsm_x2(b[s], bl_s + s * sub_bytes);
        }
    }
}

// acc[s] += A · B(subtile s) for k block j2 (0 or 1) of the pair in `b`.
template <int NSUB>
__device__ __forceinline__ void mma_subtiles(float acc[NSUB][4], const u32 a[4], const u32 (&b)[NSUB][4], int j2,
                                             int nsub_valid) {
#pragma unroll
    for (int s = 0; s < NSUB; s++)
        if (s == 0 || s < nsub_valid) mma_bf16_16816(acc[s], a, b[s][2 * j2], b[s][2 * j2 + 1]);
}

// The A fragment of k block j of a 64-wide group: packed word w, the lane's eight scale codes s
// (byte 2j: row g, 2j + 1: row g + 8), dequantized in registers without tables (products carry
// 2^-8, undone in the epilogue). Shared-memory tables are gone: their lookups kept the L1/shared
// pipe 64 % busy at T = 1 (KERNEL_NOTES run 23), without them the wide two-subtile GEMMs took
// 37-39 % less time (run 128, Nemotron, 64-256 tokens), and the four-subtile and narrow
// two-subtile kernels, run only when forced, read them until run 144.
__device__ __forceinline__ void decode_fragment(u32 w, uint2 s, int j, u32 a[4]) {
    dequant_fragment_alu(w, scale_pairs(s, j), a);  // both rows' scales in one swizzled pair
}

// One 64-wide k group of NVFP4 weights against the staged activations.
template <int NSUB, bool GATED>
__device__ __forceinline__ void nvfp4_kgroup(uint4 d, uint2 s, uint4 du, uint2 su, int kgi, float acc[NSUB][4],
                                             float accu[NSUB][4], u32 b_s, int sub_bytes, int nsub_valid) {
    const u32 dw[4] = {d.x, d.y, d.z, d.w};
    const u32 duw[4] = {du.x, du.y, du.z, du.w};
#pragma unroll
    for (int jp = 0; jp < 4; jp += 2) {
        u32 b[NSUB][4];
        load_b_pair<NSUB>(b, b_s + (kgi * 4 + jp) * 32, sub_bytes, nsub_valid);  // k blocks kgi·4 + jp, + 1
#pragma unroll
        for (int j2 = 0; j2 < 2; j2++) {
            u32 a[4];
            decode_fragment(dw[jp + j2], s, jp + j2, a);
            mma_subtiles<NSUB>(acc, a, b, j2, nsub_valid);
            if (GATED) {
                decode_fragment(duw[jp + j2], su, jp + j2, a);
                mma_subtiles<NSUB>(accu, a, b, j2, nsub_valid);
            }
        }
    }
}

// KIND 0: NVFP4 weights, 1: bf16 weights. STAGE 1: GEMM1 + activation, 2: GEMM2.
// VS: K slices per warp. The deep shape (VS 2) runs a wide block's two K slices of a row group in
// one warp, each into its own accumulators added at the end as the wide block's reduction adds
// them (the same bits), with half the warps per block and four blocks per SM.
// DEPTH: k groups of weights in flight per warp (the register pipeline of gemm_body).
// BX: the block's place along the row groups (row groups BX·RGPB ..).
template <int KIND, int STAGE, bool GATED, int NSUB, int RGPB, int NWARPS, int VS, int DEPTH>
__device__ __forceinline__ void gemm_body(const GemmParams& p, int bx) {
    constexpr int KSPLIT = NWARPS / RGPB;
    constexpr int NT = 8 * NSUB;
    constexpr int NACC = NSUB * 4 * (GATED ? 2 : 1);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* sact = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    float* red = reinterpret_cast<float*>(sact);  // reused for the split-K sums after the MMAs

    // GEMM2 may run on the expert-ready handoff, without pdl_wait: it reads the grouping through
    // L2 (the routing that wrote it finished before GEMM1's blocks passed their wait). GEMM1 keeps
    // plain loads. (A runtime choice in GEMM2 spilled the narrow two-subtile GEMM2 on sm_80.)
    constexpr bool via_l2 = STAGE == 2;
    int slot = blockIdx.y;
    if (slot >= (via_l2 ? __ldcg(p.num_active) : p.num_active[0])) return;
    int e = via_l2 ? __ldcg(p.active + slot) : p.active[slot];
    int base = via_l2 ? __ldcg(p.offsets + e) : p.offsets[e];
    int n_e = (via_l2 ? __ldcg(p.offsets + e + 1) : p.offsets[e + 1]) - base;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    int rgl = warp % RGPB, ks = warp / RGPB;
    int rg = bx * RGPB + rgl;
    bool active_warp = rg < p.rg_out;
    int per = (p.kg + KSPLIT * VS - 1) / (KSPLIT * VS);
    int k_lo = min(ks * VS * per, p.kg), k_hi = min(k_lo + VS * per, p.kg);
    const int mid = min(k_lo + per, k_hi);  // VS 2: the second slice's first k group

    const int kp = p.kg * 64;
    const int stride = kp + 8;
    // The lane's ldmatrix row (load_b_pair: token lane % 8, k 8·(lane / 8)) as a 32-bit shared
    // address, made opaque so ptxas keeps it in a register: otherwise it rebuilt the shared
    // window base from SR_CgaCtaId before every fragment load (8 times per loop iteration of
    // the one-subtile kernels).
    u32 bl_s = smem_u32(sact + (lane & 7) * stride + (lane >> 3) * 8);
    asm volatile("" : "+r"(bl_s));
    const int sub_bytes = 8 * stride * 2;
    const u32 sact_s = smem_u32(sact);
    const bool run = active_warp && k_lo < k_hi;
    const size_t wrow = (size_t)e * p.rg_w + rg;
    const size_t wrow_up = wrow + p.rg_out;
    // NVFP4: loads through running pointers at k group kgi (advanced by DEPTH groups per
    // iteration, the next DEPTH groups' loads at immediate offsets), made opaque so ptxas keeps
    // them in registers: under the 64-register cap it rebuilt each load's 64-bit address from
    // the kernel parameters (an LDC.64 and ~5 integer operations per load; run 133: Nemotron
    // 2-64 tokens -2.6 to -3.8 %, Qwen3 2-16 tokens -6.4 to -7.3 %). Each slice sets them from
    // the weight row, itself made opaque there, so that ptxas rebuilds them (a few integer
    // operations per slice) instead of keeping four 64-bit bases live through the k loop: at
    // three blocks per SM (80 registers) the gated deep kernels spilled them.
    const uint4 *wd, *wdu;
    const uint2 *ws, *wsu;
    const u32 wrow32 = (u32)wrow;
    auto set_ptrs = [&](int lo) {
        u32 r = wrow32;
        asm volatile("" : "+r"(r));
        const size_t rk = (size_t)r * p.kg + lo;
        wd = reinterpret_cast<const uint4*>(p.wdata) + rk * 32 + lane;
        ws = reinterpret_cast<const uint2*>(p.wscales) + rk * 8 + g;
        asm volatile("" : "+l"(wd), "+l"(ws));
        if (GATED) {
            const size_t ru = rk + (size_t)p.rg_out * p.kg;
            wdu = reinterpret_cast<const uint4*>(p.wdata) + ru * 32 + lane;
            wsu = reinterpret_cast<const uint2*>(p.wscales) + ru * 8 + g;
            asm volatile("" : "+l"(wdu), "+l"(wsu));
        }
    };
    auto step_ptrs = [&]() {
        wd += DEPTH * 32;
        ws += DEPTH * 8;
        asm volatile("" : "+l"(wd), "+l"(ws));
        if (GATED) {
            wdu += DEPTH * 32;
            wsu += DEPTH * 8;
            asm volatile("" : "+l"(wdu), "+l"(wsu));
        }
    };
    for (int t0 = 0; t0 < n_e; t0 += NT) {
        __syncthreads();
        int nvalid = min(NT, n_e - t0);
        int nsub_valid = (nvalid + 7) / 8;

        if (KIND == 0 && run) set_ptrs(k_lo);
        // Software pipeline, DEPTH k groups deep: a group's registers are refilled with the group
        // DEPTH ahead as soon as its MMAs are issued. Buffer arrays indexed only by constants
        // (unrolled loops, compile-time rotations), so they live in registers.
        uint4 dq[DEPTH], duq[DEPTH];
        uint2 sq[DEPTH], suq[DEPTH];
#pragma unroll
        for (int i = 0; i < DEPTH; i++) {
            dq[i] = duq[i] = make_uint4(0, 0, 0, 0);
            sq[i] = suq[i] = make_uint2(0, 0);
        }
        // k group kgi = (the iteration's first group) + i, into buffer b.
        auto load = [&](int i, int b) {
            dq[b] = ld_stream(wd + i * 32);
            sq[b] = ld_stream2(ws + i * 8);
            if (GATED) {
                duq[b] = ld_stream(wdu + i * 32);
                suq[b] = ld_stream2(wsu + i * 8);
            }
        };
        // The first DEPTH k groups' weights are requested before the activations are staged:
        // they do not depend on them, and their DRAM latency then overlaps the staging's.
        if (KIND == 0 && run) {
#pragma unroll
            for (int i = 0; i < DEPTH; i++)
                if (i == 0 || k_lo + i < k_hi) load(i, i);
        }

        if (STAGE == 2 && p.wait_blocks > 0 && t0 == 0)
            expert_ready_wait(p, e, n_e, gridDim.x);

        // Activation staging by cp.async (zero-fill past K and for the tile's empty rows), so
        // every piece of a lane is in flight at once: plain loads and stores took one L2 round
        // trip per four pieces (run 133, with the early weight requests above: a further -3.4
        // to -4.4 % at Nemotron 2-64 tokens, -1 to -2.3 % at Qwen3 2-16). A warp per row (its
        // source row resolved once), lanes over the row's 16-byte pieces.
        const int chunks = kp / 8;
        for (int r = warp; r < nsub_valid * 8; r += NWARPS) {
            int arow = -1;
            if (r < nvalid) arow = (STAGE == 1 && p.top_k > 0) ? p.sorted[base + t0 + r] / p.top_k : base + t0 + r;
            const __nv_bfloat16* src = p.act + (size_t)(arow < 0 ? 0 : arow) * p.k;
            const u32 dst = sact_s + (u32)(r * stride) * 2u;
            for (int c8 = lane; c8 < chunks; c8 += 32) {
                const bool ok = arow >= 0 && c8 * 8 < p.k;
                cp_async16_s(dst + c8 * 16, ok ? (const void*)(src + c8 * 8) : (const void*)p.act, ok ? 16 : 0);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float acc[NSUB][4], accu[NSUB][4], acc1[NSUB][4], accu1[NSUB][4];
#pragma unroll
        for (int s = 0; s < NSUB; s++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[s][c] = accu[s][c] = acc1[s][c] = accu1[s][c] = 0.0f;

        // k groups [lo, hi) into (A, AU), group lo in buffer `rot`, lo + i in (rot + i) % DEPTH;
        // loads run ahead to k_hi, so the next slice starts with its first DEPTH groups in
        // flight. The loop is spelled once per rotation (a macro: NVRTC compiles no generic
        // lambdas), so every buffer index is a constant.
#define DECODE_PHASE_LOOP(ROT)                                                                          \
    for (int kgi = lo; kgi < hi; kgi += DEPTH) {                                                        \
        _Pragma("unroll") for (int i = 0; i < DEPTH; i++) {                                             \
            const int b = ((ROT) + i) % DEPTH;                                                          \
            if (i == 0 || kgi + i < hi) {                                                               \
                nvfp4_kgroup<NSUB, GATED>(dq[b], sq[b], duq[b], suq[b], kgi + i, A, AU, bl_s, sub_bytes, \
                                          nsub_valid);                                                  \
                if (kgi + i + DEPTH < k_hi) load(DEPTH + i, b);                                         \
            }                                                                                           \
        }                                                                                               \
        step_ptrs();                                                                                    \
    }
        auto phase = [&](float (&A)[NSUB][4], float (&AU)[NSUB][4], int lo, int hi, int rot) {
            set_ptrs(lo);
            static_assert(DEPTH >= 2 && DEPTH <= 4, "one loop per rotation below");
            if (rot == 0) {
                DECODE_PHASE_LOOP(0)
            } else if (DEPTH < 3 || rot == 1) {
                DECODE_PHASE_LOOP(1)
            } else if (DEPTH < 4 || rot == 2) {
                DECODE_PHASE_LOOP(2)
            } else {
                DECODE_PHASE_LOOP(3)
            }
        };
#undef DECODE_PHASE_LOOP
        auto bf16_slice = [&](float (&A)[NSUB][4], float (&AU)[NSUB][4], int lo, int hi) {
            const int kb_n = kp / 16;
            const uint4* bd = reinterpret_cast<const uint4*>(p.wdata) + wrow * kb_n * 32 + lane;
            const uint4* bdu = reinterpret_cast<const uint4*>(p.wdata) + wrow_up * kb_n * 32 + lane;
            for (int kb = 4 * lo; kb < 4 * hi; kb++) {
                uint4 d = ld_stream(bd + kb * 32);
                const u32 a[4] = {d.x, d.y, d.z, d.w};
                u32 b[NSUB][4];
                load_b_pair<NSUB, false>(b, bl_s + kb * 32, sub_bytes, nsub_valid);
                mma_subtiles<NSUB>(A, a, b, 0, nsub_valid);
                if (GATED) {
                    uint4 du = ld_stream(bdu + kb * 32);
                    const u32 au[4] = {du.x, du.y, du.z, du.w};
                    mma_subtiles<NSUB>(AU, au, b, 0, nsub_valid);
                }
            }
        };
        if (run) {
            if (KIND == 0) {
                phase(acc, accu, k_lo, VS == 1 ? k_hi : mid, 0);
                // The second slice's first group is in the buffer after the first slice's last.
                if (VS == 2) phase(acc1, accu1, mid, k_hi, (mid - k_lo) % DEPTH);
            } else {
                bf16_slice(acc, accu, k_lo, mid);
                if (VS == 2) bf16_slice(acc1, accu1, mid, k_hi);
            }
        }
        if (VS == 2) {
            // The wide block's reduction: slice 0's sums plus slice 1's, in that order.
#pragma unroll
            for (int s = 0; s < NSUB; s++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    acc[s][c] += acc1[s][c];
                    if (GATED) accu[s][c] += accu1[s][c];
                }
        }

        // Split-K reduction: slices 1..KSPLIT-1 park their sums, slice 0 adds them in order (one
        // slice: nothing to exchange; the next tile's barrier protects sact).
        if (KSPLIT > 1) __syncthreads();  // every warp is done reading sact
        if (ks > 0) {
            float* dst = red + (((ks - 1) * RGPB + rgl) * 32 + lane) * NACC;
#pragma unroll
            for (int s = 0; s < NSUB; s++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    dst[s * 4 + c] = acc[s][c];
                    if (GATED) dst[NSUB * 4 + s * 4 + c] = accu[s][c];
                }
        }
        if (KSPLIT > 1) __syncthreads();
        if (ks != 0 || !active_warp) continue;
#pragma unroll
        for (int o = 1; o < KSPLIT; o++) {
            const float* src = red + (((o - 1) * RGPB + rgl) * 32 + lane) * NACC;
#pragma unroll
            for (int s = 0; s < NSUB; s++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    acc[s][c] += src[s * 4 + c];
                    if (GATED) accu[s][c] += src[NSUB * 4 + s * 4 + c];
                }
        }

        const float unscale = KIND == 0 ? NVFP4_DEQ_UNSCALE : 1.0f;
        if (STAGE == 1)
            store_gemm1<NSUB, GATED>(p, acc, accu, e, base, n_e, t0, rg, nsub_valid, unscale);
        else
            store_gemm2<NSUB>(p, acc, e, base, n_e, t0, rg, nsub_valid, unscale);
    }
    if (STAGE == 1 && p.ready) expert_ready_signal(p, e);
}

// Non-gated variants are held to 64 registers (two 16-warp blocks per SM, four 8-warp deep ones):
// occupancy is what keeps enough weight bytes in flight. The gated deep kernels are held to 80
// (three blocks per SM): at two, Qwen3's GEMM1 grid at 8 tokens (~50 experts x 6 blocks) was
// 1.14 waves, the last a lone latency chain per warp (KERNEL_NOTES run 170: Qwen3 8-96 tokens
// 3-5.7 % faster; 4-6 tokens, under one wave either way, 2 % slower). The other gated and the
// bf16 (shared expert) kernels need more room, and so does the narrow two-subtile shape (it
// spilled under the cap; it runs only when forced).
#define NARROW_ROOM(NSUB, RG) (NSUB == 2 && RG == 2)
// The half shape (one subtile, 8 warps: 4 row groups x the wide shape's 2 K slices, so the wide
// shape's bits) takes the deep shape's register budget: three gated blocks per SM, four others.
#define HALF_SHAPE(NSUB, NW) (NSUB == 1 && NW == 8)
// k groups in flight per warp: three in the non-gated kernels (a gated layer's GEMM2 included),
// deep (KERNEL_NOTES run 173: their last wave is a lone chain per warp; Nemotron 6-96 tokens
// 1.5-4.7 % faster), wide and narrow (run 176: Nemotron 3-4 tokens -2.5 %, 112-120 tokens -1.7
// to -2.1 %; Qwen3 2-3 tokens, whose GEMM2 runs them, level); two in the gated ones
// (wide at three: Qwen3 2 tokens +1.9 %, run 176; deep: a third spills at three blocks per SM,
// and two blocks with three groups made Qwen3 8-96 tokens 3-6 % slower, run 175). The half
// kernels (VS 1) take the wide depths (a third group in the gated half kernel fits its 80
// registers and was within ±1.3 % of two at Qwen3 3-32 tokens, run 183). Defines, so that
// FP4MOE_DEFINES variants time the alternatives.
#ifndef DECODE_DEEP_DEPTH
#define DECODE_DEEP_DEPTH 3
#endif
#ifndef DECODE_WIDE_DEPTH
#define DECODE_WIDE_DEPTH 3
#endif
#ifndef DECODE_GATED_WIDE_DEPTH
#define DECODE_GATED_WIDE_DEPTH 2
#endif
#define DECODE_DEPTH(GATED, VS) \
    (VS == 2 ? (GATED ? 2 : DECODE_DEEP_DEPTH) : (GATED ? DECODE_GATED_WIDE_DEPTH : DECODE_WIDE_DEPTH))
// Blocks per SM (launch bounds) of a shape: two deep bf16 blocks, three gated deep or half
// ones (80 registers), four other deep or half ones (64), else one or two 16-warp blocks.
#define SHAPE_BLOCKS(KIND, GATED, NSUB, RG, NW, VS)                              \
    (VS == 2 ? (KIND == 1 ? 2 : GATED ? 3 : 4)                                   \
             : HALF_SHAPE(NSUB, NW) ? (GATED ? 3 : 4)                            \
                     : ((GATED || NSUB == 4 || KIND == 1 || NARROW_ROOM(NSUB, RG)) ? 1 : 2))
// A deep block whose row groups end within its first half (Nemotron-3 Nano's I = 1856 leaves 4
// of 8 in GEMM1's last block of every expert) runs as a half block instead: its 8 warps take
// those 4 row groups x the 2 K slices, each slice summed by its own warp and the two added in
// the same order as the deep warp adds them, so every output keeps its bits, where 4 of the
// deep block's warps would idle and the other 4 run both slices one after the other. A
// block-uniform choice (no mma.sync under a divergent branch), non-gated NVFP4 kernels only:
// beside the deep body the gated kernels spill at their 80 registers, and bf16 weights have no
// half kernel whose bits the tests compare. DECODE_TAIL_DEPTH: k groups in
// flight per warp there (three spill beside the deep body at 64 registers; each warp's chain is
// half the deep one's). DECODE_TAIL_HALF 0 (for A/B timing through FP4MOE_DEFINES): the deep
// block as it is.
#ifndef DECODE_TAIL_HALF
#define DECODE_TAIL_HALF 1
#endif
#ifndef DECODE_TAIL_DEPTH
#define DECODE_TAIL_DEPTH 2
#endif
template <int KIND, int STAGE, bool GATED, int NSUB, int RG, int NW, int VS>
__device__ __forceinline__ void decode_body(const GemmParams& p) {
    if constexpr (VS == 2 && KIND == 0 && !GATED && DECODE_TAIL_HALF) {
        static_assert(RG % 2 == 0 && NW == RG, "a deep block of one warp per row group");
        if (p.rg_out - (int)blockIdx.x * RG <= RG / 2) {
            // Row groups RG·bx .. RG·bx + RG/2 - 1 are the half shape's block 2·bx.
            gemm_body<KIND, STAGE, GATED, NSUB, RG / 2, NW, 1, DECODE_TAIL_DEPTH>(p, 2 * blockIdx.x);
            return;
        }
    }
    gemm_body<KIND, STAGE, GATED, NSUB, RG, NW, VS, DECODE_DEPTH(GATED, VS)>(p, blockIdx.x);
}
#define INSTANTIATE_ONE(NAME, KIND, STAGE, GATED, NSUB, RG, NW, VS, CFG) \
    INSTANTIATE_BLOCKS(NAME, KIND, STAGE, GATED, NSUB, RG, NW, VS, CFG, SHAPE_BLOCKS(KIND, GATED, NSUB, RG, NW, VS))
#define INSTANTIATE_BLOCKS(NAME, KIND, STAGE, GATED, NSUB, RG, NW, VS, CFG, BLOCKS)             \
    extern "C" __global__ void __launch_bounds__(NW * 32, BLOCKS) NAME##_##CFG##_n##NSUB(const GemmParams p) { \
        gemm_enter<STAGE>(p);                                                                   \
        decode_body<KIND, STAGE, GATED, NSUB, RG, NW, VS>(p);                                  \
        gemm_exit<STAGE>(p);                                                                    \
    }
#define INSTANTIATE(NAME, KIND, STAGE, GATED)                     \
    INSTANTIATE_ONE(NAME, KIND, STAGE, GATED, 1, 2, 16, 1, narrow)   \
    INSTANTIATE_ONE(NAME, KIND, STAGE, GATED, 2, 2, 16, 1, narrow)   \
    INSTANTIATE_ONE(NAME, KIND, STAGE, GATED, 4, 1, 8, 1, narrow)    \
    INSTANTIATE_ONE(NAME, KIND, STAGE, GATED, 1, 8, 16, 1, wide)     \
    INSTANTIATE_ONE(NAME, KIND, STAGE, GATED, 2, 8, 16, 1, wide)     \
    INSTANTIATE_ONE(NAME, KIND, STAGE, GATED, 4, 4, 8, 1, wide)      \
    INSTANTIATE_ONE(NAME, KIND, STAGE, GATED, 1, 8, 8, 2, deep)

INSTANTIATE(gemm1_nvfp4_gated, 0, 1, true)
INSTANTIATE(gemm1_nvfp4_plain, 0, 1, false)
INSTANTIATE(gemm2_nvfp4, 0, 2, false)
// NVFP4 GEMMs where the wide grid is about one wave (Qwen3 at 3 tokens, gated GEMM1: ~23 experts
// x 6 blocks on 132 SMs of one block each): the same K split in blocks half the size.
INSTANTIATE_ONE(gemm1_nvfp4_gated, 0, 1, true, 1, 4, 8, 1, half)
INSTANTIATE_ONE(gemm1_nvfp4_plain, 0, 1, false, 1, 4, 8, 1, half)
INSTANTIATE_ONE(gemm2_nvfp4, 0, 2, false, 1, 4, 8, 1, half)
// The gated half GEMM1 at four blocks per SM (64 registers): 32 warps per SM instead of 24, a
// third more weight bytes in flight (KERNEL_NOTES run 183: Qwen3 5-6 tokens -6 %; at 3 tokens,
// a grid of well under one wave, the three-block kernel's 80 registers win by 5 %). sm_80's
// ptxas spills it at 64 registers (20 / 32 bytes): there it is the three-block kernel.
#if __CUDA_ARCH__ >= 900
#define GATED_HALF4_BLOCKS 4
#else
#define GATED_HALF4_BLOCKS 3
#endif
INSTANTIATE_BLOCKS(gemm1_nvfp4_gated, 0, 1, true, 1, 4, 8, 1, half4, GATED_HALF4_BLOCKS)
INSTANTIATE(gemm1_bf16_gated, 1, 1, true)
INSTANTIATE(gemm1_bf16_plain, 1, 1, false)
INSTANTIATE(gemm2_bf16, 1, 2, false)
