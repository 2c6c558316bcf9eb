// LayerNorm over the last dimension (length `cols`), one block per row:
//     xhat = (x - mean) rstd,  rstd = 1 / sqrt(var + eps)  (two passes: mean, then variance)
//     y = xhat w + b                                       (w, b optional)
//     dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)) [+ add],  dxhat = g w
// The forward also writes xhat and rstd in the compute dtype C for the backward (and for the
// weight and bias gradients, which are column sums the caller takes). x, w, b and dx have the
// storage dtype T (so has `add`, an optional gradient summed into dx: the residual stream's);
// y and g have O, which is T or (under autocast) a 16-bit dtype for an fp32 x.
#include "common.cuh"
#include "block_reduce.cuh"

template <typename T, typename O, typename C>
__device__ void layer_norm_forward(const T* x, const T* w, const T* b, O* y, C* xhat, C* rstd,
                                   int cols, C eps)
{
    const long long row = blockIdx.x;
    const T* xr = x + row * cols;
    C sum = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        sum += widen<C>(xr[i]);
    const C mean = block_reduce(sum, Sum<C>()) / C(cols);
    C squares = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = widen<C>(xr[i]) - mean;
        squares += d * d;
    }
    const C r = C(1) / sqrt(block_reduce(squares, Sum<C>()) / C(cols) + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C h = (widen<C>(xr[i]) - mean) * r;
        xhat[row * cols + i] = h;
        C out = w ? h * widen<C>(w[i]) : h;
        y[row * cols + i] = static_cast<O>(b ? out + widen<C>(b[i]) : out);
    }
    if (threadIdx.x == 0)
        rstd[row] = r;
}

template <typename T, typename O, typename C>
__device__ void layer_norm_backward(const O* g, const C* xhat, const C* rstd, const T* w,
                                    const T* add, T* dx, int cols)
{
    const long long row = blockIdx.x;
    const O* gr = g + row * cols;
    const C* hr = xhat + row * cols;
    C sum = 0, dot = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = w ? widen<C>(gr[i]) * widen<C>(w[i]) : widen<C>(gr[i]);
        sum += d;
        dot += d * hr[i];
    }
    const C mean_d = block_reduce(sum, Sum<C>()) / C(cols);
    const C mean_dh = block_reduce(dot, Sum<C>()) / C(cols);
    const C r = rstd[row];
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = w ? widen<C>(gr[i]) * widen<C>(w[i]) : widen<C>(gr[i]);
        const C v = r * (d - mean_d - hr[i] * mean_dh);
        dx[row * cols + i] = static_cast<T>(add ? v + widen<C>(add[row * cols + i]) : v);
    }
}

#define LAYER_NORM_KERNELS(T, O, C, SUFFIX)                                                      \
    extern "C" __global__ void layer_norm_forward_##SUFFIX(const T* x, const T* w, const T* b,  \
                                                           O* y, C* xhat, C* rstd, int cols,     \
                                                           C eps)                                \
    {                                                                                            \
        layer_norm_forward<T, O, C>(x, w, b, y, xhat, rstd, cols, eps);                          \
    }                                                                                            \
    extern "C" __global__ void layer_norm_backward_##SUFFIX(const O* g, const C* xhat,          \
                                                            const C* rstd, const T* w,           \
                                                            const T* add, T* dx, int cols)       \
    {                                                                                            \
        layer_norm_backward<T, O, C>(g, xhat, rstd, w, add, dx, cols);                           \
    }

LAYER_NORM_KERNELS(float, float, float, f32)
LAYER_NORM_KERNELS(double, double, double, f64)
LAYER_NORM_KERNELS(__nv_bfloat16, __nv_bfloat16, float, bf16)
LAYER_NORM_KERNELS(__half, __half, float, f16)
LAYER_NORM_KERNELS(float, __nv_bfloat16, float, f32_bf16)
LAYER_NORM_KERNELS(float, __half, float, f32_f16)
