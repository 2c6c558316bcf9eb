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
#include "common.cuh"

template <typename P, typename G>
__device__ void adamw(P* const* params, const G* const* grads, P* const* exp_avgs,
                      P* const* exp_avg_sqs, const long long* blocks, const double* scalars,
                      const float* found_inf, const double* skipped)
{
    if (found_inf && *found_inf != 0.0f)
        return;
    const double t = scalars[6] - (skipped ? *skipped : 0.0);
    const P decay = P(scalars[0]);
    const P beta1 = P(scalars[1]);
    const P one_minus_beta1 = P(scalars[2]);
    const P beta2 = P(scalars[3]);
    const P one_minus_beta2 = P(scalars[4]);
    const P step_size = P(scalars[5] / (1.0 - pow(scalars[1], t)));
    const P bias_correction2_sqrt = P(sqrt(1.0 - pow(scalars[3], t)));
    const P eps = P(scalars[7]);
    const long long* chunk = blocks + 3 * blockIdx.x;  // (tensor, start, end)
    P* p = params[chunk[0]];
    const G* g = grads[chunk[0]];
    P* m = exp_avgs[chunk[0]];
    P* v = exp_avg_sqs[chunk[0]];
    for (long long i = chunk[1] + threadIdx.x; i < chunk[2]; i += blockDim.x) {
        const P gi = widen<P>(g[i]);
        const P mi = beta1 * m[i] + one_minus_beta1 * gi;
        const P vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = decay * p[i] - step_size * mi / (sqrt(vi) / bias_correction2_sqrt + eps);
    }
}

#define ADAMW_KERNEL(P, G, SUFFIX)                                                               \
    extern "C" __global__ void adamw_##SUFFIX(                                                   \
        P* const* params, const G* const* grads, P* const* exp_avgs, P* const* exp_avg_sqs,      \
        const long long* blocks, const double* scalars, const float* found_inf,                  \
        const double* skipped)                                                                   \
    {                                                                                            \
        adamw<P, G>(params, grads, exp_avgs, exp_avg_sqs, blocks, scalars, found_inf, skipped);  \
    }

ADAMW_KERNEL(float, float, f32_f32)
ADAMW_KERNEL(float, __nv_bfloat16, f32_bf16)
ADAMW_KERNEL(float, __half, f32_f16)
ADAMW_KERNEL(double, double, f64_f64)
ADAMW_KERNEL(double, __nv_bfloat16, f64_bf16)
ADAMW_KERNEL(double, __half, f64_f16)
