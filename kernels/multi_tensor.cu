// Multi-tensor reductions and scaling: one launch covers a whole list of tensors.
// The table holds one data pointer per tensor; block b works on the chunk
// blocks[3b : 3b + 3] = (tensor, start, end) of its tensor. Storage dtype T, compute dtype C
// (float for fp32/bf16/fp16, double for fp64).
//   sum_of_squares_partials: partials[b] = sum of x^2 over block b's chunk;
//   sum_partials:            *out = sum of partials[0:n], one block (fixed order: deterministic);
//   scale:                   x *= *factor, the factor read from device memory (no host sync);
//   unscale_check:           x *= *inv_scale, and *found_inf = 1 where a result is not finite
//                            (dynamic loss scaling; found_inf is only ever set, never cleared);
//   cast:                    dst = src converted to dst's dtype (through float), a second table
//                            row of pointers (autocast's casts of a model's parameters).
// The two reductions run with BLOCK_THREADS threads per block (block_reduce.cuh).
#include "common.cuh"
#include "block_reduce.cuh"

template <typename T, typename C>
__device__ void sum_of_squares_partials(const T* const* arrays, const long long* blocks,
                                        C* partials)
{
    const long long* chunk = blocks + 3 * blockIdx.x;  // (tensor, start, end)
    const T* x = arrays[chunk[0]];
    C sum = C(0);
    for (long long i = chunk[1] + threadIdx.x; i < chunk[2]; i += blockDim.x) {
        const C xi = widen<C>(x[i]);
        sum += xi * xi;
    }
    sum = block_reduce(sum, Sum<C>());
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = sum;
    }
}

template <typename C>
__device__ void sum_partials(const C* partials, long long n, C* out)
{
    C sum = C(0);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        sum += partials[i];
    }
    sum = block_reduce(sum, Sum<C>());
    if (threadIdx.x == 0) {
        *out = sum;
    }
}

template <typename T, typename C>
__device__ void scale(T* const* arrays, const long long* blocks, const C* factor)
{
    const long long* chunk = blocks + 3 * blockIdx.x;  // (tensor, start, end)
    T* x = arrays[chunk[0]];
    const C f = *factor;
    for (long long i = chunk[1] + threadIdx.x; i < chunk[2]; i += blockDim.x) {
        x[i] = static_cast<T>(widen<C>(x[i]) * f);
    }
}

template <typename T, typename C>
__device__ void unscale_check(T* const* arrays, const long long* blocks, const float* inv_scale,
                              float* found_inf)
{
    const long long* chunk = blocks + 3 * blockIdx.x;  // (tensor, start, end)
    T* x = arrays[chunk[0]];
    const C f = C(*inv_scale);
    bool bad = false;
    for (long long i = chunk[1] + threadIdx.x; i < chunk[2]; i += blockDim.x) {
        const C v = widen<C>(x[i]) * f;
        bad |= !isfinite(v);
        x[i] = static_cast<T>(v);
    }
    if (bad)
        *found_inf = 1.0f;
}

template <typename S, typename D>
__device__ void cast(const S* const* sources, D* const* targets, const long long* blocks)
{
    const long long* chunk = blocks + 3 * blockIdx.x;  // (tensor, start, end)
    const S* src = sources[chunk[0]];
    D* dst = targets[chunk[0]];
    for (long long i = chunk[1] + threadIdx.x; i < chunk[2]; i += blockDim.x) {
        dst[i] = static_cast<D>(widen<float>(src[i]));
    }
}

#define MULTI_TENSOR_KERNELS(T, C, SUFFIX)                                                       \
    extern "C" __global__ void sum_of_squares_partials_##SUFFIX(                                 \
        const T* const* arrays, const long long* blocks, C* partials)                            \
    {                                                                                            \
        sum_of_squares_partials<T, C>(arrays, blocks, partials);                                 \
    }                                                                                            \
    extern "C" __global__ void scale_##SUFFIX(T* const* arrays, const long long* blocks,         \
                                              const C* factor)                                   \
    {                                                                                            \
        scale<T, C>(arrays, blocks, factor);                                                     \
    }                                                                                            \
    extern "C" __global__ void unscale_check_##SUFFIX(T* const* arrays, const long long* blocks, \
                                                      const float* inv_scale, float* found_inf)  \
    {                                                                                            \
        unscale_check<T, C>(arrays, blocks, inv_scale, found_inf);                               \
    }

#define SUM_PARTIALS_KERNEL(C, SUFFIX)                                                           \
    extern "C" __global__ void sum_partials_##SUFFIX(const C* partials, long long n, C* out)     \
    {                                                                                            \
        sum_partials<C>(partials, n, out);                                                       \
    }

MULTI_TENSOR_KERNELS(float, float, f32)
MULTI_TENSOR_KERNELS(double, double, f64)
MULTI_TENSOR_KERNELS(__nv_bfloat16, float, bf16)
MULTI_TENSOR_KERNELS(__half, float, f16)
#define CAST_KERNEL(S, D, NAME)                                                                  \
    extern "C" __global__ void cast_##NAME(const S* const* sources, D* const* targets,           \
                                           const long long* blocks)                              \
    {                                                                                            \
        cast<S, D>(sources, targets, blocks);                                                    \
    }

SUM_PARTIALS_KERNEL(float, f32)
SUM_PARTIALS_KERNEL(double, f64)
CAST_KERNEL(float, __nv_bfloat16, f32_bf16)
CAST_KERNEL(float, __half, f32_f16)
