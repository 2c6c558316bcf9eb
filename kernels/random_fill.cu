// Random fills of a rank's block of a global tensor (philox.cuh's counters), one element per
// thread, written in the output's dtype T:
//     random_uniform: out = T(u),          u the float64 uniform of words (0, 1)
//     random_normal:  out = T(std z),      z = sqrt(-2 log1p(-u1)) cos(2 pi u2) (Box-Muller, in
//                                          float64) of the uniforms of words (0, 1) and (2, 3)
// Rounded to T as NumPy's astype rounds a float64: to nearest, bf16 through float32 (as
// ml_dtypes converts).
#include "common.cuh"
#include "philox.cuh"

template <typename T>
__device__ __forceinline__ T from_double(double v);
template <>
__device__ __forceinline__ double from_double<double>(double v) { return v; }
template <>
__device__ __forceinline__ float from_double<float>(double v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_double<__nv_bfloat16>(double v)
{
    return __float2bfloat16_rn(static_cast<float>(v));
}
template <>
__device__ __forceinline__ __half from_double<__half>(double v) { return __double2half(v); }

template <typename T, bool NORMAL>
__device__ void random_fill(T* out, long long count, double std, unsigned long long counter0,
                            unsigned long long seed, const PhiloxBlock& block)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        const PhiloxWords w = philox4x32_10(counter0 + block.global(i), seed);
        double v = philox_uniform(w.w0, w.w1);
        if (NORMAL)
            v = sqrt(-2.0 * log1p(-v)) * cos(6.283185307179586 * philox_uniform(w.w2, w.w3)) * std;
        out[i] = from_double<T>(v);
    }
}

#define RANDOM_FILL_KERNELS(T, SUFFIX)                                                           \
    extern "C" __global__ void random_uniform_##SUFFIX(T* out, long long count, double std,     \
                                                        PHILOX_BLOCK_PARAMS)                     \
    {                                                                                            \
        random_fill<T, false>(out, count, std, *base + add, seed, PHILOX_BLOCK);                 \
    }                                                                                            \
    extern "C" __global__ void random_normal_##SUFFIX(T* out, long long count, double std,      \
                                                       PHILOX_BLOCK_PARAMS)                      \
    {                                                                                            \
        random_fill<T, true>(out, count, std, *base + add, seed, PHILOX_BLOCK);                  \
    }

RANDOM_FILL_KERNELS(float, f32)
RANDOM_FILL_KERNELS(double, f64)
RANDOM_FILL_KERNELS(__nv_bfloat16, bf16)
RANDOM_FILL_KERNELS(__half, f16)
