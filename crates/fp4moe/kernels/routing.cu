// Routing on the GPU (DESIGN 2): router logits and top-k selection, one warp per token. The
// formulas and the per-warp code are in routing.cuh (shared with route_small.cu).
#include "routing.cuh"

// logits[t, e] = x[t, :] · w[e, :] in f32; RL_WARPS-warp blocks, a logit per group of
// router_slices(T·E) warps (routing.cuh).
#define RL_WARPS 32
extern "C" __global__ void __launch_bounds__(RL_WARPS * 32)
    router_logits(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ logits, int tokens,
                  int hidden, int experts) {
    __shared__ float part[RL_WARPS];
    router_logits_block(x, w, logits, tokens * experts, experts, hidden, part);
}

// The same logits for many tokens: 64 tokens x 64 experts per 256-thread block, each thread
// owning 4 tokens x 4 experts. 32-wide k chunks are staged (transposed) in shared memory; the
// next chunk's loads are in flight while the current one is multiplied. Every logit is one
// thread's sequential sum over k: deterministic. Needs hidden % 4 == 0.
#define RL_TILE 64
#define RL_K 32
#define RL_LD (RL_TILE + 4)
extern "C" __global__ void __launch_bounds__(256) router_logits_tiled(const float* __restrict__ x, const float* __restrict__ w,
                                                                       float* __restrict__ logits, int tokens, int hidden,
                                                                       int experts) {
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
            xs[lk][r] = xv[h].x; xs[lk + 1][r] = xv[h].y; xs[lk + 2][r] = xv[h].z; xs[lk + 3][r] = xv[h].w;
            ws[lk][r] = wv[h].x; ws[lk + 1][r] = wv[h].y; ws[lk + 2][r] = wv[h].z; ws[lk + 3][r] = wv[h].w;
        }
        __syncthreads();
        if (k0 + RL_K < hidden) load(k0 + RL_K);
#pragma unroll
        for (int k = 0; k < RL_K; k++) {
            float4 a = *reinterpret_cast<const float4*>(&xs[k][4 * ty]);
            float4 b = *reinterpret_cast<const float4*>(&ws[k][4 * tx]);
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

// scoring: 0 softmax, 1 sigmoid. bias may be null. Shared memory: 2·E + 64 floats per warp.
extern "C" __global__ void route_topk(const float* __restrict__ logits, const float* __restrict__ bias,
                                      int* __restrict__ ids, float* __restrict__ weights, int tokens,
                                      int experts, int top_k, int scoring, int n_group, int topk_group,
                                      int renormalize, float rsf) {
    extern __shared__ float smem[];
    int wib = threadIdx.x >> 5;
    int t = blockIdx.x * (blockDim.x >> 5) + wib;
    if (t >= tokens) return;  // whole warps exit together
    topk_token(logits + (size_t)t * experts, bias, ids + t * top_k, weights + t * top_k,
               smem + wib * (2 * experts + 64), experts, top_k, scoring, n_group, topk_group, renormalize, rsf);
}
