// Causal softmax of attention scores and its gradient, one block per row of the last dimension.
// Scores are (..., T, S): row t (query t of T) sees keys s <= t + S - T; the rest are masked.
//     y[s] = exp(scale x[s] - m) / sum_{visible} exp(scale x - m),  m = max_{visible} scale x
//     (a row with no visible key is all zeros)
//     dx[s] = scale y[s] (g[s] - sum_s g[s] y[s])
// One read and one write per element instead of a scale, mask, max, subtract, exp, sum and
// divide pass each. Storage dtype T, compute dtype C (float for fp32/bf16/fp16, double for fp64).
#include "common.cuh"
#include "block_reduce.cuh"

template <typename T, typename C>
__device__ void causal_softmax_forward(const T* x, T* y, int t_len, int s_len, C scale)
{
    const long long row = blockIdx.x;
    const int visible = (int)(row % t_len) + s_len - t_len + 1;  // keys 0 .. visible-1
    const T* xr = x + row * s_len;
    T* yr = y + row * s_len;
    C m = negative_infinity<C>();
    for (int s = threadIdx.x; s < visible; s += blockDim.x)
        m = Max<C>()(m, scale * widen<C>(xr[s]));
    m = block_reduce(m, Max<C>());
    C total = 0;
    for (int s = threadIdx.x; s < visible; s += blockDim.x)
        total += exp(scale * widen<C>(xr[s]) - m);
    total = block_reduce(total, Sum<C>());
    for (int s = threadIdx.x; s < s_len; s += blockDim.x)
        yr[s] = static_cast<T>(s < visible ? exp(scale * widen<C>(xr[s]) - m) / total : C(0));
}

template <typename T, typename C>
__device__ void causal_softmax_backward(const T* y, const T* g, T* dx, int s_len, C scale)
{
    const long long row = blockIdx.x;
    const T* yr = y + row * s_len;
    const T* gr = g + row * s_len;
    T* dr = dx + row * s_len;
    C dot = 0;
    for (int s = threadIdx.x; s < s_len; s += blockDim.x)
        dot += widen<C>(gr[s]) * widen<C>(yr[s]);
    dot = block_reduce(dot, Sum<C>());
    for (int s = threadIdx.x; s < s_len; s += blockDim.x)
        dr[s] = static_cast<T>(scale * widen<C>(yr[s]) * (widen<C>(gr[s]) - dot));
}

#define CAUSAL_SOFTMAX_KERNELS(T, C, SUFFIX)                                                     \
    extern "C" __global__ void causal_softmax_forward_##SUFFIX(const T* x, T* y, int t_len,     \
                                                               int s_len, C scale)               \
    {                                                                                            \
        causal_softmax_forward<T, C>(x, y, t_len, s_len, scale);                                 \
    }                                                                                            \
    extern "C" __global__ void causal_softmax_backward_##SUFFIX(const T* y, const T* g, T* dx,  \
                                                                int s_len, C scale)              \
    {                                                                                            \
        causal_softmax_backward<T, C>(y, g, dx, s_len, scale);                                   \
    }

CAUSAL_SOFTMAX_KERNELS(float, float, f32)
CAUSAL_SOFTMAX_KERNELS(double, double, f64)
CAUSAL_SOFTMAX_KERNELS(__nv_bfloat16, float, bf16)
CAUSAL_SOFTMAX_KERNELS(__half, float, f16)
