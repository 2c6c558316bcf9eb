// Fused multi-tensor SGD (torch.optim.SGD semantics): one launch updates a whole list of tensors.
// The tables hold one data pointer per tensor; block b updates the chunk
// blocks[3b : 3b + 3] = (tensor, start, end) of its tensor. Params and momentum buffers are P (fp32
// or fp64, also the compute type); grads are G (P, bf16 or fp16), widened on load. The scalars
// (lr, momentum, 1 - dampening, weight_decay) are read from device memory as float64 and rounded
// to P, so a captured CUDA graph sees each step's values.
//     g += weight_decay p                              (if weight_decay != 0)
//     buf = first_step ? g : momentum buf + (1 - dampening) g   (if momentum != 0)
//     g = nesterov ? g + momentum buf : buf            (if momentum != 0)
//     p -= lr g
// momentum_bufs is never read when momentum == 0. When found_inf (may be null) points to a
// non-zero value (dynamic loss scaling found a non-finite gradient), nothing changes.
#include "common.cuh"

template <typename P, typename G>
__device__ void sgd(P* const* params, const G* const* grads, P* const* momentum_bufs,
                    const long long* blocks, const double* scalars, int nesterov, int first_step,
                    const float* found_inf)
{
    if (found_inf && *found_inf != 0.0f)
        return;
    const P lr = P(scalars[0]);
    const P momentum = P(scalars[1]);
    const P one_minus_dampening = P(scalars[2]);
    const P weight_decay = P(scalars[3]);
    const long long* chunk = blocks + 3 * blockIdx.x;  // (tensor, start, end)
    P* p = params[chunk[0]];
    const G* g = grads[chunk[0]];
    P* buf = momentum_bufs[chunk[0]];
    for (long long i = chunk[1] + threadIdx.x; i < chunk[2]; i += blockDim.x) {
        const P pi = p[i];
        P gi = widen<P>(g[i]);
        if (weight_decay != P(0)) {
            gi += weight_decay * pi;
        }
        if (momentum != P(0)) {
            const P bi = first_step ? gi : momentum * buf[i] + one_minus_dampening * gi;
            buf[i] = bi;
            gi = nesterov ? gi + momentum * bi : bi;
        }
        p[i] = pi - lr * gi;
    }
}

#define SGD_KERNEL(P, G, SUFFIX)                                                                 \
    extern "C" __global__ void sgd_##SUFFIX(                                                     \
        P* const* params, const G* const* grads, P* const* momentum_bufs,                        \
        const long long* blocks, const double* scalars, int nesterov, int first_step,            \
        const float* found_inf)                                                                  \
    {                                                                                            \
        sgd<P, G>(params, grads, momentum_bufs, blocks, scalars, nesterov, first_step,           \
                  found_inf);                                                                    \
    }

FOR_OPTIMIZER_DTYPES(SGD_KERNEL)
