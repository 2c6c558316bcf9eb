// Tanh-form GeLU (GPT-2's) and its gradient, elementwise over n contiguous elements:
//     y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//     dy/dx = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// One kernel pair per storage dtype T, computing in C: float for fp32/bf16/fp16, double for fp64.
// Grid-stride loops, so any grid covers any n.
#include "common.cuh"

template <typename C>
__device__ __forceinline__ C tanh_arg(C x)
{
    return C(0.7978845608028654) * (x + C(0.044715) * x * x * x);
}

template <typename T, typename C>
__device__ void gelu_forward(const T* x, T* y, long long n)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const C xi = widen<C>(x[i]);
        y[i] = static_cast<T>(C(0.5) * xi * (C(1) + tanh(tanh_arg(xi))));
    }
}

template <typename T, typename C>
__device__ void gelu_backward(const T* x, const T* dy, T* dx, long long n)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const C xi = widen<C>(x[i]);
        const C t = tanh(tanh_arg(xi));
        const C du_dx = C(0.7978845608028654) * (C(1) + C(3 * 0.044715) * xi * xi);
        const C grad = C(0.5) * (C(1) + t) + C(0.5) * xi * (C(1) - t * t) * du_dx;
        dx[i] = static_cast<T>(widen<C>(dy[i]) * grad);
    }
}

#define GELU_KERNELS(T, C, SUFFIX)                                                               \
    extern "C" __global__ void gelu_forward_##SUFFIX(const T* x, T* y, long long n)              \
    {                                                                                            \
        gelu_forward<T, C>(x, y, n);                                                             \
    }                                                                                            \
    extern "C" __global__ void gelu_backward_##SUFFIX(const T* x, const T* dy, T* dx, long long n) \
    {                                                                                            \
        gelu_backward<T, C>(x, dy, dx, n);                                                       \
    }

GELU_KERNELS(float, float, f32)
GELU_KERNELS(double, double, f64)
GELU_KERNELS(__nv_bfloat16, float, bf16)
GELU_KERNELS(__half, float, f16)
