// Routing device code shared by routing.cu (router_logits, route_topk) and route_small.cu, so
// both launch paths compute logits and selections with the very same instructions (bitwise
// identical results).
//
// scores = softmax(logits) or sigmoid(logits); selection ranks scores + bias; with n_group > 1
// the topk_group best groups (sum of top-2 biased scores, max without a bias) stay; weights are
// the unbiased scores of the chosen ids, renormalized (zero sum = 1), times rsf. Scores rank in
// f32::total_cmp order (NaN above everything), as on the CPU; ties go to the lower id, and no id
// is chosen twice. Ids are written in rank order. Limits (checked by the host): E <= 1024, top_k <= 32,
// n_group <= 32.
#pragma once
#include "common.cuh"

// TOPK_LEAN 0 (a timing knob): the register top-k's ids and weights by lane 0 alone (chosen
// scores through shared memory, then k serial divisions), the form before session 44.
#ifndef TOPK_LEAN
#define TOPK_LEAN 1
#endif
// TOPK_BIAS_PREFETCH 0 (a timing knob): route_topk requests the bias only after its wait.
#ifndef TOPK_BIAS_PREFETCH
#define TOPK_BIAS_PREFETCH 1
#endif

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

// Block `vblock`'s logits of `count` (route_small, routing.cu: blockIdx.x; one_token.cu loops
// over several): up to `max_groups` groups of router_slices(count) warps (as many as the block
// holds), group gi computing logit vblock · groups + gi (when below count), slice sums through
// `part` (one float per warp of shared memory), the group's first warp adding them in order.
// Every thread of the block must call it (one __syncthreads). Returns the logit to the thread
// that wrote it (lane 0 of the group's first warp), 0 to the others.
__device__ __forceinline__ float router_logits_block(const float* x, const float* w, float* logits, int count,
                                                     int experts, int hidden, float* part, int vblock,
                                                     int max_groups) {
    const int slices = router_slices(count), groups = min((int)(blockDim.x >> 5) / slices, max_groups);
    const int warp = threadIdx.x >> 5, gi = warp / slices, s = warp % slices;
    const int logit = gi < groups ? vblock * groups + gi : count;
    if (logit < count) {
        float v = router_logit_slice(x, w, logit / experts, logit % experts, hidden, s, slices);
        if ((threadIdx.x & 31) == 0) part[warp] = v;
    }
    __syncthreads();
    if (s == 0 && (threadIdx.x & 31) == 0 && logit < count) {
        float acc = 0.0f;
        for (int i = 0; i < slices; i++) acc += part[gi * slices + i];
        logits[logit] = acc;
        return acc;
    }
    return 0.0f;
}

// Rank key of an f32 in Rust's `f32::total_cmp` order (-NaN < -inf < ... < -0 < +0 < ... <
// +inf < +NaN) as an unsigned integer: the CPU ranks scores this way (routing.rs), so the ids
// agree for every input, NaN included.
__device__ __forceinline__ u32 total_key(float v) {
    const u32 b = __float_as_uint(v);
    return b ^ ((u32)((int)b >> 31) | 0x80000000u);
}

// One round of a warp's top-k over entries id = lane + 32·j (j < NPL, id < n; NPL = 0: j <
// ceil(n / 32), keys read through `key_of(j)` each round): the untaken entry with the largest
// key, ties to the lowest id, returned to every lane and marked in its lane's `taken` (bit j).
// Two warp reductions (`redux.sync`) per round where a shuffle argmax took ten shuffles.
// VAL: `val` receives the winner's val_of(j) in every lane (one shuffle
// from its owner, which tracks it beside its best key: a select per slot, where a select of
// slot id / 32 after the round became a local-memory array in the 8-slot instantiation).
// Callers ask for at most n rounds (top_k <= E, topk_group <= n_group: host checks).
template <int NPL, bool VAL = false, typename KeyOf, typename ValOf = int>
__device__ __forceinline__ int warp_top1(KeyOf key_of, int n, u32& taken, ValOf val_of = 0, float* val = nullptr) {
    const int lane = threadIdx.x & 31;
    const int slots = NPL > 0 ? NPL : (n + 31) / 32;
    u32 bk = 0;
    int bj = -1;
    float bv = 0.0f;
#pragma unroll
    for (int j = 0; j < (NPL > 0 ? NPL : 32); j++) {
        if (NPL == 0 && j >= slots) break;
        if (lane + 32 * j >= n || ((taken >> j) & 1u)) continue;
        const u32 k = key_of(j);
        if (bj < 0 || k > bk) {  // ascending j: the first of equal keys has the lowest id
            bk = k;
            bj = j;
            if constexpr (VAL) bv = val_of(j);
        }
    }
    const u32 mk = __reduce_max_sync(FULL_MASK, bk);
    // A lane without an untaken entry offers 0, the smallest key: it joins the maximum only
    // through mk == 0, and never offers an id.
    const u32 mine = bj >= 0 && bk == mk ? (u32)(lane + 32 * bj) : 0xffffffffu;
    const int id = (int)__reduce_min_sync(FULL_MASK, mine);
    if (bj >= 0 && id == lane + 32 * bj) taken |= 1u << bj;
    if constexpr (VAL) *val = __shfl_sync(FULL_MASK, bv, id & 31);
    return id;
}

// A logit for topk_token_impl: from L2 (__ldcg), or by a plain load (L2 = false).
template <bool L2>
__device__ __forceinline__ float load_logit(const float* p) {
    if constexpr (L2) return __ldcg(p);
    else return *p;
}

// Top-k of one token by one whole warp: logits l[0..E) → ids[0..k), weights[0..k).
// scoring: 0 softmax, 1 sigmoid; bias may be null. `scratch`: 2·E + 64 floats of shared memory
// owned by this warp. Logits are read with __ldcg (L2, not L1): in route_small other blocks of
// the same launch wrote them, and an L1 line of this SM could be stale. NPL > 0 (E <= 32·NPL):
// each lane keeps its experts' logits, bias and biased scores in registers, its logit and bias
// loads issued together; NPL = 0: any E <= 1024, through `scratch`. Same arithmetic in the same
// order either way, so the same bits. L2 = false: `l` may be in shared memory (plain loads;
// one_token gathers the logits there).
template <int NPL, bool L2 = true>
__device__ __forceinline__ void topk_token_impl(const float* l, const float* bias, int* ids, float* weights,
                                                float* scratch, int experts, int top_k, int scoring, int n_group,
                                                int topk_group, int renormalize, float rsf) {
    constexpr int R = NPL > 0 ? NPL : 1;  // register slots per lane (unused by the generic path)
    const int lane = threadIdx.x & 31;
    float* scores = scratch;
    float* biased = scores + experts;
    float* gsc = biased + experts;  // [32] group scores, [32] chosen scores
    float* chosen = gsc + 32;
    float bv[R];
    float s[R];  // NPL > 0: the lane's scores, slot j = expert lane + 32·j

    if (NPL > 0) {
        float x[R], b[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            const int e = lane + 32 * j;
            x[j] = e < experts ? load_logit<L2>(l + e) : 0.0f;
            b[j] = bias && e < experts ? bias[e] : 0.0f;
        }
        if (scoring == 0) {
            float m = -INFINITY;
#pragma unroll
            for (int j = 0; j < R; j++)
                if (lane + 32 * j < experts) m = fmaxf(m, x[j]);
            m = warp_max(m);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < R; j++) {
                s[j] = expf(x[j] - m);
                if (lane + 32 * j < experts) sum += s[j];
            }
            sum = warp_sum(sum);
#pragma unroll
            for (int j = 0; j < R; j++) s[j] = s[j] / sum;
        } else {
#pragma unroll
            for (int j = 0; j < R; j++) s[j] = 1.0f / (1.0f + expf(-x[j]));
        }
#pragma unroll
        for (int j = 0; j < R; j++) {
            const int e = lane + 32 * j;
            bv[j] = s[j] + (bias ? b[j] : 0.0f);
            if (e < experts) {
                scores[e] = s[j];
                if (n_group > 1) biased[e] = bv[j];
            }
        }
    } else {
        if (scoring == 0) {
            float m = -INFINITY;
            for (int e = lane; e < experts; e += 32) m = fmaxf(m, load_logit<L2>(l + e));
            m = warp_max(m);
            float sum = 0.0f;
            for (int e = lane; e < experts; e += 32) {
                float v = expf(load_logit<L2>(l + e) - m);
                scores[e] = v;
                sum += v;
            }
            sum = warp_sum(sum);
            for (int e = lane; e < experts; e += 32) scores[e] = scores[e] / sum;
        } else {
            for (int e = lane; e < experts; e += 32) scores[e] = 1.0f / (1.0f + expf(-load_logit<L2>(l + e)));
        }
        __syncwarp();
        for (int e = lane; e < experts; e += 32) biased[e] = scores[e] + (bias ? bias[e] : 0.0f);
    }
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
        const u32 gkey = lane < n_group ? total_key(gsc[lane]) : 0u;
        u32 gtaken = 0, keep = 0;
        for (int r = 0; r < topk_group; r++) keep |= 1u << warp_top1<1>([&](int) { return gkey; }, n_group, gtaken);
        if (NPL > 0) {
#pragma unroll
            for (int j = 0; j < R; j++) {
                const int e = lane + 32 * j;
                if (e < experts && !((keep >> (e / per)) & 1u)) bv[j] = -INFINITY;
            }
        } else {
            for (int e = lane; e < experts; e += 32)
                if (!((keep >> (e / per)) & 1u)) biased[e] = -INFINITY;
            __syncwarp();
        }
    }

    // Each lane's keys: in registers (NPL > 0), else read from `biased` every round.
    u32 key[R];
    if constexpr (NPL > 0) {
#pragma unroll
        for (int j = 0; j < R; j++) key[j] = total_key(bv[j]);
    }
    const auto key_of = [&](int j) {
        if constexpr (NPL > 0) return key[j];
        else return total_key(biased[lane + 32 * j]);
    };
    u32 taken = 0;
    if constexpr (NPL > 0 && TOPK_LEAN) {
        // Round r's score reaches every lane from its owner (warp_top1's `val`), every lane adds
        // the scores in rank order from 0 (lane 0's sum below, bit for bit), and lane r keeps
        // round r's id and score: the k divisions run in k lanes at once, with no shared-memory
        // round trip per round.
        float sum = 0.0f, my_score = 0.0f;
        int my_id = 0;
        for (int r = 0; r < top_k; r++) {
            float c;
            const int e = warp_top1<NPL, true>(key_of, experts, taken, [&](int j) { return s[j]; }, &c);
            sum += c;
            if (lane == r) {
                my_id = e;
                my_score = c;
            }
        }
        if (!renormalize || sum == 0.0f) sum = 1.0f;
        if (lane < top_k) {
            ids[lane] = my_id;
            weights[lane] = my_score / sum * rsf;
        }
    } else {
        for (int r = 0; r < top_k; r++) {
            const int e = warp_top1<NPL>(key_of, experts, taken);
            if (lane == 0) {
                ids[r] = e;
                chosen[r] = scores[e];
            }
        }
        if (lane == 0) {
            float sum = 0.0f;
            for (int r = 0; r < top_k; r++) sum += chosen[r];
            if (!renormalize || sum == 0.0f) sum = 1.0f;
            for (int r = 0; r < top_k; r++) weights[r] = chosen[r] / sum * rsf;
        }
    }
    __syncwarp();  // the warp may take another token into the same scratch next
}

// Register top-k up to 128 experts (Qwen3, Nemotron-3 Nano, DeepSeek-V2-Lite's 64), up to 256
// (DeepSeek-V3), else the shared-memory path.
template <bool L2 = true>
__device__ void topk_token(const float* l, const float* bias, int* ids, float* weights, float* scratch,
                           int experts, int top_k, int scoring, int n_group, int topk_group, int renormalize,
                           float rsf) {
    if (experts <= 128)
        topk_token_impl<4, L2>(l, bias, ids, weights, scratch, experts, top_k, scoring, n_group, topk_group,
                               renormalize, rsf);
    else if (experts <= 256)
        topk_token_impl<8, L2>(l, bias, ids, weights, scratch, experts, top_k, scoring, n_group, topk_group,
                               renormalize, rsf);
    else
        topk_token_impl<0, L2>(l, bias, ids, weights, scratch, experts, top_k, scoring, n_group, topk_group,
                               renormalize, rsf);
}

// Top-k of one token (n_group <= 1) by the first `nthreads` threads of the block (a multiple of
// 32, every one of them calling; named barrier `bar` among them). Warp 0 computes the scores
// into scratch[0, E) with topk_token itself, asked for no expert (the very same instructions
// as a selection's, none of its rounds); thread e adds expert e's bias (biased scores at
// scratch[E, 2E), topk_token's arithmetic); then expert e's rank in the selection order
// (biased key descending, ties to the lower id: warp_top1's order) is counted by P threads at
// once, each over every P-th key, and rank r < k writes ids[r]; each of the first k threads adds
// the chosen scores in rank order and divides its own. The same ids and weights as topk_token,
// bit for bit (same scores, same order, same sum from 0), without k rounds of two warp
// reductions and a serial renormalization by one lane. route_small runs it for a lone token
// among at most 128 experts (256 threads): Qwen3's one-token layer 1.3–1.9 µs faster than
// with warp 0's top-k (KERNEL_NOTES runs 88 and 90). one_token.cu keeps the warp version for
// now: its 64-register SASS reschedules with any change, and every variant of it measured in
// runs 87–89 was slower than main's (with this top-k 0.4 µs faster than without, on top of
// other changes). ids are complete at return; weights after the caller's next barrier.
__device__ void topk_token_group(const float* l, const float* bias, int* ids, float* weights, float* scratch,
                                 int experts, int top_k, int scoring, int renormalize, float rsf, int nthreads,
                                 int bar) {
    float* scores = scratch;
    float* biased = scores + experts;
    const int tid = threadIdx.x;
    if (tid < 32) topk_token(l, bias, nullptr, nullptr, scratch, experts, 0, scoring, 1, 1, renormalize, rsf);
    group_sync(bar, nthreads);
    for (int e = tid; e < experts; e += nthreads) biased[e] = scores[e] + (bias ? bias[e] : 0.0f);
    group_sync(bar, nthreads);
    // P (a power of two <= 32) consecutive lanes per expert, as many as the threads allow.
    int P = 1;
    while (P < 32 && experts * P * 2 <= nthreads) P *= 2;
    const int per_pass = nthreads / P;
    for (int e0 = 0; e0 < experts; e0 += per_pass) {  // the same trips for every thread (shuffles below)
        const int e = e0 + tid / P, part = tid % P;
        int rank = 0;
        if (e < experts) {
            const u32 key = total_key(biased[e]);
            for (int j = part; j < experts; j += P) {
                const u32 kj = total_key(biased[j]);
                rank += kj > key || (kj == key && j < e);
            }
        }
        for (int o = P / 2; o > 0; o >>= 1) rank += __shfl_xor_sync(FULL_MASK, rank, o);
        if (e < experts && part == 0 && rank < top_k) ids[rank] = e;
    }
    group_sync(bar, nthreads);
    if (tid < top_k) {
        float s = 0.0f;
        for (int r = 0; r < top_k; r++) s += scores[ids[r]];
        if (!renormalize || s == 0.0f) s = 1.0f;
        weights[tid] = scores[ids[tid]] / s * rsf;
    }
}
