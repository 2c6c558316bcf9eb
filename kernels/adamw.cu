// Fused multi-tensor AdamW (torch.optim.AdamW semantics): one launch updates a whole list of
// tensors.
// The tables hold one data pointer per tensor; block b updates the chunk
// blocks[3b : 3b + 3] = (tensor, start, end) of its tensor. Params and both moments are P (fp32 or
// fp64, also the compute type); grads are G (P, bf16 or fp16), widened on load. The scalars are
// read from device memory (float64, written by the host), so a captured CUDA graph sees each
// step's values: scalars = (decay, beta1, 1 - beta1, beta2, 1 - beta2, lr, step, eps), with
// decay = 1 - lr wd and
//     t = step - *skipped,  step_size = lr / (1 - beta1^t),  bc2_sqrt = sqrt(1 - beta2^t)
//     p = decay p - step_size m / (sqrt(v) / bc2_sqrt + eps)
// Dynamic loss scaling: when *found_inf != 0 (a non-finite gradient this step) nothing changes,
// and `skipped` counts the steps so skipped (the host's step count includes them); both pointers
// may be null (no loss scaling).
// Casts: with a `casts` row (D, a 16-bit dtype: autocast's kept copies of the parameters), the
// tensors whose pointer there is not null also get the new p rounded to D, in the same pass (the
// next forward reads them; no separate cast pass over the parameters). `casts` may be null.
#include "common.cuh"

template <typename P>
struct AdamWScalars {
    P decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps;

    __device__ __forceinline__ void update(P& p, P& m, P& v, const P g) const
    {
        m = beta1 * m + one_minus_beta1 * g;
        v = beta2 * v + one_minus_beta2 * g * g;
        p = decay * p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps);
    }
};

// A block's chunk [start, end) of one tensor: 16-byte vectors of params and moments (with the
// matching gradient vector) where the chunk's start is aligned for them, one element per thread
// for the rest.
template <typename P, typename G, typename D>
__device__ void adamw(P* const* params, const G* const* grads, P* const* exp_avgs,
                      P* const* exp_avg_sqs, D* const* casts, const long long* blocks,
                      const double* scalars, const float* found_inf, const double* skipped)
{
    if (found_inf && *found_inf != 0.0f)
        return;
    const double t = scalars[6] - (skipped ? *skipped : 0.0);
    const AdamWScalars<P> op{P(scalars[0]), P(scalars[1]), P(scalars[2]), P(scalars[3]),
                             P(scalars[4]), P(scalars[5] / (1.0 - pow(scalars[1], t))),
                             P(sqrt(1.0 - pow(scalars[3], t))), P(scalars[7])};
    const long long* chunk = blocks + 3 * blockIdx.x;  // (tensor, start, end)
    const long long start = chunk[1], end = chunk[2];
    P* __restrict__ p = params[chunk[0]];
    const G* __restrict__ g = grads[chunk[0]];
    P* __restrict__ m = exp_avgs[chunk[0]];
    P* __restrict__ v = exp_avg_sqs[chunk[0]];
    D* __restrict__ c = casts ? casts[chunk[0]] : nullptr;
    constexpr int V = 16 / sizeof(P);
    long long tail = start;
    if ((reinterpret_cast<size_t>(p + start) | reinterpret_cast<size_t>(m + start) |
         reinterpret_cast<size_t>(v + start)) % 16 == 0 &&
        reinterpret_cast<size_t>(g + start) % (sizeof(G) * V) == 0 &&
        (!c || reinterpret_cast<size_t>(c + start) % (sizeof(D) * V) == 0)) {
        tail = start + (end - start) / V * V;
        for (long long i = start + threadIdx.x * V; i < tail; i += blockDim.x * V) {
            Pack<P, V> pv = load_pack<V>(p + i), mv = load_pack<V>(m + i), vv = load_pack<V>(v + i);
            const Pack<G, V> gv = load_pack<V>(g + i);
#pragma unroll
            for (int k = 0; k < V; ++k)
                op.update(pv.v[k], mv.v[k], vv.v[k], widen<P>(gv.v[k]));
            store_pack(p + i, pv);
            store_pack(m + i, mv);
            store_pack(v + i, vv);
            if (c) {
                Pack<D, V> cv;
#pragma unroll
                for (int k = 0; k < V; ++k)
                    cv.v[k] = static_cast<D>(pv.v[k]);
                store_pack(c + i, cv);
            }
        }
    }
    for (long long i = tail + threadIdx.x; i < end; i += blockDim.x) {
        op.update(p[i], m[i], v[i], widen<P>(g[i]));
        if (c)
            c[i] = static_cast<D>(p[i]);
    }
}

// adamw_<P>_<G>_<D>: D, the casts' dtype, is bf16 or f16 (either serves a null `casts`)
#define ADAMW_KERNEL(P, G, D, SUFFIX)                                                            \
    extern "C" __global__ void adamw_##SUFFIX(                                                   \
        P* const* params, const G* const* grads, P* const* exp_avgs, P* const* exp_avg_sqs,      \
        D* const* casts, const long long* blocks, const double* scalars, const float* found_inf, \
        const double* skipped)                                                                   \
    {                                                                                            \
        adamw<P, G, D>(params, grads, exp_avgs, exp_avg_sqs, casts, blocks, scalars, found_inf,  \
                       skipped);                                                                 \
    }
#define ADAMW_KERNELS(P, G, SUFFIX)                                                              \
    ADAMW_KERNEL(P, G, __nv_bfloat16, SUFFIX##_bf16) ADAMW_KERNEL(P, G, __half, SUFFIX##_f16)

FOR_OPTIMIZER_DTYPES(ADAMW_KERNELS)
