// Routing on the GPU (DESIGN 2): router logits and top-k selection, one warp per token. The
// formulas and the per-warp code are in routing.cuh (shared with route_small.cu).
#include "routing.cuh"
#include "gemm_common.cuh"  // cp.async

// The cp.async rings of router_logits_wide and router_logits_bf16 over the k chunks [kb, ke) of
// width K, STAGES deep, one commit group per chunk (possibly empty); `stage(b, k0)` issues this
// thread's copies of the chunk starting at k0 into ring stage b. router_logits_tf32x3 (a knob)
// keeps its own copy of the loop: through these helpers its SASS changes, and no GPU run has
// checked that.
// ring_prologue: chunks 0 .. STAGES - 2 into stages 0 .. STAGES - 2; returns the chunk count.
template <int STAGES, int K, typename Stage>
__device__ __forceinline__ int ring_prologue(int kb, int ke, Stage stage) {
    const int chunks = ke > kb ? (ke - kb + K - 1) / K : 0;
#pragma unroll
    for (int c = 0; c < STAGES - 1; c++) {
        if (c < chunks) stage(c, kb + c * K);
        cp_async_commit();
    }
    return chunks;
}
// ring_refill, in iteration c: chunk c + STAGES - 1 into the stage chunk c - 1 used (the caller
// has passed a barrier after every read of it).
template <int STAGES, int K, typename Stage>
__device__ __forceinline__ void ring_refill(int c, int chunks, int kb, Stage stage) {
    const int next = c + STAGES - 1;
    if (next < chunks) stage(next % STAGES, kb + next * K);
    cp_async_commit();
}

// Stores a warp's mma.sync D fragments of N 16 x 8 tiles, tile n at logit rows t0 .. t0 + 15
// (tokens) and columns e0 + 8n .. (experts) of `o` [tokens, experts]: (g, 2q), (g, 2q + 1),
// (g + 8, 2q), (g + 8, 2q + 1); nothing past either bound.
template <int N>
__device__ __forceinline__ void store_logit_tiles(float* o, const float (&acc)[N][4], int t0, int e0, int tokens,
                                                  int experts) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int n = 0; n < N; n++) {
        const int e = e0 + 8 * n + 2 * q;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int t = t0 + g + 8 * h;
            if (t >= tokens) continue;
            if (e < experts) o[(size_t)t * experts + e] = acc[n][2 * h];
            if (e + 1 < experts) o[(size_t)t * experts + e + 1] = acc[n][2 * h + 1];
        }
    }
}

// logits[t, e] = x[t, :] · w[e, :] in f32; RL_WARPS-warp blocks, a logit per group of
// router_slices(T·E) warps (routing.cuh).
#define RL_WARPS 32
extern "C" __global__ void __launch_bounds__(RL_WARPS * 32)
    router_logits(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ logits, int tokens,
                  int hidden, int experts) {
    pdl_enter();
    __shared__ float part[RL_WARPS];
    router_logits_block(x, w, logits, tokens * experts, experts, hidden, part, blockIdx.x, RL_WARPS);
}

// The same logits, bitwise, beyond RL_SLICED_MAX_LOGITS (one warp per logit there): a warp
// computes RM_TOK tokens x RM_EXP experts at once, each logit with router_logit_slice's
// instructions for one slice (lane-strided 16-byte pieces into four fmaf chains in k order,
// (s0 + s1) + (s2 + s3), warp_sum, then router_logits_block's sum over its one slice from 0,
// which turns -0 into +0), so only the loads are shared: per 16-byte step RM_TOK + RM_EXP loads
// feed RM_TOK · RM_EXP logits where a warp per logit took two per logit. The 8 warps of a block
// cover RM_BT = 4·RM_TOK tokens x RM_BE = 2·RM_EXP experts (each x row read by two warps, each
// router row by four, through L1): 16 rows of L2 traffic per 64 logits, where a warp per logit
// read ~33 per 32 (its block's 8 logits share one x row). Needs hidden % 4 == 0 (the layer's
// hidden size is a multiple of 16). Grid: (ceil(E / RM_BE), ceil(T / RM_BT)).
#define RM_TOK 2
#define RM_EXP 4
// 16-byte steps per lane unrolled, for loads in flight: the kernel runs a warp per 8 logits, 8
// warps per SM at 64 tokens (run 159, against 2: the layer up to 3 % faster at 16-112 tokens).
// A knob for FP4MOE_DEFINES.
#ifndef RM_UNROLL
#define RM_UNROLL 4
#endif
#define RM_BT 8
#define RM_BE 8
static_assert(RM_BT == 4 * RM_TOK && RM_BE == 2 * RM_EXP, "8 warps: 4 token groups x 2 expert groups");
extern "C" __global__ void __launch_bounds__(256) router_logits_multi(const float* __restrict__ x,
                                                                      const float* __restrict__ w,
                                                                      float* __restrict__ logits, int tokens,
                                                                      int hidden, int experts) {
    pdl_enter();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t0 = blockIdx.y * RM_BT + (warp >> 1) * RM_TOK;
    const int e0 = blockIdx.x * RM_BE + (warp & 1) * RM_EXP;
    if (t0 >= tokens || e0 >= experts) return;  // whole warps; no block barrier below
    const int n4 = hidden / 4;
    // Rows past the end repeat the last one (their sums are not stored).
    const float4* xr[RM_TOK];
    const float4* wr[RM_EXP];
#pragma unroll
    for (int i = 0; i < RM_TOK; i++) xr[i] = reinterpret_cast<const float4*>(x) + (size_t)min(t0 + i, tokens - 1) * n4;
#pragma unroll
    for (int j = 0; j < RM_EXP; j++)
        wr[j] = reinterpret_cast<const float4*>(w) + (size_t)min(e0 + j, experts - 1) * n4;
    float s[RM_TOK][RM_EXP][4];
#pragma unroll
    for (int i = 0; i < RM_TOK; i++)
#pragma unroll
        for (int j = 0; j < RM_EXP; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) s[i][j][c] = 0.0f;
#pragma unroll RM_UNROLL
    for (int c = lane; c < n4; c += 32) {
        float4 a[RM_TOK], b[RM_EXP];
#pragma unroll
        for (int i = 0; i < RM_TOK; i++) a[i] = xr[i][c];
#pragma unroll
        for (int j = 0; j < RM_EXP; j++) b[j] = wr[j][c];
#pragma unroll
        for (int i = 0; i < RM_TOK; i++)
#pragma unroll
            for (int j = 0; j < RM_EXP; j++) {
                s[i][j][0] = fmaf(a[i].x, b[j].x, s[i][j][0]);
                s[i][j][1] = fmaf(a[i].y, b[j].y, s[i][j][1]);
                s[i][j][2] = fmaf(a[i].z, b[j].z, s[i][j][2]);
                s[i][j][3] = fmaf(a[i].w, b[j].w, s[i][j][3]);
            }
    }
#pragma unroll
    for (int i = 0; i < RM_TOK; i++)
#pragma unroll
        for (int j = 0; j < RM_EXP; j++) {
            const float v = warp_sum((s[i][j][0] + s[i][j][1]) + (s[i][j][2] + s[i][j][3]));
            if (lane == 0 && t0 + i < tokens && e0 + j < experts)
                logits[(size_t)(t0 + i) * experts + e0 + j] = 0.0f + v;
        }
}

// The same logits for many tokens: 64 tokens x 64 experts per 256-thread block, each thread
// owning 4 tokens x 4 experts. 32-wide k chunks are staged (transposed) in shared memory; the
// next chunk's loads are in flight while the current one is multiplied. Every logit is one
// thread's sequential sum over k: deterministic. Needs hidden % 4 == 0.
// Staging layout: row k of the chunk holds token (expert) c at column c ^ rl_swz(k), the XOR
// moving whole groups of 4 columns (so each thread's 4 tokens stay one aligned float4). A warp's
// loader lanes hold 4 rows x 8 k groups (128 contiguous bytes per row: coalesced loads); without
// the swizzle their transposed stores hit 4 banks 4 times each (4-way conflicts, the shared pipe
// 83 % busy at 4096 tokens, run 61); with it k group m moves to column group m, 32 banks.
#define RL_TILE 64
#define RL_K 32
#define RL_LD RL_TILE
__device__ __forceinline__ int rl_swz(int k) { return ((k >> 2) & 7) << 2; }
extern "C" __global__ void __launch_bounds__(256) router_logits_tiled(const float* __restrict__ x, const float* __restrict__ w,
                                                                       float* __restrict__ logits, int tokens, int hidden,
                                                                       int experts) {
    pdl_enter();
    __shared__ __align__(16) float xs[RL_K][RL_LD];  // [k][token]
    __shared__ __align__(16) float ws[RL_K][RL_LD];  // [k][expert]
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int t0 = blockIdx.x * RL_TILE, e0 = blockIdx.y * RL_TILE;
    // Loader: rows lr and lr + 32, k lk..lk+3 of the chunk.
    const int lr = tid >> 3, lk = (tid & 7) * 4;
    float4 xv[2], wv[2];
    auto load = [&](int k0) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = lr + 32 * h;
            bool kin = k0 + lk < hidden;
            xv[h] = (t0 + r < tokens && kin) ? *reinterpret_cast<const float4*>(x + (size_t)(t0 + r) * hidden + k0 + lk)
                                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            wv[h] = (e0 + r < experts && kin) ? *reinterpret_cast<const float4*>(w + (size_t)(e0 + r) * hidden + k0 + lk)
                                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    };
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    load(0);
    for (int k0 = 0; k0 < hidden; k0 += RL_K) {
        __syncthreads();  // the previous chunk is consumed
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = lr + 32 * h;
            // lk..lk + 3 share one k group, hence one swizzle.
            const int c = r ^ rl_swz(lk);
            xs[lk][c] = xv[h].x; xs[lk + 1][c] = xv[h].y; xs[lk + 2][c] = xv[h].z; xs[lk + 3][c] = xv[h].w;
            ws[lk][c] = wv[h].x; ws[lk + 1][c] = wv[h].y; ws[lk + 2][c] = wv[h].z; ws[lk + 3][c] = wv[h].w;
        }
        __syncthreads();
        if (k0 + RL_K < hidden) load(k0 + RL_K);
#pragma unroll
        for (int k = 0; k < RL_K; k++) {
            float4 a = *reinterpret_cast<const float4*>(&xs[k][(4 * ty) ^ rl_swz(k)]);
            float4 b = *reinterpret_cast<const float4*>(&ws[k][(4 * tx) ^ rl_swz(k)]);
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int t = t0 + 4 * ty + i, e = e0 + 4 * tx + j;
            if (t < tokens && e < experts) logits[(size_t)t * experts + e] = acc[i][j];
        }
}

// The same logits for many tokens, 64 tokens x 128 experts per 128-thread block: every thread
// owns 8 tokens x 8 experts (16 FMAs per 16-byte shared-memory load: 256 per 4 k from 16
// loads, against 8 per load in router_logits_tiled), so the x tile is read once per 128
// experts (x is T·H·4 bytes: 176 MB at 16384 tokens of Nemotron). Chunks of RW_K k go through an RW_STAGES-deep cp.async ring,
// row-major ([token][k], [expert][k], row stride RW_LD = 20 floats: the 8 expert rows and the 4
// token rows a warp reads at one k group start on distinct 4-bank groups, conflict-free), read
// back as float4 of 4 consecutive k; each logit is its thread's sequential sum over k
// (fmaf in k order), as in router_logits_tiled, so one split gives that kernel's bits.
// Split over k (grid z = splits, `k_split` k each, a multiple of RW_K): slice z writes its
// partial sums to out + z·T·E and router_sum_splits adds them in slice order (fixed, on every
// device: the split count depends on T, H and E only). Warp w owns tokens 32·(w / 2) + ty + 4·i
// and experts 64·(w % 2) + tx + 8·j (lane = 8·ty + tx, i, j < 8). Needs hidden % 4 == 0.
#define RW_TOK 64
#define RW_EXP 128
#define RW_K 16
#define RW_LD 20
#define RW_STAGES 4
#define RW_THREADS 128
extern "C" __global__ void __launch_bounds__(RW_THREADS, 2) router_logits_wide(const float* __restrict__ x, const float* __restrict__ w,
                                                                        float* __restrict__ out, int tokens, int hidden,
                                                                        int experts, int k_split) {
    pdl_enter();
    extern __shared__ __align__(16) float rw_smem[];
    constexpr int STAGE = (RW_TOK + RW_EXP) * RW_LD;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, ty = lane >> 3, tx = lane & 7;
    const int t0 = blockIdx.x * RW_TOK, e0 = blockIdx.y * RW_EXP;
    const int kb = blockIdx.z * k_split, ke = min(hidden, kb + k_split);
    // Chunk k0 into stage b: 64 token rows, then 128 expert rows, of 4 pieces of 16 bytes; zero
    // past the matrices and past this slice's k (hidden % 4 == 0 and ke % 4 == 0: a piece is all
    // in or all out).
    auto stage = [&](int b, int k0) {
        float* s = rw_smem + b * STAGE;
#pragma unroll
        for (int i = tid; i < (RW_TOK + RW_EXP) * 4; i += RW_THREADS) {
            const int row = i >> 2, c = (i & 3) * 4;
            const bool is_x = row < RW_TOK;
            const int r = is_x ? t0 + row : e0 + row - RW_TOK;
            const bool ok = (is_x ? r < tokens : r < experts) && k0 + c < ke;
            const float* src = is_x ? x : w;
            cp_async16(s + row * RW_LD + c, ok ? src + (size_t)r * hidden + k0 + c : src, ok ? 16 : 0);
        }
    };
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;
    const int chunks = ring_prologue<RW_STAGES, RW_K>(kb, ke, stage);
    const int xr = 32 * (warp >> 1) + ty, er = RW_TOK + 64 * (warp & 1) + tx;
    for (int c = 0; c < chunks; c++) {
        cp_async_wait<RW_STAGES - 2>();  // chunk c has landed (for this thread's copies)
        __syncthreads();                 // for everyone's; and chunk c - 1's stage is free
        ring_refill<RW_STAGES, RW_K>(c, chunks, kb, stage);
        const float* s = rw_smem + (c % RW_STAGES) * STAGE;
#pragma unroll
        for (int kk = 0; kk < RW_K; kk += 4) {
            float4 b[8];
#pragma unroll
            for (int j = 0; j < 8; j++) b[j] = *reinterpret_cast<const float4*>(s + (er + 8 * j) * RW_LD + kk);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float4 a = *reinterpret_cast<const float4*>(s + (xr + 4 * i) * RW_LD + kk);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float v = acc[i][j];
                    v = fmaf(a.x, b[j].x, v);
                    v = fmaf(a.y, b[j].y, v);
                    v = fmaf(a.z, b[j].z, v);
                    acc[i][j] = fmaf(a.w, b[j].w, v);
                }
            }
        }
    }
    float* o = out + (size_t)blockIdx.z * tokens * experts;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int t = t0 + xr + 4 * i;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int e = e0 + er - RW_TOK + 8 * j;
            if (t < tokens && e < experts) o[(size_t)t * experts + e] = acc[i][j];
        }
    }
}

// logits[i] = part[0·n + i] + part[1·n + i] + ... in slice order (router_logits_wide's split).
extern "C" __global__ void __launch_bounds__(256) router_sum_splits(const float* __restrict__ part, float* __restrict__ logits,
                                                                    int n, int splits) {
    pdl_enter();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = part[i];
        for (int s = 1; s < splits; s++) v += part[(size_t)s * n + i];
        logits[i] = v;
    }
}

// The same logits on tensor cores in split TF32 ("3xTF32"): each f32 operand v = hi + lo with
// hi = tf32(v) and lo = tf32(v - hi) (round to nearest, ties away: cvt.rna), and each product
// x·w = lo_x·hi_w + hi_x·lo_w + hi_x·hi_w (the small terms first; lo_x·lo_w, ~2^-22 of it,
// dropped), accumulated by mma.sync m16n8k8 into a per-chunk partial sum that an ordinary f32
// add folds into the logit after every 32 k (a tensor core may truncate its f32 accumulation:
// over all 2688 k, emulated truncation reached 2.5e-5 relative error; per 32-k chunk it stays
// ~3e-7). Deterministic: k in order. bf16-exact operands have lo = 0 (exact products).
// Tile: 32 tokens x 32 experts per 128-thread block, warp w computing tokens 16·(w / 2).. and
// experts 16·(w % 2).. (one m16 x two n8 MMA tiles): small tiles, as the kernel runs where the
// SIMT kernel's 64 x 64 tiles leave most SMs idle (runs 58–59: 64-token TF32 tiles were
// slower than the SIMT kernel once either fills the GPU). 32-k chunks go through an
// RT_STAGES-deep cp.async ring, row-major with a 36-float row stride: the fragment reads (row
// g + const, column q + const of an 8 x 4 lane grid) and the 16-byte copies are free of bank
// conflicts. Needs hidden % 4 == 0 and sm_80. Non-finite operands: hi = ±inf makes lo = NaN, so
// an infinite input gives a NaN logit where the f32 sum gives ±inf (both are outside what a
// layer's activations and router weights hold).
#define RT_TOK 32
#define RT_EXP 32
#define RT_K 32
#define RT_LD 36
#define RT_STAGES 3
#define RT_THREADS 128
__device__ __forceinline__ void split_tf32(float v, u32& hi, u32& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(v));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(v - __uint_as_float(hi)));
}
__device__ __forceinline__ void mma_tf32_1688(float d[4], const u32 a[4], const u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
extern "C" __global__ void __launch_bounds__(RT_THREADS) router_logits_tf32x3(const float* __restrict__ x, const float* __restrict__ w,
                                                                         float* __restrict__ logits, int tokens, int hidden,
                                                                         int experts) {
    pdl_enter();
    constexpr int TOK = RT_TOK, THREADS = RT_THREADS;
    __shared__ __align__(16) float xs[RT_STAGES][TOK][RT_LD];
    __shared__ __align__(16) float ws[RT_STAGES][RT_EXP][RT_LD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int t0 = blockIdx.x * TOK, e0 = blockIdx.y * RT_EXP;
    const int wr = 16 * (warp >> 1), wc = 16 * (warp & 1);
    // Chunk k0 into stage b: TOK token rows and RT_EXP expert rows of 8 pieces of 16 bytes;
    // zero past the matrices (hidden % 4 == 0: a piece is all in or all out).
    auto stage = [&](int b, int k0) {
#pragma unroll
        for (int i = tid; i < TOK * 8; i += THREADS) {
            const int row = i >> 3, c = (i & 7) * 4;
            const bool ok = t0 + row < tokens && k0 + c < hidden;
            cp_async16(&xs[b][row][c], ok ? x + (size_t)(t0 + row) * hidden + k0 + c : x, ok ? 16 : 0);
        }
#pragma unroll
        for (int i = tid; i < RT_EXP * 8; i += THREADS) {
            const int row = i >> 3, c = (i & 7) * 4;
            const bool ok = e0 + row < experts && k0 + c < hidden;
            cp_async16(&ws[b][row][c], ok ? w + (size_t)(e0 + row) * hidden + k0 + c : w, ok ? 16 : 0);
        }
    };
    float acc[2][4];
#pragma unroll
    for (int n = 0; n < 2; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
    const int chunks = (hidden + RT_K - 1) / RT_K;
#pragma unroll
    for (int c = 0; c < RT_STAGES - 1; c++) {
        if (c < chunks) stage(c, c * RT_K);
        cp_async_commit();  // possibly empty: one group per chunk
    }
    for (int c = 0; c < chunks; c++) {
        // Stage (c + RT_STAGES - 1) % RT_STAGES was last read in iteration c - 1, which ended
        // with a barrier.
        const int next = c + RT_STAGES - 1;
        if (next < chunks) stage(next % RT_STAGES, next * RT_K);
        cp_async_commit();
        cp_async_wait<RT_STAGES - 1>();  // chunk c has landed
        __syncthreads();
        const int b = c % RT_STAGES;
        float part[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) part[n][i] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < RT_K; kk += 8) {
            // A (16 x 8, row-major): (g, q), (g + 8, q), (g, q + 4), (g + 8, q + 4).
            u32 ah[4], al[4];
            split_tf32(xs[b][wr + g][kk + q], ah[0], al[0]);
            split_tf32(xs[b][wr + g + 8][kk + q], ah[1], al[1]);
            split_tf32(xs[b][wr + g][kk + q + 4], ah[2], al[2]);
            split_tf32(xs[b][wr + g + 8][kk + q + 4], ah[3], al[3]);
#pragma unroll
            for (int n = 0; n < 2; n++) {
                // B (8 x 8, column-major = the router rows): (k q, expert g), (k q + 4, expert g).
                u32 bh[2], bl[2];
                split_tf32(ws[b][wc + 8 * n + g][kk + q], bh[0], bl[0]);
                split_tf32(ws[b][wc + 8 * n + g][kk + q + 4], bh[1], bl[1]);
                mma_tf32_1688(part[n], al, bh);
                mma_tf32_1688(part[n], ah, bl);
                mma_tf32_1688(part[n], ah, bh);
            }
        }
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[n][i] += part[n][i];
        __syncthreads();
    }
    store_logit_tiles(logits, acc, t0 + wr, e0 + wc, tokens, experts);
}
// scoring: 0 softmax, 1 sigmoid. bias may be null. Shared memory: 2·E + 64 floats per warp.
extern "C" __global__ void route_topk(const float* __restrict__ logits, const float* __restrict__ bias,
                                      int* __restrict__ ids, float* __restrict__ weights, int tokens,
                                      int experts, int top_k, int scoring, int n_group, int topk_group,
                                      int renormalize, float rsf) {
    // The bias is a weight (no predecessor writes it), and between forwards the expert weights
    // stream through L2 and evict it: its lines start towards L1 before the wait, so its loads
    // below need not go to DRAM after the logits are ready.
    if (TOPK_BIAS_PREFETCH && bias && threadIdx.x < 32 && threadIdx.x * 32 < experts)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(bias + threadIdx.x * 32));
    pdl_enter();
    extern __shared__ float smem[];
    int wib = threadIdx.x >> 5;
    int t = blockIdx.x * (blockDim.x >> 5) + wib;
    if (t >= tokens) return;  // whole warps exit together
    topk_token(logits + (size_t)t * experts, bias, ids + t * top_k, weights + t * top_k,
               smem + wib * (2 * experts + 64), experts, top_k, scoring, n_group, topk_group, renormalize, rsf);
}

// The same logits on bf16 tensor cores, for router weights that are bf16 values (checked at
// upload; a router stored as bf16 in its checkpoint, the usual case, loads as such). Each x value splits
// exactly into three bf16 pieces, v = hi + mid + lo (hi = bf16(v), mid = bf16(v - hi), lo = v -
// hi - mid: 8 + 8 + 8 significand bits cover f32's 24), so every product x·w is exact and only
// the accumulation rounds. A warp whose 16 x 16 A fragment is all bf16 values (activations of a
// bf16 model: mid = lo = 0) issues the hi MMA alone; otherwise lo, mid, then hi. Skipping MMAs
// of an all-zero A adds nothing, so the logits do not depend on which path a warp took. The MMAs
// of each 32-k chunk accumulate from zero into a partial sum that an ordinary f32 add folds
// into the logit (a tensor core may truncate its f32 accumulation; per chunk that stays ~3e-7,
// see router_logits_tf32x3). Deterministic: k in order, the k split of router_wide_splits' rule
// (with 32-k chunks) summed in slice order by router_sum_splits.
// Tiles: 64 tokens x 128 experts per 256-thread block (router_logits_bf16; warp w computes
// tokens 16·(w % 4).. and experts 64·(w / 4)..: one m16 x eight n8 MMA tiles), or 16 tokens x 128
// experts per RB16_WARPS-warp block (router_logits_bf16_t16; warp w computes the tile's 16 tokens
// and experts (128 / RB16_WARPS)·w..): more, shorter blocks where a batch has few 64-token tiles
// (a block's k loop is a latency chain; 8 warps of two n8 tiles rather than 4 of four: run 215,
// 14.5 -> 11.4 us at 512 tokens under ncu, routing -1.5 / -3.5 us at 256 / 512 tokens; 16 warps
// on the 64-token tile were slower, run 214: docs/experiments/router-16warps.patch). Each logit
// sees the same MMAs in the same order in both (the same 16-token warp groups, so the same
// exactness test; the same chunks and k split), so both give the same bits. 32-k chunks of x
// (f32, row stride RB_XLD floats: the lanes' 8-byte fragment reads are conflict-free per half
// warp) and of the bf16 router (row stride RB_WLD: conflict-free ldmatrix) go through an
// RB_STAGES-deep cp.async ring. wb is the router padded with zeros to a multiple of RB_EXP rows and RB_K columns
// (row stride hidden_pad), so its copies need no bounds; x's need hidden % 4 == 0. Non-finite
// or huge x (hi rounding to ±inf) gives NaN logits where the f32 sum may give ±inf; x below
// 2^-110 may lose low bits in lo (bf16 subnormals): outside what activations hold.
#define RB_TOK 64
#define RB_EXP 128
#define RB_K 32
#define RB_XLD 40
#define RB_WLD 40
#define RB_STAGES 4
#define RB_THREADS 256
// Two floats' top halves as a packed bf16 pair (v.x in the low half), their low halves OR-ed
// into `low`. A float is a bf16 value iff its low half is zero, and then its top half is that
// value (the pair bf16x2_split rounds to), so `low & 0xffff == 0` over a fragment says every
// float of it is a bf16 value and these pairs are its hi (bit for bit, NaN aside: a NaN x gives
// NaN logits either way), at two operations per pair instead of a rounding, two widenings and
// two compares.
__device__ __forceinline__ u32 bf16x2_top(float2 v, u32& low) {
    const u32 a = __float_as_uint(v.x), b = __float_as_uint(v.y);
    low |= a | b;
    return __byte_perm(a, b, 0x7632);
}
// Two floats (v.x at the lower column) as v = hi + mid + lo in packed bf16 pairs: hi = bf16(v),
// mid = bf16(v - hi), lo = v - hi - mid (both differences exact; at most 8 significand bits are
// left for lo).
__device__ __forceinline__ void bf16x2_split(float2 v, u32& hi, u32& mid, u32& lo) {
    hi = bf16x2_bits(__floats2bfloat162_rn(v.x, v.y));
    const float2 h = __bfloat1622float2(bits_bf16x2(hi));
    const float r0 = v.x - h.x, r1 = v.y - h.y;
    mid = bf16x2_bits(__floats2bfloat162_rn(r0, r1));
    const float2 m = __bfloat1622float2(bits_bf16x2(mid));
    lo = bf16x2_bits(__floats2bfloat162_rn(r0 - m.x, r1 - m.y));
}
#ifndef RB16_WARPS
#define RB16_WARPS 8
#endif
static_assert(RB16_WARPS == 2 || RB16_WARPS == 4 || RB16_WARPS == 8, "two n8 tiles per ldmatrix.x4");
template <int TOK, int WARPS>
__device__ __forceinline__ void router_bf16_tile(const float* __restrict__ x, const u16* __restrict__ wb,
                                                 float* __restrict__ out, int tokens, int hidden, int hidden_pad,
                                                 int experts, int k_split) {
    constexpr int THREADS = WARPS * 32;
    constexpr int TG = TOK / 16;         // 16-token warp groups
    constexpr int EPW = RB_EXP * TG / WARPS;  // experts per warp
    constexpr int NT = EPW / 8;          // n8 MMA tiles per warp
    constexpr int STAGE_BYTES = TOK * RB_XLD * 4 + RB_EXP * RB_WLD * 2;
    static_assert(TOK % 16 == 0 && WARPS % TG == 0 && NT % 2 == 0, "whole ldmatrix.x4 pairs per warp");
    extern __shared__ __align__(16) unsigned char rb_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int t0 = blockIdx.x * TOK, e0 = blockIdx.y * RB_EXP;
    const int kb = blockIdx.z * k_split, ke = min(hidden, kb + k_split);
    auto xs = [&](int b) { return reinterpret_cast<float*>(rb_smem + b * STAGE_BYTES); };
    auto wsm = [&](int b) { return reinterpret_cast<u16*>(rb_smem + b * STAGE_BYTES + TOK * RB_XLD * 4); };
    // Chunk k0 into stage b: TOK x rows of 8 16-byte pieces (zero past T and past the slice's k:
    // hidden % 4 == 0 and ke % 4 == 0, so a piece is all in or all out), 128 router rows of 4
    // (always inside the padded router; columns past ke meet zero x).
    auto stage = [&](int b, int k0) {
        float* sx = xs(b);
        u16* sw = wsm(b);
#pragma unroll
        for (int i = tid; i < TOK * 8; i += THREADS) {
            const int row = i >> 3, c = (i & 7) * 4;
            const bool ok = t0 + row < tokens && k0 + c < ke;
            cp_async16(sx + row * RB_XLD + c, ok ? x + (size_t)(t0 + row) * hidden + k0 + c : x, ok ? 16 : 0);
        }
#pragma unroll
        for (int i = tid; i < RB_EXP * 4; i += THREADS) {
            const int row = i >> 2, c = (i & 3) * 8;
            cp_async16(sw + row * RB_WLD + c, wb + (size_t)(e0 + row) * hidden_pad + k0 + c, 16);
        }
    };
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
    const int chunks = ring_prologue<RB_STAGES, RB_K>(kb, ke, stage);
    const int wr = 16 * (warp % TG), wc = EPW * (warp / TG);
    // ldmatrix.x4: lane l addresses row (l % 8) of matrix l / 8; matrices (n tile 2p, k 0-7),
    // (2p, k 8-15), (2p + 1, k 0-7), (2p + 1, k 8-15) are the b0, b1 of two n tiles.
    const int lrow = wc + (lane & 7) + 8 * (lane >> 4), lcol = 8 * ((lane >> 3) & 1);
    for (int c = 0; c < chunks; c++) {
        cp_async_wait<RB_STAGES - 2>();  // chunk c has landed (for this thread's copies)
        __syncthreads();                 // for everyone's; and chunk c - 1's stage is free
        ring_refill<RB_STAGES, RB_K>(c, chunks, kb, stage);
        const float* sx = xs(c % RB_STAGES);
        const u16* sw = wsm(c % RB_STAGES);
        float part[NT][4];
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) part[n][i] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < RB_K; kk += 16) {
            // A (16 x 16, row-major): (g, 2q..), (g + 8, 2q..), (g, 2q + 8..), (g + 8, 2q + 8..).
            float2 v[4];
            u32 ah[4], am[4], al[4], low = 0;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                v[i] = *reinterpret_cast<const float2*>(sx + (wr + g + 8 * (i & 1)) * RB_XLD + kk + 2 * q + 8 * (i >> 1));
                ah[i] = bf16x2_top(v[i], low);
            }
            const bool all_exact = __all_sync(FULL_MASK, (low & 0xffffu) == 0);
            if (!all_exact) {
#pragma unroll
                for (int i = 0; i < 4; i++) bf16x2_split(v[i], ah[i], am[i], al[i]);  // hi rounded
            }
#pragma unroll
            for (int p = 0; p < NT / 2; p++) {
                u32 b[4];
                ldsm_x4(b, smem_u32(sw + (lrow + 16 * p) * RB_WLD + kk + lcol));
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float* d = part[2 * p + h];
                    if (!all_exact) {
                        mma_bf16_16816(d, al, b[2 * h], b[2 * h + 1]);
                        mma_bf16_16816(d, am, b[2 * h], b[2 * h + 1]);
                    }
                    mma_bf16_16816(d, ah, b[2 * h], b[2 * h + 1]);
                }
            }
        }
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[n][i] += part[n][i];
    }
    store_logit_tiles(out + (size_t)blockIdx.z * tokens * experts, acc, t0 + wr, e0 + wc, tokens, experts);
}
extern "C" __global__ void __launch_bounds__(RB_THREADS, 2) router_logits_bf16(const float* __restrict__ x,
                                                                               const u16* __restrict__ wb,
                                                                               float* __restrict__ out, int tokens,
                                                                               int hidden, int hidden_pad,
                                                                               int experts, int k_split) {
    pdl_enter();
    router_bf16_tile<RB_TOK, RB_THREADS / 32>(x, wb, out, tokens, hidden, hidden_pad, experts, k_split);
}
#define RB16_TOK 16
extern "C" __global__ void __launch_bounds__(RB16_WARPS * 32) router_logits_bf16_t16(const float* __restrict__ x,
                                                                                     const u16* __restrict__ wb,
                                                                                     float* __restrict__ out, int tokens,
                                                                                     int hidden, int hidden_pad,
                                                                                     int experts, int k_split) {
    pdl_enter();
    router_bf16_tile<RB16_TOK, RB16_WARPS>(x, wb, out, tokens, hidden, hidden_pad, experts, k_split);
}
