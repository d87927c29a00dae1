// Expert GEMMs of the prefill path (tens to thousands of tokens per expert) on tensor-core tiles.
// Formulas and epilogues are gemm_common.cuh's, the packed NVFP4 weight layout cuda/pack.rs's.
//
// Tile: a block owns SLOTS ring slots of 16 weight rows x up to NT tokens of one expert:
// SLOTS = 16 (256 rows) with PF_NT = 128 (prefill_gemm*, prefill_tma*: four warpgroups, one
// block per SM) or PF_NT_SMALL = 32 (prefill_small_*, two warpgroups, PF_SMALL_BLOCKS blocks per
// SM, for a few to a few tens of tokens per expert); SLOTS = 8 (128 rows) with PF_NT_WIDE = 256
// (prefill_wide_*, two warpgroups, TMA-fed, sm_90a: each converted fragment feeds 256 token
// columns) or PF_NT = 128 (prefill_dual_*, two warpgroups, TMA-fed, PF_DUAL_BLOCKS blocks
// per SM). With HS = SLOTS / 2, slot s = HS·h + w' (h = 0, 1; w' < HS) holds, gated, the gate
// rows (h = 0) or the up rows (h = 1, I/16 row groups further) of g row group HS·bx + w', so a
// block covers 8·SLOTS rows of g; non-gated, row group SLOTS·bx + s, so each half is 8·SLOTS
// consecutive rows and a row tile that ends within its first half (Nemotron-3 Nano's I = 1856
// and H = 2688 leave 4 and 8 of 16 row groups in the last tile) computes that half alone (HV;
// on the 8-slot tiles both warpgroups take that half's slots, each over half of the token
// columns: SPLIT).
// With HALVES = 1 (large and wide tiles) warp w computes slot w: on the large tiles 16
// converting warps per SM hide the dequantization's latency twice as well as 8 (KERNEL_NOTES
// run 20); the wide tiles have 8, each converted fragment serving twice the columns.
// With HALVES = 2 (small tiles, 8 warps, 2 blocks per SM) warp w computes slots w and 8 + w.
// Every 64-wide k chunk goes through a PF_STAGES-deep cp.async ring in shared
// memory: the SLOTS row groups' packed NVFP4 data (512 bytes each, the mma A fragments, see
// cuda/pack.rs) and scales (64 bytes each), and the tile's activation rows (gathered through
// the sorted pairs) in the no-swizzle K-major core-matrix layout wgmma reads B from:
//     byte (n, k) of the B part = (n / 8)·1024 + (k / 8)·128 + (n % 8)·16 + (k % 8)·2
// (LBO, the next 8 k, = 128 bytes; SBO, the next 8 tokens, = 1024 bytes). Copy i of a round
// writes bytes 16i..16i+15, so the ring fills without bank conflicts. Each warp reads its
// fragment(s) back (one 16-byte load per lane each) and dequantizes them in registers without
// tables (dequant_fragment_alu: products carry 2^-8, undone in the epilogue).
//
// sm_90a: per 16 k, one wgmma.m64nNk16 (A from registers, N = 16 to 128; 256 and 192 as
// 128 + the rest) per half, committed together; the next fragments are dequantized while they
// run (wait_group PF_MMA_DEPTH = 3, one A buffer per 16-k step of a chunk). No wgmma sits in a
// branch (ptxas would serialize them): row groups past the matrix are zero-filled and computed,
// not skipped. Other archs: mma.sync m16n8k16 over N/8 column tiles of the same shared layout.
// Both leave the accumulators in the fragment order the epilogues expect.
//
// TMA feed (prefill_tma*, prefill_wide_*, prefill_dual_*, prefill_small_tma_*, sm_90a): the
// activation rows are read in sorted pair order from a tensor map (GEMM1's operand written in
// that order by prepare_input_sorted, or copied by gather_rows; GEMM2's is GEMM1's output), one
// thread loading each chunk's NC x 64 tile (thread 0; on the 32-token tiles the first thread of
// warp c % 8, and one 32-row box whatever NC) in boxes of PF_BOX_ROWS rows onto the stage's
// mbarrier, in the
// 128-byte-swizzled layout of smem_desc_sw128 (row n at n·128 bytes, 16-byte pieces XORed with
// n % 8). The weights keep their cp.async copies. prefill_tma2_*: 2-CTA clusters sharing the
// token tile, each CTA multicasting its half of the box to both (KERNEL_NOTES run 38: slower).
//
// Ring hazards: chunk c + D (D = PF_STAGES - 2) is copied into the stage of chunk c - 2 right
// after the barrier of chunk c, when every warpgroup has retired chunk c - 2's MMAs (wait_group
// PF_MMA_DEPTH <= 3 after the last group of chunk c - 1: at most chunk c - 1's last three groups
// are in flight). With multicast the copy also overwrites the other CTA's stage, which its
// barrier does not cover: the empty mbarriers do (every warp of the other CTA has arrived for
// chunk c - 2 before thread 0 refills).
//
// Epilogue (prefill_epilogue): through the idle ring as f32 [token][row], then one short loop of
// 16-byte stores (GEMM2: the columns' pairs and router weights were fetched into shared memory
// before the k loop).
//
// Work: blockIdx.x = row tile, blockIdx.y = the y-th (expert, NT-token tile) in increasing
// expert id (`find_tile`); blocks past the last tile exit. An expert's last tile runs the narrowest width that holds
// its tokens (NT or NT / 2, small tiles also NT / 4; wide tiles 256, 192, 128 or 64). Each output is summed by one thread
// in a fixed order, the same for every width and tile: results are deterministic and equal
// across tiles.
#include "gemm_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PF_WGMMA 1
#else
#define PF_WGMMA 0
#endif

#define PF_THREADS 512        // large tiles: 16 warps, one slot each
#define PF_THREADS_SMALL 256  // small tiles: 8 warps, two slots each
#define PF_NT 128
#define PF_NT_SMALL 32
#define PF_SMALL_BLOCKS 2  // three (80 registers) make ptxas serialize the wgmmas (C7512)
#define PF_STAGES 5
// wgmma groups each warpgroup leaves in flight after issuing one (was 1; at most 3, see frag).
#ifndef PF_MMA_DEPTH
#define PF_MMA_DEPTH 3
#endif
static_assert(PF_MMA_DEPTH >= 1 && PF_MMA_DEPTH <= 3, "frag holds four steps; the ring refills chunk c - 2");
// Non-gated 32-token tiles whose rows end within their first half compute that half only (1), or
// both, the second on zero-filled weights (0, for A/B timing through FP4MOE_DEFINES).
#ifndef PF_HALF_TILES
#define PF_HALF_TILES 1
#endif
// Non-gated 8-slot tiles (dual, wide) whose rows end within their first half split the token
// columns over both warpgroups on that half's slots (1), or compute both halves, the second on
// zero-filled weights (0, for A/B timing through FP4MOE_DEFINES).
#ifndef PF_SPLIT_TILES
#define PF_SPLIT_TILES 1
#endif
// GEMM2 requests its first chunks' weights before it waits for GEMM1's rows (1), or after (0,
// for A/B timing through FP4MOE_DEFINES: the copies in their order before run 148, the wait
// itself where run 148 moved it, after find_tile and the tile's setup, and off the handoff
// still after GEMM2 lets its successors launch).
#ifndef PF_EARLY_WEIGHTS
#define PF_EARLY_WEIGHTS 1
#endif
#define PF_B_BYTES (PF_NT * 128)
#define PF_W_BYTES (16 * 512)
#define PF_S_BYTES (16 * 64)
#define PF_STAGE_BYTES (PF_B_BYTES + PF_W_BYTES + PF_S_BYTES)
#define PF_NT_WIDE 256      // wide tiles (prefill_wide_*, TMA only): 8 warps, 8 slots (128 rows)
#define PF_THREADS_WIDE 256
#define PF_RING_OFFSET 3072  // below it: the row table, the tile, the barriers, the tokens' pairs
// Rows of one TMA box (64 k wide): 32 for the 32-token tiles (one box per chunk, also for their
// 8- and 16-column tiles, whose extra rows are computed into columns nobody stores), else 64
// (the host's tensor_map builds the map with the same box).
#define PF_BOX_ROWS_SMALL 32
#define PF_BOX_ROWS_LARGE 64
#define PF_BOX_ROWS(NT) ((NT) == PF_NT_SMALL ? PF_BOX_ROWS_SMALL : PF_BOX_ROWS_LARGE)
static_assert(PF_BOX_ROWS_SMALL <= PF_NT_SMALL && PF_BOX_ROWS_LARGE <= PF_NT, "a box fits its tile's ring stage");


// Bytes of one ring stage of an NT-token tile over SLOTS 16-row slots: the activation rows (128
// bytes per token), the slots' packed data and scales, rounded up to 1024 bytes (a 128-byte-
// swizzled stage must start 1024-byte aligned; the 16-slot stages already are).
__host__ __device__ constexpr int pf_stage_bytes(int nt, int slots) {
    return (nt * 128 + slots * (512 + 64) + 1023) / 1024 * 1024;
}
static_assert(pf_stage_bytes(PF_NT, 16) == PF_STAGE_BYTES, "16-slot stages are unpadded");

// A CUtensorMap (cuTensorMapEncodeTiled on the host), passed by value as a __grid_constant__
// kernel parameter.
struct __align__(64) TmaMap {
    u64 opaque[16];
};
#define PF_BARS_OFFSET 576  // full[PF_STAGES], empty[PF_STAGES] mbarriers (TMA kernels), below the ring
// Layout below the ring: the row table (PF_NT ints) and the tile (4 ints, find_tile), then the
// barriers, then GEMM2's pair table; a 128-byte-swizzled stage must start 1024-byte aligned
// (descriptor base offset 0).
static_assert(PF_BARS_OFFSET >= PF_NT * 4 + 16 && PF_BARS_OFFSET % 8 == 0, "barriers overlap the row table and tile");
// GEMM2: each tile column's pair and router weight, fetched before the k loop so that the
// epilogue does not wait on two dependent global loads per item (run 47: 15 % of the wide
// GEMM2's warp samples).
struct PairTable {
    int pair[PF_NT_WIDE];
    float weight[PF_NT_WIDE];
};
#define PF_PAIRS_OFFSET 1024
static_assert(PF_BARS_OFFSET + 2 * 8 * PF_STAGES <= PF_PAIRS_OFFSET, "barriers overlap the pair table");
static_assert(PF_PAIRS_OFFSET + sizeof(PairTable) <= PF_RING_OFFSET, "the pair table overlaps the ring");
static_assert(PF_RING_OFFSET % 1024 == 0 && PF_STAGE_BYTES % 1024 == 0, "swizzled stages must be 1024-byte aligned");

#if PF_WGMMA
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from touching the accumulators across the asynchronous MMAs.
template <int NSUB>
__device__ __forceinline__ void fence_acc(float (&d)[NSUB][4]) {
#pragma unroll
    for (int s = 0; s < NSUB; s++)
#pragma unroll
        for (int c = 0; c < 4; c++) asm volatile("" : "+f"(d[s][c])::"memory");
}

// Shared-memory matrix descriptor of a no-swizzle K-major B tile at `p` (LBO 128, SBO 1024).
__device__ __forceinline__ u64 smem_desc(const void* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    return (u64)((a >> 4) & 0x3FFF) | ((u64)(128 >> 4) << 16) | ((u64)(1024 >> 4) << 32);
}

// Shared-memory matrix descriptor of a 128-byte-swizzled K-major B tile at `p` (1024-byte aligned
// stage; rows of 64 k = 128 bytes, 8-row groups 1024 bytes apart; LBO unused). A 16-k step
// inside the swizzle atom is the start address plus 32 bytes: the hardware applies the XOR
// swizzle to the final address, as the TMA did when it wrote the tile.
__device__ __forceinline__ u64 smem_desc_sw128(const void* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    return (u64)((a >> 4) & 0x3FFF) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// One arrival on the barrier at the same offset as `bar` in cluster CTA `rank`.
__device__ __forceinline__ void mbar_arrive_remote(u64* bar, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(bar)), "r"(rank));
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Box (64 k, the map's box rows) of the 2D tensor map `map` at (k0, row0) → `dst`, completing on `bar`;
// MULTICAST: into `dst` of both CTAs of the cluster, completing on each one's `bar`.
template <bool MULTICAST>
__device__ __forceinline__ void tma_load_box(void* dst, const void* map, int k0, int row0, u64* bar) {
    if constexpr (MULTICAST)
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
            " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_u32(dst)),
            "l"(map), "r"(k0), "r"(row0), "r"(smem_u32(bar)), "h"((unsigned short)3)
            : "memory");
    else
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_u32(dst)),
            "l"(map), "r"(k0), "r"(row0), "r"(smem_u32(bar))
            : "memory");
}

__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[8][4], const u32 a[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[16][4], const u32 a[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

__device__ __forceinline__ void wgmma_m64n32k16_rs(float (&d)[4][4], const u32 a[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

__device__ __forceinline__ void wgmma_m64n16k16_rs(float (&d)[2][4], const u32 a[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

__device__ __forceinline__ void wgmma_m64n8k16_rs(float (&d)[1][4], const u32 a[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3"
        "}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// acc += A · B over NC token columns (one m64nNCk16 per warpgroup).
// NC > 128 (wide tiles): m64n128k16 on the first 128 columns, then the rest on B's rows 128..,
// 128 rows x 128 bytes further (a multiple of the 1024-byte swizzle atom, so the descriptor's
// start address just advances).
template <int NC>
__device__ __forceinline__ void wgmma_rs(float (&d)[NC / 8][4], const u32 a[4], u64 desc_b) {
    if constexpr (NC > 128) {
        wgmma_m64n128k16_rs(*reinterpret_cast<float(*)[16][4]>(&d[0][0]), a, desc_b);
        wgmma_rs<NC - 128>(*reinterpret_cast<float(*)[NC / 8 - 16][4]>(&d[16][0]), a, desc_b + ((128 * 128) >> 4));
    } else if constexpr (NC == 128) wgmma_m64n128k16_rs(d, a, desc_b);
    else if constexpr (NC == 64) wgmma_m64n64k16_rs(d, a, desc_b);
    else if constexpr (NC == 32) wgmma_m64n32k16_rs(d, a, desc_b);
    else if constexpr (NC == 16) wgmma_m64n16k16_rs(d, a, desc_b);
    else wgmma_m64n8k16_rs(d, a, desc_b);
}

#endif  // PF_WGMMA

// mma.sync version of one 16-k step: acc[s] += A · B(column tile s) for s < nsub.
template <int NSUB>
__device__ __forceinline__ void mma_sync_k16(float (&acc)[NSUB][4], const u32 a[4], const unsigned char* stage, int j) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const unsigned char* b = stage + j * 256 + g * 16 + q * 4;
#pragma unroll
    for (int s = 0; s < NSUB; s++) {
        u32 b0 = *reinterpret_cast<const u32*>(b + s * 1024);
        u32 b1 = *reinterpret_cast<const u32*>(b + s * 1024 + 128);
        mma_bf16_16816(acc[s], a, b0, b1);
    }
}

// tile = {expert, first token, the expert's first sorted row, its token count} of this block's work
// item (blockIdx.y-th tile in expert order; expert -1: none). Every thread takes PER consecutive
// experts and loads their offsets in one round of independent loads, and a block-wide exclusive
// scan of the tile counts places the block's tile: one global round trip before the block can
// start copying, where one warp scanning the active list 32 experts at a time took ~2.8 rounds
// of two dependent loads (run 116: the other warps' wait was 4.5 % of the dual GEMM1's samples).
// Tiles come in increasing expert id (from the offsets; the active list is by 8-token passes). `scratch`: WARPS ints, read
// before the caller's next barrier; `tile` is complete after that barrier. VIA_L2: the offsets
// through L2 (GEMM2, which reads them before its wait for GEMM1).
#define PF_MAX_EXPERTS 512  // cuda::MAX_EXPERTS
template <int NT, int THREADS, bool VIA_L2>
__device__ __forceinline__ void find_tile(const GemmParams& p, int* tile, int* scratch) {
    constexpr int PER = (PF_MAX_EXPERTS + THREADS - 1) / THREADS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, target = blockIdx.y;
    const int per = (p.experts + THREADS - 1) / THREADS, e0 = tid * per;
    int off[PER + 1];
#pragma unroll
    for (int i = 0; i <= PER; i++)
        off[i] = i <= per && e0 + i <= p.experts ? (VIA_L2 ? __ldcg(p.offsets + e0 + i) : p.offsets[e0 + i]) : 0;
    int cnt = 0;
#pragma unroll
    for (int i = 0; i < PER; i++)
        if (i < per && e0 + i < p.experts) cnt += (off[i + 1] - off[i] + NT - 1) / NT;
    const int incl = warp_inclusive_sum(cnt);
    if (lane == 31) scratch[warp] = incl;
    if (tid == 0) tile[0] = -1;
    __syncthreads();
    int lo = incl - cnt;
    for (int w = 0; w < warp; w++) lo += scratch[w];
    if (cnt > 0 && target >= lo && target < lo + cnt) {
#pragma unroll
        for (int i = 0; i < PER; i++) {
            if (i < per && e0 + i < p.experts) {
                const int n = off[i + 1] - off[i], c = (n + NT - 1) / NT;
                if (target >= lo && target < lo + c) {
                    tile[0] = e0 + i;
                    tile[1] = (target - lo) * NT;
                    tile[2] = off[i];
                    tile[3] = n;
                }
                lo += c;
            }
        }
    }
}

__device__ __forceinline__ u32 word_of(uint4 v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// Global row group of ring slot `slot` (= HS·h + w, HS = SLOTS / 2) of block row tile `bx`;
// false past the matrix.
template <bool GATED, int SLOTS>
__device__ __forceinline__ bool slot_row_group(const GemmParams& p, int slot, int bx, int* rg) {
    constexpr int HS = SLOTS / 2;
    int h = slot / HS, w = slot % HS;
    int out = GATED ? bx * HS + w : bx * SLOTS + slot;
    *rg = (GATED && h == 1) ? out + p.rg_out : out;
    return out < p.rg_out;
}

// Local row (0 .. 16·SLOTS − 1) of ring slot `slot`'s first row in the block's output order:
// gated, the gate rows of g row group bx·HS + w at 16·w, its up rows 8·SLOTS further;
// non-gated, 16·slot. (The inverse of slot_row_group's placement.)
template <bool GATED, int SLOTS>
__device__ __forceinline__ int slot_local_row(int slot) {
    constexpr int HS = SLOTS / 2;
    int h = slot / HS, w = slot % HS;
    return GATED ? h * HS * 16 + w * 16 : slot * 16;
}

// Epilogue of one tile, staged through the idle ring: each warp writes its accumulators there
// as f32 [token][local row] (token stride 16·SLOTS + 4 floats: lanes of different q land 8
// banks apart, so the writes are conflict-free), then every thread takes items of 8 consecutive
// output rows of one token: GEMM1 applies alpha, the activation (gated: gate rows at local row
// r, up rows at r + 8·SLOTS) and the W4A4 QDQ (a 16-row block is the item and its neighbour
// lane), and stores 16 bytes of bf16; GEMM2 scales by alpha · router weight and stores 16 bytes
// of bf16 too. The unrolled register epilogue this replaces was ~10k instructions of
// straight-line code (the activation's expf / tanhf inlined per value): under ncu a quarter of
// GEMM1's warp samples, mostly instruction-fetch stalls (KERNEL_NOTES run 43). Same arithmetic
// per value, so the same bits. Tokens go in passes of PS column tiles when the ring cannot hold
// the whole tile.
// SPLIT (prefill_tile's split row tiles): warp w holds slot w % (SLOTS / 2)'s rows for the
// token columns of half w / (SLOTS / 2), NC / 2 of them.
template <bool GATED, int STAGE, int NC, int SLOTS, int HALVES, bool SPLIT = false>
__device__ __forceinline__ void prefill_epilogue(const GemmParams& p,
                                                 const float (&acc)[HALVES][(SPLIT ? NC / 2 : NC) / 8][4],
                                                 unsigned char* ring, const PairTable* pairs, int e,
                                                 int base, int n_e, int t0, int nvalid) {
    constexpr int NSUB = NC / 8, WARPS = SLOTS / HALVES, THREADS = 32 * WARPS;
    constexpr int EP_TS = SLOTS * 16 + 4;  // local rows + 4 floats of padding per token
    constexpr int RING_BYTES = PF_STAGES * pf_stage_bytes(NC, SLOTS);  // at most the ring: NC <= NT
    constexpr int PS = NSUB * 8 * EP_TS * 4 <= RING_BYTES ? NSUB : NSUB / 2;
    static_assert(PS * 8 * EP_TS * 4 <= RING_BYTES && NSUB % PS == 0, "epilogue staging exceeds the ring");
    // Items per token: 8 output rows each (gated: 8·SLOTS g rows; else 16·SLOTS rows).
    constexpr int IPT = GATED && STAGE == 1 ? SLOTS : 2 * SLOTS;
    constexpr int UP = SLOTS * 8;  // gated: the up rows' local offset
    // The QDQ's shuffle pairs item i with i ^ 1 (the same token's other 8 rows of a 16-row block)
    // and needs every lane of a warp in every iteration; float4 staging reads need 16-byte rows.
    static_assert(IPT % 2 == 0 && (PS * 8 * IPT) % 32 == 0 && THREADS % 32 == 0, "epilogue items per warp");
    static_assert(EP_TS % 4 == 0, "staging rows must be 16-byte aligned");
    static_assert(!SPLIT || (PS == NSUB && HALVES == 1), "a split tile stages in one pass");
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    float* st = reinterpret_cast<float*>(ring);
    const int nsub_valid = (nvalid + 7) / 8;
    const int rg0 = blockIdx.x * (GATED && STAGE == 1 ? SLOTS / 2 : SLOTS);  // the block's first output row group
    const float alpha = p.wscale2[e * p.shards] * p.act_alpha * NVFP4_DEQ_UNSCALE;
    const float alpha_u = GATED && STAGE == 1 ? p.wscale2[e * p.shards + 1] * p.act_alpha * NVFP4_DEQ_UNSCALE : 0.0f;
    const float inv_gs = STAGE == 1 && p.gs_out > 0.0f ? 1.0f / p.gs_out : 0.0f;
#pragma unroll
    for (int ps = 0; ps < NSUB / PS; ps++) {
        if (ps * PS >= nsub_valid) break;  // block-uniform
        if (ps > 0) __syncthreads();  // the previous pass has read the staging area
        // Column tiles a warp holds in this pass (SPLIT: its half's, from token column col0).
        constexpr int SW = SPLIT ? NSUB / 2 : PS;
        const int col0 = SPLIT ? (warp / (SLOTS / 2)) * (NC / 2) : 0;
#pragma unroll
        for (int h = 0; h < HALVES; h++) {
            const int slot = SPLIT ? warp % (SLOTS / 2) : warp + WARPS * h;
            float* dst = st + slot_local_row<GATED && STAGE == 1, SLOTS>(slot) + col0 * EP_TS + g;
#pragma unroll
            for (int s = 0; s < SW; s++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    dst[(8 * s + 2 * q + (c & 1)) * EP_TS + 8 * (c >> 1)] = acc[h][ps * PS + s][c];
        }
        __syncthreads();
        // Every lane of a warp runs the same iterations (items are a multiple of 32), so the
        // QDQ's shuffle needs no mask arithmetic.
#pragma unroll 1
        for (int it = tid; it < PS * 8 * IPT; it += THREADS) {
            const int t = it / IPT, row = (it % IPT) * 8, lt = t0 + ps * PS * 8 + t;
            const bool ok = lt < n_e && rg0 + row / 16 < p.rg_out;
            const float* src = st + t * EP_TS + row;
            float v[8];
            *reinterpret_cast<float4*>(v) = *reinterpret_cast<const float4*>(src);
            *reinterpret_cast<float4*>(v + 4) = *reinterpret_cast<const float4*>(src + 4);
            if (STAGE == 2) {
                if (!ok) continue;
                const int pair = pairs->pair[lt - t0];
                const float w = pairs->weight[lt - t0] * alpha;
#pragma unroll
                for (int i = 0; i < 8; i++) v[i] *= w;
                *reinterpret_cast<uint4*>(p.o_out + (size_t)pair * p.out_stride + rg0 * 16 + row) = bf16x8_bits(v);
                continue;
            }
            float u[8] = {};
            if (GATED) {
                *reinterpret_cast<float4*>(u) = *reinterpret_cast<const float4*>(src + UP);
                *reinterpret_cast<float4*>(u + 4) = *reinterpret_cast<const float4*>(src + UP + 4);
            }
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = apply_activation(p.activation, v[i] * alpha, GATED ? u[i] * alpha_u : 0.0f);
            // The 16-row block is this item and its neighbour lane's (the other 8 rows).
            if (p.gs_out > 0.0f) nvfp4_qdq_block<8, 1, 2>(v, p.gs_out, inv_gs);
            if (ok) {
                *reinterpret_cast<uint4*>(p.g_out + (size_t)(base + lt) * p.out_stride + rg0 * 16 + row) = bf16x8_bits(v);
            }
        }
    }
}

// One tile of NC (16 to 256, at most NT) token columns: the k loop and the epilogue. HALVES:
// slots per warp (1: SLOTS warps, 2: SLOTS / 2). TMA: how the activation tile arrives — 0:
// gathered by cp.async through `srow`; 1: boxes of PF_BOX_ROWS(NT) rows from `tm`
// (the rows in sorted order, 128-byte swizzle), completing on `bars`; 2: as 1, the box of each
// CTA of a 2-CTA cluster multicast to both (each L2 read feeds two SMs). HV (<= HALVES): the
// halves computed; with HV < HALVES the other halves' rows are past the matrix (non-gated row
// tiles that end within their first half), and neither their weights are copied nor their
// fragments converted or multiplied: their accumulators stay zero and the epilogue stores no
// row past the matrix. A block-uniform choice of instantiation, so no wgmma sits in a branch.
// SPLIT (non-gated 8-slot tiles, HALVES = 1, whose rows end within the first half: Nemotron-3
// Nano's GEMM1 leaves 4 of 8 row groups in its last row tile): the two warpgroups compute the
// same first SLOTS / 2 slots, each over half of the token columns (m64 x NC / 2 per 16 k), so
// no MMA runs on rows past the matrix and only those slots' weights are copied; each output
// still sums the same products in the same k order (the widths' bits are equal).
template <bool GATED, int STAGE, int NC, int NT, int SLOTS, int HALVES, int HV, int TMA, bool SPLIT = false>
__device__ __forceinline__ void prefill_tile(const GemmParams& p, const int* srow, unsigned char* ring,
                                             const PairTable* pairs, int e, int base, int n_e, int t0, int nvalid,
                                             const TmaMap* tm, u64* bars) {
    static_assert(NC <= NT && NC % 8 == 0, "a tile's width fits its ring");
    static_assert(HV >= 1 && HV <= HALVES, "computed halves");
    static_assert(!SPLIT || (!GATED && HALVES == 1 && SLOTS == 8 && NC % 16 == 0), "split tiles");
    constexpr int WARPS = SLOTS / HALVES, THREADS = 32 * WARPS;
    // Token columns each warp multiplies (SPLIT: half of them, from column NCW·(warp / 4)).
    constexpr int NCW = SPLIT ? NC / 2 : NC;
    constexpr int STAGES = PF_STAGES, AHEAD = STAGES - 2;
    constexpr int B_BYTES = NT * 128, W_BYTES = SLOTS * 512, STAGE_BYTES = pf_stage_bytes(NT, SLOTS);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    const u8* wdata_e = p.wdata + (size_t)e * p.rg_w * p.kg * 512;
    const u8* wscales_e = p.wscales + (size_t)e * p.rg_w * p.kg * 64;

    // Copies of a chunk: NC·8 activation pieces (cp.async feed), then 32 data and 4 scale
    // pieces of weights per computed slot. Each thread's pieces are the same every chunk but for a
    // k offset, so each has a cursor resolved once here and advanced by a fixed step per chunk
    // (chunks are staged in order): a chunk costs a few adds, warp-uniform branches and a cp.async per
    // piece.
    constexpr int A_PIECES = TMA ? 0 : NC * 8, A_COPIES = (A_PIECES + THREADS - 1) / THREADS;
    // The pieces of the computed halves' slots (slot = piece / 36): HV < HALVES copies no slot
    // that no warp reads.
    constexpr int W_PIECES = (SPLIT ? SLOTS / 2 : WARPS * HV) * 36;
    constexpr int W_COPIES = (W_PIECES + THREADS - 1) / THREADS;
    const __nv_bfloat16* a_cur[A_COPIES > 0 ? A_COPIES : 1];
    int a_left[A_COPIES > 0 ? A_COPIES : 1];  // valid k from the piece's column on; <= 0: zero-fill
#pragma unroll
    for (int r = 0; r < A_COPIES; r++) {
        int i = tid + r * THREADS;
        int n = ((i >> 6) << 3) | (i & 7), row = i < A_PIECES ? srow[n] : -1;
        a_left[r] = row >= 0 ? p.k - ((i >> 3) & 7) * 8 : 0;
        a_cur[r] = p.act + (size_t)max(row, 0) * p.k + ((i >> 3) & 7) * 8;
    }
    const u8* w_cur[W_COPIES];
    u32 w_dst[W_COPIES], w_step[W_COPIES];  // stage offset, source bytes per chunk (0: zero-fill)
#pragma unroll
    for (int r = 0; r < W_COPIES; r++) {
        int i = tid + r * THREADS, slot = i / 36, piece = i % 36, rg = 0;
        bool ok = i < W_PIECES && slot_row_group<GATED, SLOTS>(p, slot, blockIdx.x, &rg);
        if (piece < 32) {
            w_cur[r] = ok ? wdata_e + (size_t)rg * p.kg * 512 + piece * 16 : p.wdata;
            w_dst[r] = B_BYTES + slot * 512 + piece * 16;
            w_step[r] = ok ? 512 : 0;
        } else {
            w_cur[r] = ok ? wscales_e + (size_t)rg * p.kg * 64 + (piece - 32) * 16 : p.wdata;
            w_dst[r] = B_BYTES + W_BYTES + slot * 64 + (piece - 32) * 16;
            w_step[r] = ok ? 64 : 0;
        }
    }
    // Chunk c lives in stage c % STAGES; the loop keeps the stages it reads and refills as
    // running indices (`c % STAGES` was a multiply-high and three uniform operations per chunk).
    // Shared addresses as 32-bit values made opaque once: ptxas otherwise rebuilds the shared
    // window base (`S2UR SR_CgaCtaId`, a short-scoreboard wait) at the top of every chunk
    // (run 116: 3.7 % of the dual GEMM1's warp samples).
    u32 ring_s = smem_u32(ring), bars_s = smem_u32(bars);
    asm volatile("" : "+r"(ring_s), "+r"(bars_s));
    // A chunk's weights and its activations are staged by two lambdas: GEMM2 issues its first
    // chunks' weights (constant) before it waits for GEMM1's rows (see the prologue below).
    auto stage_weights = [&](u32 st) {
        const u32 dst_s = ring_s + st * STAGE_BYTES;
#pragma unroll
        for (int r = 0; r < W_COPIES; r++) {
            // Warp-uniform: the last round's pieces belong to the first warps only.
            if (W_PIECES % THREADS != 0 && tid + r * THREADS >= W_PIECES) continue;
            cp_async16_s(dst_s + w_dst[r], w_cur[r], w_step[r] ? 16 : 0);
            w_cur[r] += w_step[r];
        }
    };
    auto stage_acts = [&](int c, u32 st) {
        const u32 dst_s = ring_s + st * STAGE_BYTES;
#pragma unroll
        for (int r = 0; r < A_COPIES; r++) {
            if (A_PIECES % THREADS != 0 && tid + r * THREADS >= A_PIECES) continue;
            bool ok = a_left[r] > 0;
            cp_async16_s(dst_s + (tid + r * THREADS) * 16, ok ? a_cur[r] : p.act, ok ? 16 : 0);
            a_cur[r] += 64;
            a_left[r] -= 64;
        }
#if PF_WGMMA
        // The 32-token tiles' issuing thread rotates over the warps: one warp issuing every
        // chunk's box would be the last at every block barrier.
        if (TMA && tid == (NT == PF_NT_SMALL ? (c % WARPS) * 32 : 0)) {
            // Chunk c's activation rows base + t0 .. + NC - 1 (multicast: + NT - 1, half from
            // each CTA; zero past K, and past the map's rows; rows of the next expert are
            // computed into columns nobody stores).
            u64* full = bars + st;
            unsigned char* dst = ring + st * STAGE_BYTES;
            if constexpr (TMA == 2) {
                mbar_expect_tx(full, NT * 128);
                const u32 r = cluster_rank();
                tma_load_box<true>(dst + r * 64 * 128, tm, c * 64, base + t0 + 64 * r, full);
            } else {
                // Boxes of PF_BOX_ROWS(NT) rows (the host's tensor map): whole swizzle atoms of
                // 8 rows x 128 bytes, so consecutive boxes lay the tile out as one box would.
                constexpr int BOX = PF_BOX_ROWS(NT), ROWS = NC < BOX ? BOX : NC;
                static_assert(TMA == 0 || (ROWS % BOX == 0 && ROWS <= NT), "TMA tiles load whole boxes");
                mbar_expect_tx(full, ROWS * 128);
#pragma unroll
                for (int r = 0; r < ROWS / BOX; r++)
                    tma_load_box<false>(dst + r * BOX * 128, tm, c * 64, base + t0 + BOX * r, full);
            }
        }
#endif
    };
    auto stage_chunk = [&](int c, u32 st) {
        stage_acts(c, st);
        stage_weights(st);
    };

    // Slot of half h: warp + WARPS·h (SPLIT: warp % (SLOTS / 2), columns from col0).
    float acc[HALVES][NCW / 8][4];
    const int col0 = SPLIT ? (warp / (SLOTS / 2)) * NCW : 0;
#pragma unroll
    for (int h = 0; h < HALVES; h++)
#pragma unroll
        for (int s = 0; s < NCW / 8; s++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[h][s][c] = 0.0f;
    // One A fragment buffer per 16-k step of a chunk: with wait_group PF_MMA_DEPTH (<= 3) the
    // buffer step j rewrites was read by the group of step j of the previous chunk, retired.
    u32 frag[HALVES][4][4];

    if (STAGE == 2) {
        // GEMM2 reads GEMM1's rows: its first chunks' weights are requested before it waits for
        // them (the expert's GEMM1 blocks on the expert-ready handoff, else all of GEMM1), so
        // their DRAM latency overlaps the wait, as the decode GEMM2 does. They join chunk 0's
        // copy group, which chunk 0 waits for anyway.
        if (PF_EARLY_WEIGHTS) {
#pragma unroll
            for (int c = 0; c < AHEAD; c++)
                if (c < p.kg) stage_weights(c);
        }
        if (p.wait_blocks > 0) expert_ready_wait(p, e, n_e, gridDim.x * ((n_e + NT - 1) / NT));
        else pdl_wait();
#pragma unroll
        for (int c = 0; c < AHEAD; c++) {
            if (c < p.kg) {
                stage_acts(c, c);
                if (!PF_EARLY_WEIGHTS) stage_weights(c);
            }
            cp_async_commit();
        }
    } else {
#pragma unroll
        for (int c = 0; c < AHEAD; c++) {
            if (c < p.kg) stage_chunk(c, c);
            cp_async_commit();
        }
    }
    // rd: the stage of chunk c; wr: of chunk c + AHEAD; phase: parity of chunk c's full barrier.
    u32 rd = 0, wr = AHEAD, phase = 0;
#if PF_WGMMA
    // Descriptors of the stage being read: only the start address (bits 0..13, in 16-byte units)
    // moves, by STAGE_BYTES / 16 per stage and 2 (swizzled: 32 bytes) or 16 (256 bytes) per
    // 16-k step, with no carry out of bit 13 (shared memory < 256 KB): one 32-bit add each,
    // where smem_desc took six operations per 16 k.
    const u64 desc0 = TMA ? smem_desc_sw128(ring) : smem_desc(ring);
    const u32 desc_lo0 = (u32)desc0, desc_hi = (u32)(desc0 >> 32);
    constexpr u32 DESC_STEP = TMA ? 2 : 16;
#endif
    for (int c = 0; c < p.kg; c++) {
#if PF_WGMMA
        if (TMA == 2 && c >= 2 && c + AHEAD < p.kg && lane == 0) {
            // This warp's MMAs of chunk c - 2 have retired (wait_group PF_MMA_DEPTH after chunk c - 1):
            // the other CTA may refill that stage (with chunk c + AHEAD, at its chunk c) once
            // every warp here has said so. Said before this warp waits for anything, so the
            // other CTA rarely waits for it. (Inside the MMA loop it would make ptxas
            // serialize the wgmma pipeline.)
            mbar_arrive_remote(bars + STAGES + (c - 2) % STAGES, cluster_rank() ^ 1);
        }
#endif
        cp_async_wait<AHEAD - 1>();  // chunk c has landed
#if PF_WGMMA
        // cp.async-fed activations (generic proxy) before the wgmmas read them (async proxy). The
        // TMA feeds' boxes are async-proxy writes and the weights are read back by ld.shared:
        // no proxy crossing, so no fence (it cost a MEMBAR.ALL.CTA per chunk and thread).
        if (TMA) mbar_wait_s<TMA == 2>(bars_s + rd * 8, phase);
        else fence_proxy_async();
#endif
        __syncthreads();
        const int cn = c + AHEAD;
#if PF_WGMMA
        if (TMA == 2 && cn < p.kg && cn >= STAGES && tid == 0) {
            // Stage cn % STAGES last held chunk c - 2, which this CTA has retired (barrier
            // above); the other CTA, whose multicast writes here too, has retired it once all
            // its warps have said so (phase u - 1 of the empty barrier for the stage's u-th
            // refill), at the top of their chunk c.
            mbar_wait<true>(bars + STAGES + cn % STAGES, (cn / STAGES - 1) & 1);
        }
        __syncwarp();
#endif
        if (cn < p.kg) stage_chunk(cn, wr);
        cp_async_commit();  // possibly empty: one group per chunk
        const unsigned char* stage = ring + rd * STAGE_BYTES;
#if PF_WGMMA
        const u32 desc_lo = desc_lo0 + rd * (STAGE_BYTES >> 4);
#endif
        rd = rd == STAGES - 1 ? 0 : rd + 1;
        wr = wr == STAGES - 1 ? 0 : wr + 1;
        phase ^= rd == 0;
        uint4 d[HALVES];
        uint2 sb[HALVES];  // scale codes of each slot's rows g and g + 8, k blocks 0..3 (scale_pairs)
#pragma unroll
        for (int h = 0; h < HV; h++) {
            const int slot = SPLIT ? warp % (SLOTS / 2) : warp + WARPS * h;
            d[h] = *reinterpret_cast<const uint4*>(stage + B_BYTES + slot * 512 + lane * 16);
            sb[h] = *reinterpret_cast<const uint2*>(stage + B_BYTES + W_BYTES + slot * 64 + g * 8);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
#pragma unroll
            for (int h = 0; h < HV; h++)
                dequant_fragment_alu(word_of(d[h], j), scale_pairs(sb[h], j), frag[h][j]);
#if PF_WGMMA
            wgmma_fence();
            // Token row col0 of the stage: col0·128 bytes on, a multiple of the 1024-byte
            // 8-row group (swizzled and not), so only the start address moves.
            const u64 desc = (u64)desc_hi << 32 | (desc_lo + (u32)col0 * 8u + j * DESC_STEP);
#pragma unroll
            for (int h = 0; h < HV; h++) wgmma_rs<NCW>(acc[h], frag[h][j], desc);
            wgmma_commit();
            wgmma_wait<PF_MMA_DEPTH>();
#else
#pragma unroll
            for (int h = 0; h < HV; h++) mma_sync_k16<NCW / 8>(acc[h], frag[h][j], stage + col0 * 128, j);
#endif
        }
    }
#if PF_WGMMA
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < HV; h++) fence_acc(acc[h]);
#endif

    __syncthreads();  // every warp is done with the ring: the epilogue stages through it
    prefill_epilogue<GATED, STAGE, NC, SLOTS, HALVES, SPLIT>(p, acc, ring, pairs, e, base, n_e, t0, nvalid);
}

// NT-token tiles (PF_NT_SMALL, PF_NT or PF_NT_WIDE) over SLOTS 16-row slots: the tile's rows,
// then the narrowest column count that holds its tokens (NT or NT / 2; wide tiles also 192 and
// 64).
template <bool GATED, int STAGE, int NT, int SLOTS, int HALVES, int TMA>
__device__ __forceinline__ void prefill_body(const GemmParams& p, const TmaMap* tm) {
    static_assert(TMA || NT <= PF_NT, "the row table holds PF_NT rows; wide tiles are TMA-fed");
    constexpr int THREADS = 32 * SLOTS / HALVES;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    int* srow = reinterpret_cast<int*>(smem_raw);  // activation row of each tile column, -1: none
    int* tile = srow + PF_NT;
    u64* bars = reinterpret_cast<u64*>(smem_raw + PF_BARS_OFFSET);
    unsigned char* ring = smem_raw + PF_RING_OFFSET;

    const int tid = threadIdx.x;
    find_tile<NT, THREADS, STAGE == 2>(p, tile, srow);  // srow: scratch until the barrier below
    __syncthreads();
    const int e = tile[0];
    if (e < 0) return;  // block-uniform
    const int t0 = tile[1];
    const int base = tile[2], n_e = tile[3];
    // GEMM2 waits for GEMM1's rows in prefill_tile, after requesting its first weights; until
    // then it reads routing's outputs only, through L2 (find_tile's offsets, the pairs here).
    const int nvalid = min(NT, n_e - t0);
    PairTable* pairs = reinterpret_cast<PairTable*>(smem_raw + PF_PAIRS_OFFSET);
    if (STAGE == 2) {
        // Read by the epilogue, after the k loop's barriers.
        for (int i = tid; i < nvalid; i += THREADS) {
            const int pair = __ldcg(p.sorted + base + t0 + i);
            pairs->pair[i] = pair;
            pairs->weight[i] = __ldcg(p.topk_w + pair);
        }
    }
    if (TMA) {
#if PF_WGMMA
        if (tid == 0) {
            for (int s = 0; s < PF_STAGES; s++) {
                mbar_init(bars + s, 1);                          // full: this CTA's expect_tx + the bytes
                mbar_init(bars + PF_STAGES + s, THREADS / 32);  // empty: the other CTA's warps
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        // Both CTAs' barriers exist before either sends the other bytes or arrivals.
        if (TMA == 2) cluster_sync();
        else __syncthreads();
#else
        __trap();  // the host launches TMA kernels on sm_90a only
#endif
    } else {
        for (int i = tid; i < NT; i += THREADS)
            srow[i] = i >= nvalid ? -1 : (STAGE == 1 && p.top_k > 0) ? p.sorted[base + t0 + i] / p.top_k : base + t0 + i;
        __syncthreads();
    }
    // Non-gated tiles whose rows end within the first half: those of two halves compute that
    // half only; 8-slot ones split the token columns over their two warpgroups (prefill_tile's
    // SPLIT; not at 192 columns, which would take an m64n96 MMA no other tile uses).
    constexpr bool HALVABLE = PF_HALF_TILES && HALVES == 2 && !GATED;
    constexpr bool SPLITTABLE = PF_SPLIT_TILES && HALVES == 1 && SLOTS == 8 && !GATED;
    const bool one_half = (HALVABLE || SPLITTABLE) && p.rg_out - (int)blockIdx.x * SLOTS <= SLOTS / 2;
#define PF_TILE_HV(NC, HV) prefill_tile<GATED, STAGE, NC, NT, SLOTS, HALVES, HV, TMA>(p, srow, ring, pairs, e, base, n_e, t0, nvalid, tm, bars)
#define PF_TILE_SPLIT(NC) prefill_tile<GATED, STAGE, NC, NT, SLOTS, HALVES, 1, TMA, true>(p, srow, ring, pairs, e, base, n_e, t0, nvalid, tm, bars)
#define PF_TILE(NC)                                         \
    do {                                                    \
        if constexpr (HALVABLE) {                           \
            if (one_half) PF_TILE_HV(NC, 1);                \
            else PF_TILE_HV(NC, 2);                         \
        } else if constexpr (SPLITTABLE && NC != 192) {     \
            if (one_half) PF_TILE_SPLIT(NC);                \
            else PF_TILE_HV(NC, HALVES);                    \
        } else {                                            \
            PF_TILE_HV(NC, HALVES);                         \
        }                                                   \
    } while (0)
    if constexpr (NT == PF_NT_WIDE) {
        if (nvalid > 192) PF_TILE(256);
        else if (nvalid > 128) PF_TILE(192);
        else if (nvalid > 64) PF_TILE(128);
        else PF_TILE(64);
    } else if constexpr (NT == PF_NT_SMALL) {
        // Few tokens per expert (decode-sized batches): 8 columns where they hold the tile.
        if (nvalid > NT / 2) PF_TILE(NT);
        else if (nvalid > NT / 4) PF_TILE(NT / 2);
        else PF_TILE(NT / 4);
    } else {
        if (nvalid > NT / 2) PF_TILE(NT);
        else PF_TILE(NT / 2);
    }
#undef PF_TILE
#undef PF_TILE_HV
#undef PF_TILE_SPLIT
#if PF_WGMMA
    // Neither CTA leaves while the other may still write its shared memory or barriers.
    if (TMA == 2) cluster_sync();
#endif
    if (STAGE == 1 && p.ready) expert_ready_signal(p, e);
}

// 512 threads: one 16-row slot per warp; 256: two (HALVES = 512 / THREADS).
#define PREFILL(NAME, GATED, STAGE, NT, THREADS, BLOCKS)                                          \
    static_assert(THREADS == 256 || THREADS == 512, "a block covers 16 slots with 8 or 16 warps"); \
    extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS) NAME(const GemmParams p) { \
        gemm_enter<STAGE, true>(p);                                                               \
        prefill_body<GATED, STAGE, NT, 16, 512 / THREADS, 0>(p, nullptr);                         \
        gemm_exit<STAGE, true>(p);                                                                \
    }
PREFILL(prefill_gemm1_gated, true, 1, PF_NT, PF_THREADS, 1)
PREFILL(prefill_gemm1_plain, false, 1, PF_NT, PF_THREADS, 1)
PREFILL(prefill_gemm2, false, 2, PF_NT, PF_THREADS, 1)
// Small tiles for a few to a few tens of tokens per expert: the weights stream through
// PF_SMALL_BLOCKS blocks per SM.
PREFILL(prefill_small_gemm1_gated, true, 1, PF_NT_SMALL, PF_THREADS_SMALL, PF_SMALL_BLOCKS)
PREFILL(prefill_small_gemm1_plain, false, 1, PF_NT_SMALL, PF_THREADS_SMALL, PF_SMALL_BLOCKS)
PREFILL(prefill_small_gemm2, false, 2, PF_NT_SMALL, PF_THREADS_SMALL, PF_SMALL_BLOCKS)
// The same tiles with their activation rows by TMA (a 32-row box from the sorted rows): no
// cp.async per thread for them and no proxy fence per chunk (KERNEL_NOTES run 99: the fence
// alone is 2-3.7 % of the layer at 64-256 tokens).
#define PREFILL_SMALL_TMA(NAME, GATED, STAGE)                                                        \
    extern "C" __global__ void __launch_bounds__(PF_THREADS_SMALL, PF_SMALL_BLOCKS)                  \
        NAME(const GemmParams p, const __grid_constant__ TmaMap tm) {                                \
        gemm_enter<STAGE, true>(p);                                                                  \
        prefill_body<GATED, STAGE, PF_NT_SMALL, 16, 2, 1>(p, &tm);                                   \
        gemm_exit<STAGE, true>(p);                                                                   \
    }
PREFILL_SMALL_TMA(prefill_small_tma_gemm1_gated, true, 1)
PREFILL_SMALL_TMA(prefill_small_tma_gemm1_plain, false, 1)
PREFILL_SMALL_TMA(prefill_small_tma_gemm2, false, 2)
// 128-token tiles whose activation rows (in sorted order: GEMM1 reads a gathered copy) come by
// TMA from `tm`: CLUSTER 1, or 2 (grid x even; the two CTAs of a cluster share the token tile
// and multicast half of it each).
#define PREFILL_TMA(NAME, GATED, STAGE, CLUSTER)                                                      \
    extern "C" __global__ void __launch_bounds__(PF_THREADS, 1)                                      \
        NAME(const GemmParams p, const __grid_constant__ TmaMap tm) {                                \
        gemm_enter<STAGE, true>(p);                                                                  \
        prefill_body<GATED, STAGE, PF_NT, 16, 1, CLUSTER>(p, &tm);                                   \
        gemm_exit<STAGE, true>(p);                                                                   \
    }
PREFILL_TMA(prefill_tma1_gemm1_gated, true, 1, 1)
PREFILL_TMA(prefill_tma1_gemm1_plain, false, 1, 1)
PREFILL_TMA(prefill_tma1_gemm2, false, 2, 1)
PREFILL_TMA(prefill_tma2_gemm1_gated, true, 1, 2)
PREFILL_TMA(prefill_tma2_gemm1_plain, false, 1, 2)
PREFILL_TMA(prefill_tma2_gemm2, false, 2, 2)
// TMA-fed tiles of 8 slots (128 weight rows; gated, 64 g rows), THREADS / 32 warps of one slot
// each, NT tokens, BLOCKS blocks per SM.
#define PREFILL_SLOTS8(NAME, GATED, STAGE, NT, THREADS, BLOCKS)                                      \
    extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS)                                    \
        NAME(const GemmParams p, const __grid_constant__ TmaMap tm) {                                \
        gemm_enter<STAGE, true>(p);                                                                  \
        prefill_body<GATED, STAGE, NT, THREADS / 32, 1, 1>(p, &tm);                                  \
        gemm_exit<STAGE, true>(p);                                                                   \
    }
// Wide tiles (KERNEL_NOTES run 44): 256 tokens per block, one block per SM. Each converted A
// fragment feeds 256 token columns (two m64n128k16 per 16 k) instead of 128: half the
// conversion per MAC of the 128-token tiles, for twice the activation bytes per weight row.
PREFILL_SLOTS8(prefill_wide_gemm1_gated, true, 1, PF_NT_WIDE, PF_THREADS_WIDE, 1)
PREFILL_SLOTS8(prefill_wide_gemm1_plain, false, 1, PF_NT_WIDE, PF_THREADS_WIDE, 1)
PREFILL_SLOTS8(prefill_wide_gemm2, false, 2, PF_NT_WIDE, PF_THREADS_WIDE, 1)
// Dual tiles (KERNEL_NOTES session 11): 128 tokens per block, PF_DUAL_BLOCKS blocks per SM
// (108 KB of shared memory each, at most 128 registers). One block's fill, epilogue and chunk
// waits then overlap the other's MMAs: the 256-token tiles, one block per SM, expose them
// (run 56: the epilogue alone is 15-23 % of a GEMM). Each converted fragment feeds 128 columns,
// as on the 128-token tiles.
#define PF_THREADS_DUAL 256
#define PF_DUAL_BLOCKS 2
PREFILL_SLOTS8(prefill_dual_gemm1_gated, true, 1, PF_NT, PF_THREADS_DUAL, PF_DUAL_BLOCKS)
PREFILL_SLOTS8(prefill_dual_gemm1_plain, false, 1, PF_NT, PF_THREADS_DUAL, PF_DUAL_BLOCKS)
PREFILL_SLOTS8(prefill_dual_gemm2, false, 2, PF_NT, PF_THREADS_DUAL, PF_DUAL_BLOCKS)
