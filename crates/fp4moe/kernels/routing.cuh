// Routing device code shared by routing.cu (router_logits, route_topk) and route_small.cu, so
// both launch paths compute logits and selections with the very same instructions (bitwise
// identical results).
//
// scores = softmax(logits) or sigmoid(logits); selection ranks scores + bias; with n_group > 1
// the topk_group best groups (sum of top-2 biased scores, max without a bias) stay; weights are
// the unbiased scores of the chosen ids, renormalized (zero sum = 1), times rsf. Ties go to the
// lower id. Ids are written in rank order. Limits (checked by the host): E <= 1024, top_k <= 32,
// n_group <= 32.
#pragma once
#include "common.cuh"

// logits[t, e] = x[t, :] · w[e, :] in f32 by `slices` warps (router_slices: RL_SLICES for up to
// RL_SLICED_MAX_LOGITS logits, else 1): warp s sums k slice s (router_logit_slice), then the
// slices are added in order. With hidden % 4 == 0
// each lane takes the slice's 16-byte pieces c = lo + lane, lo + lane + 32, ... into four
// partial sums (one per component), added pairwise, then warp_sum. Splitting K over 8 warps
// puts a logit's loads in flight at once (one memory round trip at 2688 wide, where one warp
// per logit needed three; and at one token the 128 logits spread over 32 SMs, not 4): 2 µs less
// routing at one token (KERNEL_NOTES run 28). With many logits the sliced warps' loads are a
// third full and routing slowed 1.6× at 256 tokens (run 30), hence one warp per logit there.
// Otherwise lane-strided scalars. Every lane gets the slice's sum.
#define RL_SLICES 8
#define RL_SLICED_MAX_LOGITS 1024
__device__ __forceinline__ int router_slices(int logits) { return logits <= RL_SLICED_MAX_LOGITS ? RL_SLICES : 1; }

__device__ __forceinline__ float router_logit_slice(const float* x, const float* w, int t, int e, int hidden, int s,
                                                    int slices) {
    int lane = threadIdx.x & 31;
    const float* xr = x + (size_t)t * hidden;
    const float* wr = w + (size_t)e * hidden;
    float acc = 0.0f;
    if ((hidden & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(wr);
        const int n4 = hidden / 4, lo = s * n4 / slices, hi = (s + 1) * n4 / slices;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma unroll 4
        for (int c = lo + lane; c < hi; c += 32) {
            float4 a = x4[c], b = w4[c];
            s0 = fmaf(a.x, b.x, s0);
            s1 = fmaf(a.y, b.y, s1);
            s2 = fmaf(a.z, b.z, s2);
            s3 = fmaf(a.w, b.w, s3);
        }
        acc = (s0 + s1) + (s2 + s3);
    } else {
        const int lo = s * hidden / slices, hi = (s + 1) * hidden / slices;
        for (int c = lo + lane; c < hi; c += 32) acc += xr[c] * wr[c];
    }
    return warp_sum(acc);
}

// This block's logits of `count`: groups of router_slices(count) warps, group gi computing logit
// blockIdx.x · groups + gi (when below count), slice sums through `part` (one float per warp of
// shared memory), the group's first warp adding them in order. Every thread of the block must
// call it (one __syncthreads).
__device__ __forceinline__ void router_logits_block(const float* x, const float* w, float* logits, int count,
                                                    int experts, int hidden, float* part) {
    const int slices = router_slices(count), groups = (blockDim.x >> 5) / slices;
    const int warp = threadIdx.x >> 5, gi = warp / slices, s = warp % slices;
    const int logit = blockIdx.x * groups + gi;
    if (logit < count) {
        float v = router_logit_slice(x, w, logit / experts, logit % experts, hidden, s, slices);
        if ((threadIdx.x & 31) == 0) part[warp] = v;
    }
    __syncthreads();
    if (s == 0 && (threadIdx.x & 31) == 0 && logit < count) {
        float acc = 0.0f;
        for (int i = 0; i < slices; i++) acc += part[gi * slices + i];
        logits[logit] = acc;
    }
}

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Warp argmax over `vals[0..n)` with ties to the lower index; every lane gets the result.
__device__ __forceinline__ int warp_argmax(const float* vals, int n) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x & 31; i < n; i += 32)
        if (better(vals[i], i, bv, bi)) { bv = vals[i]; bi = i; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    return bi;
}

// Top-k of one token by one whole warp: logits l[0..E) → ids[0..k), weights[0..k).
// scoring: 0 softmax, 1 sigmoid; bias may be null. `scratch`: 2·E + 64 floats of shared memory
// owned by this warp. Logits are read with __ldcg (L2, not L1): in route_small other blocks of
// the same launch wrote them, and an L1 line of this SM could be stale.
__device__ void topk_token(const float* l, const float* bias, int* ids, float* weights, float* scratch,
                           int experts, int top_k, int scoring, int n_group, int topk_group, int renormalize,
                           float rsf) {
    int lane = threadIdx.x & 31;
    float* scores = scratch;
    float* biased = scores + experts;
    float* gsc = biased + experts;  // [32] group scores, [32] chosen scores
    float* chosen = gsc + 32;

    if (scoring == 0) {
        float m = -INFINITY;
        for (int e = lane; e < experts; e += 32) m = fmaxf(m, __ldcg(l + e));
        m = warp_max(m);
        float s = 0.0f;
        for (int e = lane; e < experts; e += 32) {
            float v = expf(__ldcg(l + e) - m);
            scores[e] = v;
            s += v;
        }
        s = warp_sum(s);
        for (int e = lane; e < experts; e += 32) scores[e] = scores[e] / s;
    } else {
        for (int e = lane; e < experts; e += 32) scores[e] = 1.0f / (1.0f + expf(-__ldcg(l + e)));
    }
    __syncwarp();
    for (int e = lane; e < experts; e += 32) biased[e] = scores[e] + (bias ? bias[e] : 0.0f);
    __syncwarp();

    if (n_group > 1) {
        int per = experts / n_group;
        if (lane < n_group) {
            const float* g = biased + lane * per;
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int i = 0; i < per; i++) {
                float v = g[i];
                if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) { b2 = v; }
            }
            gsc[lane] = bias ? (per > 1 ? b1 + b2 : b1) : b1;
        }
        __syncwarp();
        u32 keep = 0;
        for (int r = 0; r < topk_group; r++) {
            int g = warp_argmax(gsc, n_group);
            keep |= 1u << g;
            __syncwarp();
            if (lane == 0) gsc[g] = -INFINITY;
            __syncwarp();
        }
        for (int e = lane; e < experts; e += 32)
            if (!((keep >> (e / per)) & 1u)) biased[e] = -INFINITY;
        __syncwarp();
    }

    for (int r = 0; r < top_k; r++) {
        int e = warp_argmax(biased, experts);
        __syncwarp();
        if (lane == 0) {
            ids[r] = e;
            chosen[r] = scores[e];
            biased[e] = -INFINITY;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float s = 0.0f;
        for (int r = 0; r < top_k; r++) s += chosen[r];
        if (!renormalize || s == 0.0f) s = 1.0f;
        for (int r = 0; r < top_k; r++) weights[r] = chosen[r] / s * rsf;
    }
    __syncwarp();  // the warp may take another token into the same scratch next
}
