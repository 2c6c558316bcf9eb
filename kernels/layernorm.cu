// LayerNorm over the last dimension (length `cols`), one block per row (the cached forward: a
// row per blockDim.x lanes, blockDim.y rows a block):
//     xhat = (x - mean) rstd,  rstd = 1 / sqrt(var + eps)  (two passes: mean, then variance)
//     y = xhat w + b                                       (w, b optional)
//     dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)) [+ add],  dxhat = g w
// The forward also writes mean and rstd (compute dtype C, one per row) for the backward, unless
// they are null (a forward no backward follows); the backward reads x again and recomputes xhat
// from them (the same operations as the forward's, so the same values), so nothing of the row's
// size is kept between the two but x itself. x, w, b and dx have the
// storage dtype T (so has `add`, an optional gradient summed into dx: the residual stream's);
// y and g have O, which is T or (under autocast) a 16-bit dtype for an fp32 x.
// Two forms of each: *_cached_vV_nN for rows that fit the block's registers (each thread holds
// N vectors of V elements, read from memory once, moved as vectors: the launcher picks it when
// cols is a multiple of V, at most BLOCK_THREADS V N, and every array is aligned for vectors),
// and a streaming form for any row, one element at a time.
// The kernels are norm.cuh's templates with CENTERED.
#include "norm.cuh"

#define LAYER_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, N)                                         \
    extern "C" __global__ void layer_norm_forward_cached_##SUFFIX##_v##V##_n##N(                \
        const T* x, const T* w, const T* b, O* y, C* mean, C* rstd, long long rows, int cols,    \
        C eps)                                                                                   \
    {                                                                                            \
        norm_forward_cached<true, T, O, C, V, N>(x, w, b, y, mean, rstd, rows, cols, eps);        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(CUPYTP_BLOCK_THREADS, NORM_BACKWARD_BLOCKS(N))          \
        layer_norm_backward_cached_##SUFFIX##_v##V##_n##N(               \
        const O* g, const T* x, const C* mean, const C* rstd, const T* w, const T* add, T* dx,   \
        C* partials, O* dx_cast, int dx_sum, long long rows, int cols)                           \
    {                                                                                            \
        norm_backward_cached<true, T, O, C, V, N>(g, x, mean, rstd, w, add, dx, partials,        \
                                                  dx_cast, dx_sum, rows, cols);                  \
    }
// V: 16 bytes of the narrower of x and y per vector
#define LAYER_NORM_ALL_KERNELS(T, O, C, SUFFIX, V)                                               \
    LAYER_NORM_KERNELS(T, O, C, SUFFIX) LAYER_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 1)         \
    LAYER_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 2)                                             \
    LAYER_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 4)

#define LAYER_NORM_KERNELS(T, O, C, SUFFIX)                                                      \
    extern "C" __global__ void layer_norm_forward_##SUFFIX(const T* x, const T* w, const T* b,  \
                                                           O* y, C* mean, C* rstd, int cols,     \
                                                           C eps)                                \
    {                                                                                            \
        norm_forward<true, T, O, C>(x, w, b, y, mean, rstd, cols, eps);                          \
    }                                                                                            \
    extern "C" __global__ void layer_norm_backward_##SUFFIX(const O* g, const T* x,             \
                                                            const C* mean, const C* rstd,        \
                                                            const T* w, const T* add, T* dx,     \
                                                            int cols)                            \
    {                                                                                            \
        norm_backward<true, T, O, C>(g, x, mean, rstd, w, add, dx, cols);                        \
    }

LAYER_NORM_ALL_KERNELS(float, float, float, f32, 4)
LAYER_NORM_ALL_KERNELS(double, double, double, f64, 2)
LAYER_NORM_ALL_KERNELS(__nv_bfloat16, __nv_bfloat16, float, bf16, 8)
LAYER_NORM_ALL_KERNELS(__half, __half, float, f16, 8)
LAYER_NORM_ALL_KERNELS(float, __nv_bfloat16, float, f32_bf16, 8)
LAYER_NORM_ALL_KERNELS(float, __half, float, f32_f16, 8)
