// Causal softmax of attention scores and its gradient, one block per row of the last dimension.
// Scores are (..., T, S): row t (query t of T) sees keys s <= t + S - T; the rest are masked.
//     y[s] = exp(scale x[s] - m) / sum_{visible} exp(scale x - m),  m = max_{visible} scale x
//     (a row with no visible key is all zeros)
//     dx[s] = scale y[s] (g[s] - sum_s g[s] y[s])
// One read and one write per element instead of a scale, mask, max, subtract, exp, sum and
// divide pass each. Storage dtype T, compute dtype C (float for fp32/bf16/fp16, double for fp64).
#include "common.cuh"

// -infinity without <math.h> (NVRTC compiles without the host headers)
template <typename C>
__device__ __forceinline__ C negative_infinity();
template <>
__device__ __forceinline__ float negative_infinity<float>() { return __int_as_float(0xff800000); }
template <>
__device__ __forceinline__ double negative_infinity<double>()
{
    return __longlong_as_double(0xfff0000000000000ULL);
}

template <typename C>
struct Max {
    __device__ C operator()(C a, C b) const { return a > b ? a : b; }
};

template <typename C>
struct Sum {
    __device__ C operator()(C a, C b) const { return a + b; }
};

// The reduction of v over the block, returned to every thread. All threads must call it.
template <typename C, typename Op>
__device__ C block_reduce(C v, Op op, C identity)
{
    __shared__ C partial[32];
    for (int offset = 16; offset > 0; offset >>= 1)
        v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0)
        partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (blockDim.x + 31) / 32 ? partial[lane] : identity;
        for (int offset = 16; offset > 0; offset >>= 1)
            v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
        if (lane == 0)
            partial[0] = v;
    }
    __syncthreads();
    v = partial[0];
    __syncthreads();  // the next reduction may reuse `partial`
    return v;
}

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
    m = block_reduce(m, Max<C>(), negative_infinity<C>());
    C total = 0;
    for (int s = threadIdx.x; s < visible; s += blockDim.x)
        total += exp(scale * widen<C>(xr[s]) - m);
    total = block_reduce(total, Sum<C>(), C(0));
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
    dot = block_reduce(dot, Sum<C>(), C(0));
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
