// y = x + b[column] over a row-major array x with `cols` columns (a bias along the last
// dimension), computed in the compute dtype C and rounded once to the storage dtype T; a
// grid-stride loop over the n elements.
#include "common.cuh"

template <typename T, typename C>
__device__ void bias_add(const T* x, const T* b, T* y, long long n, int cols)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = static_cast<T>(widen<C>(x[i]) + widen<C>(b[i % cols]));
}

#define BIAS_ADD_KERNEL(T, C, SUFFIX)                                                            \
    extern "C" __global__ void bias_add_##SUFFIX(const T* x, const T* b, T* y, long long n,     \
                                                 int cols)                                       \
    {                                                                                            \
        bias_add<T, C>(x, b, y, n, cols);                                                        \
    }

BIAS_ADD_KERNEL(float, float, f32)
BIAS_ADD_KERNEL(double, double, f64)
BIAS_ADD_KERNEL(__nv_bfloat16, float, bf16)
BIAS_ADD_KERNEL(__half, float, f16)
