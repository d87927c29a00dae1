// Streaming decode GEMMs (NVFP4 weights, a few tokens per expert): each block copies its RB
// weight row groups (16 rows each; gated: the gate and the up row group of the same g rows),
// whole K, into shared memory with cp.async as its first act, so a block waits on DRAM once
// and every weight byte is read once per layer, whatever the expert's token count.
//
//   GEMM1: h = a · deq(w13_e)^T · alpha, g = act(h) (epilogues and W4A4 QDQ: gemm_common.cuh)
//   GEMM2: o[pair] = g · deq(w2_e)^T · alpha · router weight
//
// Why (docs/KERNEL_NOTES.md, runs 23–28): the mma decode kernels (expert_gemm.cu) stream
// weights through registers two k groups ahead, behind a serial chain of expert lookup,
// activation staging and split-K barriers, over 1.3–2 waves of blocks. Here the chain is:
// expert id → every weight copy in flight → (meanwhile) pair offsets, pair list and activation
// rows → compute from shared memory; and GEMM2, launched as a programmatic dependent, issues its
// weight copies before it waits for GEMM1. Measured: GEMM1 about as fast as the mma kernel,
// GEMM2 4 µs faster at one token (the prefetch), both slower from 4–8 tokens, where a block
// that loads everything before computing overlaps worse than per-warp prefetch: the host
// streams one token (cuda::STREAM_MAX_TOKENS; up to 2 before run 128).
//
// Work split: grid.y = active expert slot, grid.x = RB row groups (units) of that expert.
// 8 warps; warp w owns unit w % RB and k groups [ks·kg/KSPLIT, (ks+1)·kg/KSPLIT), ks = w / RB,
// KSPLIT = 8 / RB. A warp copies its own k slice in STREAM_GROUPS commit groups along k and
// starts on the first group while the rest arrive. Per token tile (min(T, 8) rows): the tile's
// activation rows are staged in shared memory, each warp runs mma.sync m16n8k16 over its slice
// (A: table-free exact dequantization, gemm_common.cuh; B: token g's row, zero past the
// tile), and the KSPLIT partial sums are added in a fixed order (bitwise reproducible, and a
// token's result does not depend on the batch: same K split, one token per mma column).
//
// Shared memory (bytes, kp = 64·kg): units' data [RB·U][kg·512], units' scales [RB·U][kg·64]
// (global layout of cuda/pack.rs, copied verbatim), split-K partials
// [(KSPLIT−1)·RB][32 lanes][4·U] f32, activation rows [min(T, 8)][kp + 8] bf16 (8 elements of
// padding per row keep the B-fragment reads of the 8 token rows in distinct banks).
#include "expert_stream.cuh"

#define STREAM_GROUPS 4

template <int STAGE, bool GATED, int RB>
__device__ __forceinline__ void stream_body(const GemmParams& p) {
    constexpr int KSPLIT = STREAM_WARPS / RB;
    constexpr int U = GATED ? 2 : 1;
    constexpr int NACC = 4 * U;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int kg = p.kg;
    u8* sdata = smem_raw;
    u8* sscale = sdata + RB * U * kg * 512;
    float* red = reinterpret_cast<float*>(sscale + RB * U * kg * 64);
    __nv_bfloat16* sact = reinterpret_cast<__nv_bfloat16*>(red + (KSPLIT - 1) * RB * 32 * NACC);

    // GEMM1's predecessor writes the expert grouping; GEMM2's (GEMM1) only the activations,
    // which are read after the wait below: GEMM2 prefetches its weights while GEMM1 finishes.
    if (STAGE == 1) {
        pdl_wait();
        pdl_launch_dependents();
    }
    const int slot = blockIdx.y;
    // Both loads issue together; `active` has an entry for every slot of the grid. In GEMM2 they
    // precede the wait: the routing kernels wrote them before GEMM1 passed its own wait, and
    // GEMM1 triggers this launch only after that (L2 loads all the same). A block leaving here
    // never waits; the chain holds through the blocks of the active slots (at least one).
    const int num_active = __ldcg(p.num_active);
    const int e = __ldcg(p.active + slot);
    if (slot >= num_active) return;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int rgl = warp % RB, ks = warp / RB;
    const int rg = blockIdx.x * RB + rgl;
    const bool active_warp = rg < p.rg_out;
    const int k_lo = ks * kg / KSPLIT, k_hi = (ks + 1) * kg / KSPLIT;
    const int chunk = (k_hi - k_lo + STREAM_GROUPS - 1) / STREAM_GROUPS;

    // 1. This warp's weights, STREAM_GROUPS commit groups along k.
    if (active_warp) {
#pragma unroll
        for (int c = 0; c < STREAM_GROUPS; c++) {
            const int lo = min(k_lo + c * chunk, k_hi), hi = min(lo + chunk, k_hi);
            stream_copy_slice<GATED>(p, e, rg, rgl, lo, hi, sdata, sscale, lane);
            cp_async_commit();
        }
    }

    const int base = __ldcg(p.offsets + e);
    const int n_e = __ldcg(p.offsets + e + 1) - base;
    // Rows per pass: what the host sized shared memory for (min(T, 8)); an expert can hold more
    // pairs than the batch has tokens when a caller's top-k lists an expert twice for a token.
    const int tile = max(1, min(p.tile_rows, STREAM_TILE));
    const int kp = kg * 64;
    const int stride = kp + 8;
    const u8* wd0 = sdata + (size_t)(rgl * U) * kg * 512 + lane * 16;
    const u8* ws0 = sscale + (size_t)(rgl * U) * kg * 64 + g * 8;
    const float unscale = NVFP4_DEQ_UNSCALE;
    if (STAGE == 2) {
        pdl_wait();
        pdl_launch_dependents();
    }

    for (int t0 = 0; t0 < n_e; t0 += tile) {
        if (t0 > 0) __syncthreads();  // the previous tile's activation reads and partial sums are done
        const int nvalid = min(tile, n_e - t0);
        // 2. The tile's activation rows: a warp per row (source row resolved once), lanes over
        //    16-byte pieces, zeros over the k padding.
        for (int r = warp; r < nvalid; r += STREAM_WARPS) {
            const int arow = (STAGE == 1 && p.top_k > 0) ? p.sorted[base + t0 + r] / p.top_k : base + t0 + r;
            const __nv_bfloat16* src = p.act + (size_t)arow * p.k;
            for (int c8 = lane; c8 < kp / 8; c8 += 32) {
                uint4 v = make_uint4(0, 0, 0, 0);
                if (c8 * 8 < p.k) v = __ldcg(reinterpret_cast<const uint4*>(src + c8 * 8));
                *reinterpret_cast<uint4*>(sact + r * stride + c8 * 8) = v;
            }
        }
        __syncthreads();

        // 3. This warp's k slice against the tile, group by group as the copies land.
        float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}}, accu[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
        if (active_warp) {
            const __nv_bfloat16* brow = sact + g * stride + 2 * q;
            const bool has_token = g < nvalid;
            for (int c = 0; c < STREAM_GROUPS; c++) {
                const int lo = min(k_lo + c * chunk, k_hi), hi = min(lo + chunk, k_hi);
                cp_async_wait_upto(STREAM_GROUPS - 1 - c);
                __syncwarp();
                stream_slice_mma<GATED>(wd0, ws0, kg, brow, has_token, lo, hi, acc[0], accu[0]);
            }
        }

        // 4. Split-K: slices 1..KSPLIT-1 park their sums, slice 0 adds them in order and stores.
        stream_park<GATED>(red, ks, RB, rgl, lane, acc[0], accu[0]);
        __syncthreads();
        if (ks == 0 && active_warp) {
            stream_sum_slices<GATED>(red, KSPLIT, RB, rgl, lane, acc[0], accu[0]);
            if (STAGE == 1)
                store_gemm1<1, GATED>(p, acc, accu, e, base, n_e, t0, rg, 1, unscale);
            else
                store_gemm2<1>(p, acc, e, base, n_e, t0, rg, 1, unscale);
        }
    }
    cp_async_wait<0>();  // an expert without tokens still leaves no copy in flight at exit
}

// Registers capped for 4 blocks per SM (3 gated): the occupancy runs 25–32 measured.
#define STREAM_ONE(NAME, STAGE, GATED, RB)                                                      \
    extern "C" __global__ void __launch_bounds__(STREAM_WARPS * 32, GATED ? 3 : 4) NAME##_r##RB(const GemmParams p) { \
        stream_body<STAGE, GATED, RB>(p);                                                       \
    }
#define STREAM(NAME, STAGE, GATED) \
    STREAM_ONE(NAME, STAGE, GATED, 1) \
    STREAM_ONE(NAME, STAGE, GATED, 2) \
    STREAM_ONE(NAME, STAGE, GATED, 4)

STREAM(stream_gemm1_gated, 1, true)
STREAM(stream_gemm1_plain, 1, false)
STREAM(stream_gemm2, 2, false)
