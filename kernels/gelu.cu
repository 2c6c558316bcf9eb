// Tanh-form GeLU (GPT-2's) and its gradient, elementwise:
//     y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//     dy/dx = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// gelu_*_v<V>: over n contiguous elements, grid-stride loops (any grid covers any n) over vectors
// of V (the launcher picks V > 1 only when every array starts aligned for them), then the tail.
// bias_gelu_*: y = gelu(x + bias) over (rows, cols), bias (cols,) in the compute dtype. Thread
// (threadIdx.x, threadIdx.y) of block (blockIdx.x, blockIdx.y) owns the V columns from
// V * (blockIdx.x * blockDim.x + threadIdx.x), moved as vectors (the launcher picks V > 1 only
// when every row start is aligned for them), and the rows blockIdx.y * blockDim.y + threadIdx.y,
// then every gridDim.y * blockDim.y. The backward also writes the bias gradient's partial column
// sums of each block: partials[blockIdx.y][col] (summed by the caller); with a null bias it is
// the plain GeLU's gradient with the column sums of dx (a bias added before, in a product's
// epilogue).
// One kernel set per storage dtype T, computing in C: float for fp32/bf16/fp16, double for fp64.
#include "common.cuh"

template <typename C>
__device__ __forceinline__ C tanh_arg(C x)
{
    return C(0.7978845608028654) * (x + C(0.044715) * x * x * x);
}

template <typename C>
__device__ __forceinline__ C gelu_value(C x)
{
    return C(0.5) * x * (C(1) + tanh(tanh_arg(x)));
}

template <typename C>
__device__ __forceinline__ C gelu_slope(C x)
{
    const C t = tanh(tanh_arg(x));
    const C du_dx = C(0.7978845608028654) * (C(1) + C(3 * 0.044715) * x * x);
    return C(0.5) * (C(1) + t) + C(0.5) * x * (C(1) - t * t) * du_dx;
}

// The grid strides over vectors of V elements (the first n / V * V), then over the tail one
// element a thread: calls f(i, vector) for each.
template <int V, typename F>
__device__ __forceinline__ void for_each_vector(long long n, F f)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long vectors = n / V;
    for (long long i = first; i < vectors; i += stride)
        f(i * V, true);
    for (long long i = vectors * V + first; i < n; i += stride)
        f(i, false);
}

template <typename T, typename C, int V>
__device__ void gelu_forward(const T* x, T* y, long long n)
{
    for_each_vector<V>(n, [&](long long at, bool vector) {
        if (!vector) {
            y[at] = static_cast<T>(gelu_value(widen<C>(x[at])));
            return;
        }
        const Pack<T, V> xv = load_pack<V>(x + at);
        Pack<T, V> out;
#pragma unroll
        for (int k = 0; k < V; ++k)
            out.v[k] = static_cast<T>(gelu_value(widen<C>(xv.v[k])));
        store_pack(y + at, out);
    });
}

template <typename T, typename C, int V>
__device__ void gelu_backward(const T* x, const T* dy, T* dx, long long n)
{
    for_each_vector<V>(n, [&](long long at, bool vector) {
        if (!vector) {
            dx[at] = static_cast<T>(widen<C>(dy[at]) * gelu_slope(widen<C>(x[at])));
            return;
        }
        const Pack<T, V> xv = load_pack<V>(x + at), dyv = load_pack<V>(dy + at);
        Pack<T, V> out;
#pragma unroll
        for (int k = 0; k < V; ++k)
            out.v[k] = static_cast<T>(widen<C>(dyv.v[k]) * gelu_slope(widen<C>(xv.v[k])));
        store_pack(dx + at, out);
    });
}

template <typename T, typename C, int V>
__device__ void bias_gelu_forward(const T* x, const C* bias, T* y, long long rows, int cols)
{
    Pack<T, V> xv[ROWS_IN_FLIGHT];
    for_each_row_vector<V>(
        bias, rows, cols, [&](int u, long long at) { xv[u] = load_pack<V>(x + at); },
        [&](int u, long long at, const Pack<C, V>& b) {
            Pack<T, V> out;
#pragma unroll
            for (int k = 0; k < V; ++k)
                out.v[k] = static_cast<T>(gelu_value(widen<C>(xv[u].v[k]) + b.v[k]));
            store_pack(y + at, out);
        });
}

template <typename T, typename C, int V>
__device__ void bias_gelu_backward(const T* x, const C* bias, const T* dy, T* dx, C* partials,
                                   long long rows, int cols)
{
    __shared__ C lanes[CUPYTP_BLOCK_THREADS * V];  // the threads' sums, reduced over threadIdx.y
    C sum[V] = {};
    Pack<T, V> xv[ROWS_IN_FLIGHT], dyv[ROWS_IN_FLIGHT];
    for_each_row_vector<V>(
        bias, rows, cols,
        [&](int u, long long at) {
            xv[u] = load_pack<V>(x + at);
            dyv[u] = load_pack<V>(dy + at);
        },
        [&](int u, long long at, const Pack<C, V>& b) {
            Pack<T, V> out;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const C d = widen<C>(dyv[u].v[k]) * gelu_slope(widen<C>(xv[u].v[k]) + b.v[k]);
                out.v[k] = static_cast<T>(d);
                sum[k] += d;
            }
            store_pack(dx + at, out);
        });
    store_column_sums<C, V>(sum, lanes, partials, cols);
}

#define GELU_KERNELS(T, C, SUFFIX, V)                                                            \
    extern "C" __global__ void gelu_forward_##SUFFIX##_v##V(const T* x, T* y, long long n)       \
    {                                                                                            \
        gelu_forward<T, C, V>(x, y, n);                                                          \
    }                                                                                            \
    extern "C" __global__ void gelu_backward_##SUFFIX##_v##V(const T* x, const T* dy, T* dx,     \
                                                             long long n)                        \
    {                                                                                            \
        gelu_backward<T, C, V>(x, dy, dx, n);                                                    \
    }
#define BIAS_GELU_KERNELS(T, C, SUFFIX, V)                                                      \
    extern "C" __global__ void bias_gelu_forward_##SUFFIX##_v##V(                               \
        const T* x, const C* bias, T* y, long long rows, int cols)                               \
    {                                                                                            \
        bias_gelu_forward<T, C, V>(x, bias, y, rows, cols);                                      \
    }                                                                                            \
    extern "C" __global__ void bias_gelu_backward_##SUFFIX##_v##V(                              \
        const T* x, const C* bias, const T* dy, T* dx, C* partials, long long rows, int cols)    \
    {                                                                                            \
        bias_gelu_backward<T, C, V>(x, bias, dy, dx, partials, rows, cols);                      \
    }
#define ALL_GELU_KERNELS(T, C, SUFFIX, V)                                                        \
    GELU_KERNELS(T, C, SUFFIX, 1) GELU_KERNELS(T, C, SUFFIX, V)                                  \
    BIAS_GELU_KERNELS(T, C, SUFFIX, 1) BIAS_GELU_KERNELS(T, C, SUFFIX, V)

ALL_GELU_KERNELS(float, float, f32, 4)
ALL_GELU_KERNELS(double, double, f64, 2)
ALL_GELU_KERNELS(__nv_bfloat16, float, bf16, 8)
ALL_GELU_KERNELS(__half, float, f16, 8)
