// RMSNorm over the last dimension (length `cols`), one block per row (the cached forward: a row
// per blockDim.x lanes, blockDim.y rows a block; Llama's norm):
//     rstd = 1 / sqrt(mean(x^2) + eps),  y = x rstd w                  (w optional)
//     dx = rstd (d - xhat mean(d xhat)) [+ add],  xhat = x rstd,  d = g w
// The forward writes y and rstd (compute dtype C, one per row); the backward reads x again and
// recomputes xhat from it, so nothing of the row's size is kept between the two but x itself
// (the residual stream, which the caller holds anyway). x, w and dx have the storage dtype T (so
// has `add`, an optional gradient summed into dx: the residual stream's); y and g have O, which
// is T or (under autocast) a 16-bit dtype for an fp32 x.
// Two forms of each, as in layernorm.cu: *_cached_vV_nN for rows that fit the block's registers
// (N vectors of V elements per thread, read once; the launcher picks it when cols is a multiple
// of V, at most BLOCK_THREADS V N, and every array is aligned for vectors), whose backward also
// sums the weight gradient g xhat of its rows per column into partials[blockIdx.x] ([gridDim.x,
// cols], summed over blocks by the caller); and a streaming form for any row, one element at a
// time (the caller takes the weight gradient's column sums).
// The kernels are norm.cuh's templates without CENTERED (no mean, no bias: null pointers).
#include "norm.cuh"

#define RMS_NORM_KERNELS(T, O, C, SUFFIX)                                                        \
    extern "C" __global__ void rms_norm_forward_##SUFFIX(const T* x, const T* w, O* y, C* rstd,  \
                                                         int cols, C eps)                        \
    {                                                                                            \
        norm_forward<false, T, O, C>(x, w, nullptr, y, nullptr, rstd, cols, eps);                \
    }                                                                                            \
    extern "C" __global__ void rms_norm_backward_##SUFFIX(const O* g, const T* x, const C* rstd, \
                                                          const T* w, const T* add, T* dx,       \
                                                          int cols)                              \
    {                                                                                            \
        norm_backward<false, T, O, C>(g, x, nullptr, rstd, w, add, dx, cols);                    \
    }

#define RMS_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, N)                                           \
    extern "C" __global__ void rms_norm_forward_cached_##SUFFIX##_v##V##_n##N(                  \
        const T* x, const T* w, O* y, C* rstd, long long rows, int cols, C eps)                  \
    {                                                                                            \
        norm_forward_cached<false, T, O, C, V, N>(x, w, nullptr, y, nullptr, rstd, rows, cols,   \
                                                  eps);                                          \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(CUPYTP_BLOCK_THREADS, NORM_BACKWARD_BLOCKS(N))          \
        rms_norm_backward_cached_##SUFFIX##_v##V##_n##N(                 \
        const O* g, const T* x, const C* rstd, const T* w, const T* add, T* dx, C* partials,     \
        O* dx_cast, int dx_sum, long long rows, int cols)                                        \
    {                                                                                            \
        norm_backward_cached<false, T, O, C, V, N>(g, x, nullptr, rstd, w, add, dx, partials,    \
                                                   dx_cast, dx_sum, rows, cols);                 \
    }

// V: as layernorm.cu's (16 bytes of the narrower of x and y per vector)
#define RMS_NORM_ALL_KERNELS(T, O, C, SUFFIX, V)                                                 \
    RMS_NORM_KERNELS(T, O, C, SUFFIX) RMS_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 1)             \
    RMS_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 2)                                               \
    RMS_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 4)

RMS_NORM_ALL_KERNELS(float, float, float, f32, 4)
RMS_NORM_ALL_KERNELS(double, double, double, f64, 2)
RMS_NORM_ALL_KERNELS(__nv_bfloat16, __nv_bfloat16, float, bf16, 8)
RMS_NORM_ALL_KERNELS(__half, __half, float, f16, 8)
RMS_NORM_ALL_KERNELS(float, __nv_bfloat16, float, f32_bf16, 8)
RMS_NORM_ALL_KERNELS(float, __half, float, f32_f16, 8)
