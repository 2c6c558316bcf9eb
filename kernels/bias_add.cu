// A bias along the last dimension of a row-major [rows, cols] array, in one pass:
//     bias_add:          y = x + b[col]                (x, b, y of one dtype T)
//     bias_residual_add: out = r + (x + b[col])        (x of dtype T; b, r and out of R)
// computed in the compute dtype C and rounded once to the output's dtype.
// Thread (threadIdx.x, threadIdx.y) of block (blockIdx.x, blockIdx.y) owns the V columns from
// V * (blockIdx.x * blockDim.x + threadIdx.x) (its bias values are loaded once) and the rows
// blockIdx.y * blockDim.y + threadIdx.y, then every gridDim.y * blockDim.y rows. With V > 1
// every row start is aligned for vectors of V elements of each array (the launcher checks), so
// each row's V elements move in one vector load or store per array.
#include "common.cuh"

template <typename T, typename C, typename B, typename R, int V>
__device__ __forceinline__ void bias_rows(const T* x, const B* b, const R* r, R* out,
                                          long long rows, int cols)
{
    Pack<T, V> xv[ROWS_IN_FLIGHT];
    Pack<R, V> rv[ROWS_IN_FLIGHT];
    for_each_row_vector<V>(
        b, rows, cols,
        [&](int u, long long at) {
            xv[u] = load_pack<V>(x + at);
            if (r)
                rv[u] = load_pack<V>(r + at);
        },
        [&](int u, long long at, const Pack<B, V>& bias) {
            Pack<R, V> sum;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const C biased = widen<C>(xv[u].v[k]) + widen<C>(bias.v[k]);
                sum.v[k] = static_cast<R>(r ? widen<C>(rv[u].v[k]) + biased : biased);
            }
            store_pack(out + at, sum);
        });
}

#define BIAS_ADD_KERNEL(T, C, SUFFIX, V)                                                         \
    extern "C" __global__ void bias_add_##SUFFIX##_v##V(const T* x, const T* b, T* y,           \
                                                         long long rows, int cols)               \
    {                                                                                            \
        bias_rows<T, C, T, T, V>(x, b, nullptr, y, rows, cols);                                  \
    }
#define BIAS_RESIDUAL_ADD_KERNEL(T, C, SUFFIX, V)                                                \
    extern "C" __global__ void bias_residual_add_##SUFFIX##_v##V(                               \
        const T* x, const C* b, const C* r, C* out, long long rows, int cols)                    \
    {                                                                                            \
        bias_rows<T, C, C, C, V>(x, b, r, out, rows, cols);                                      \
    }
#define BIAS_KERNELS(T, C, SUFFIX, V)                                                            \
    BIAS_ADD_KERNEL(T, C, SUFFIX, 1) BIAS_ADD_KERNEL(T, C, SUFFIX, V)                            \
    BIAS_RESIDUAL_ADD_KERNEL(T, C, SUFFIX, 1) BIAS_RESIDUAL_ADD_KERNEL(T, C, SUFFIX, V)

BIAS_KERNELS(float, float, f32, 4)
BIAS_KERNELS(double, double, f64, 2)
BIAS_KERNELS(__nv_bfloat16, float, bf16, 8)
BIAS_KERNELS(__half, float, f16, 8)
