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

// logits[t, e] = x[t, :] · w[e, :] in f32 by one warp. With hidden % 4 == 0 each lane takes
// 16-byte pieces c = lane, lane + 32, ... into four partial sums (one per component), added
// pairwise, then warp_sum; eight pieces per lane are in flight at once, so a logit costs a few
// memory round trips instead of hidden / 32 (a scalar loop was latency-bound: ~8 µs at T = 1,
// KERNEL_NOTES run 21). Otherwise lane-strided scalars. Every lane gets the logit.
__device__ __forceinline__ float router_logit(const float* x, const float* w, int t, int e, int hidden) {
    int lane = threadIdx.x & 31;
    const float* xr = x + (size_t)t * hidden;
    const float* wr = w + (size_t)e * hidden;
    float acc = 0.0f;
    if ((hidden & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(wr);
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma unroll 8
        for (int c = lane; c < hidden / 4; c += 32) {
            float4 a = x4[c], b = w4[c];
            s0 = fmaf(a.x, b.x, s0);
            s1 = fmaf(a.y, b.y, s1);
            s2 = fmaf(a.z, b.z, s2);
            s3 = fmaf(a.w, b.w, s3);
        }
        acc = (s0 + s1) + (s2 + s3);
    } else {
        for (int c = lane; c < hidden; c += 32) acc += xr[c] * wr[c];
    }
    return warp_sum(acc);
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
