// Tanh-form GeLU (GPT-2's) and its gradient, elementwise:
//     y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//     dy/dx = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// gelu_*: over n contiguous elements, grid-stride loops (any grid covers any n).
// bias_gelu_*: y = gelu(x + bias) over (rows, cols), bias (cols,) in the compute dtype. Thread
// (blockIdx.x, threadIdx.x) owns one column; block row blockIdx.y takes the row chunks
// blockIdx.y, blockIdx.y + gridDim.y, ... of `chunk` rows each. The backward also writes the
// bias gradient's partial column sums: partials[blockIdx.y][col] (summed by the caller).
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

template <typename T, typename C>
__device__ void gelu_forward(const T* x, T* y, long long n)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = static_cast<T>(gelu_value(widen<C>(x[i])));
}

template <typename T, typename C>
__device__ void gelu_backward(const T* x, const T* dy, T* dx, long long n)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dx[i] = static_cast<T>(widen<C>(dy[i]) * gelu_slope(widen<C>(x[i])));
}

template <typename T, typename C>
__device__ void bias_gelu_forward(const T* x, const C* bias, T* y, long long rows, int cols,
                                  int chunk)
{
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols)
        return;
    const C b = bias[col];
    for (long long start = (long long)blockIdx.y * chunk; start < rows;
         start += (long long)gridDim.y * chunk) {
        const long long stop = start + chunk < rows ? start + chunk : rows;
        for (long long i = start * cols + col; i < stop * cols; i += cols)
            y[i] = static_cast<T>(gelu_value(widen<C>(x[i]) + b));
    }
}

template <typename T, typename C>
__device__ void bias_gelu_backward(const T* x, const C* bias, const T* dy, T* dx, C* partials,
                                   long long rows, int cols, int chunk)
{
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols)
        return;
    const C b = bias[col];
    C sum = 0;
    for (long long start = (long long)blockIdx.y * chunk; start < rows;
         start += (long long)gridDim.y * chunk) {
        const long long stop = start + chunk < rows ? start + chunk : rows;
        for (long long i = start * cols + col; i < stop * cols; i += cols) {
            const C d = widen<C>(dy[i]) * gelu_slope(widen<C>(x[i]) + b);
            dx[i] = static_cast<T>(d);
            sum += d;
        }
    }
    partials[(long long)blockIdx.y * cols + col] = sum;
}

#define GELU_KERNELS(T, C, SUFFIX)                                                               \
    extern "C" __global__ void gelu_forward_##SUFFIX(const T* x, T* y, long long n)              \
    {                                                                                            \
        gelu_forward<T, C>(x, y, n);                                                             \
    }                                                                                            \
    extern "C" __global__ void gelu_backward_##SUFFIX(const T* x, const T* dy, T* dx, long long n) \
    {                                                                                            \
        gelu_backward<T, C>(x, dy, dx, n);                                                       \
    }                                                                                            \
    extern "C" __global__ void bias_gelu_forward_##SUFFIX(const T* x, const C* bias, T* y,      \
                                                          long long rows, int cols, int chunk)   \
    {                                                                                            \
        bias_gelu_forward<T, C>(x, bias, y, rows, cols, chunk);                                  \
    }                                                                                            \
    extern "C" __global__ void bias_gelu_backward_##SUFFIX(const T* x, const C* bias,           \
                                                           const T* dy, T* dx, C* partials,      \
                                                           long long rows, int cols, int chunk)  \
    {                                                                                            \
        bias_gelu_backward<T, C>(x, bias, dy, dx, partials, rows, cols, chunk);                  \
    }

GELU_KERNELS(float, float, f32)
GELU_KERNELS(double, double, f64)
GELU_KERNELS(__nv_bfloat16, float, bf16)
GELU_KERNELS(__half, float, f16)
