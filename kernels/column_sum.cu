// Column sums of a row-major [rows, cols] array x (dtype T), optionally of its product with a
// second array y of the same shape in the compute dtype C (LayerNorm's weight gradient: g xhat):
//     out[c] = sum_r x[r, c] (* y[r, c]),  accumulated in C.
// Thread (threadIdx.x, threadIdx.y) of block (blockIdx.x, blockIdx.y) owns the V columns from
// V * (blockIdx.x * blockDim.x + threadIdx.x), loaded as vectors (the launcher picks V > 1 only
// when every row start is aligned for them), and the rows blockIdx.y * blockDim.y + threadIdx.y,
// then every gridDim.y * blockDim.y. Each block writes the sums of its rows to one row of
// `partials` [gridDim.y, cols] (dtype O): with gridDim.y == 1 that row is the result itself (the
// `direct` kernels write it rounded to T), else the launcher runs the kernel twice, the second
// time over the partials (always in the same order: the sums are deterministic).
// The `column_sum_cast` kernels also write x converted to U (bf16 or fp16 of a float32 x, rounded
// as `cast_rows` rounds) into `cast`: a gradient cast for the products, its column sums the
// bias's gradient, in one read of x. With a dropout `mask` (dropout.cu's: bit i % 8 of byte i / 8
// for element i), x is first multiplied by (bit ? scale : 0) in C, as dropout_backward does: the
// gradient of a dropped-out product, its cast and its bias's gradient in one pass.
#include "common.cuh"

template <typename T, typename C, typename O, int V, typename U = T>
__device__ void column_sum(const T* x, const C* y, O* partials, long long rows, int cols,
                           U* cast = nullptr, const unsigned char* mask = nullptr, C scale = 1)
{
    __shared__ C lanes[CUPYTP_BLOCK_THREADS * V];
    const int col = vector_column<V>();
    C sum[V] = {};
    Pack<T, V> xv[ROWS_IN_FLIGHT];
    Pack<C, V> yv[ROWS_IN_FLIGHT];
    if (col < cols) {
        for_rows_in_flight<ROWS_IN_FLIGHT>(
            rows, cols, col,
            [&](int u, long long at) {
                xv[u] = load_pack<V>(x + at);
                if (y)
                    yv[u] = load_pack<V>(y + at);
            },
            [&](int u, long long at) {
                C v[V];
#pragma unroll
                for (int k = 0; k < V; ++k)
                    v[k] = widen<C>(xv[u].v[k]);
                if (mask) {     // V divides 8 and `at`: the vector's bits lie in one byte
                    const unsigned bits = mask[at / 8] >> (at % 8);
#pragma unroll
                    for (int k = 0; k < V; ++k)
                        v[k] *= (bits >> k) & 1u ? scale : C(0);
                }
                if (cast) {
                    Pack<U, V> cv;
#pragma unroll
                    for (int k = 0; k < V; ++k)
                        cv.v[k] = static_cast<U>(v[k]);
                    store_pack(cast + at, cv);
                }
                if (y) {
#pragma unroll
                    for (int k = 0; k < V; ++k)
                        sum[k] += v[k] * yv[u].v[k];
                } else {
#pragma unroll
                    for (int k = 0; k < V; ++k)
                        sum[k] += v[k];
                }
            });
    }
    store_column_sums<C, V>(sum, lanes, partials, cols);
}

#define COLUMN_SUM_KERNEL(T, C, SUFFIX, V)                                                       \
    extern "C" __global__ void column_sum_##SUFFIX##_v##V(const T* x, const C* y, C* partials,   \
                                                          long long rows, int cols)              \
    {                                                                                            \
        column_sum<T, C, C, V>(x, y, partials, rows, cols);                                      \
    }
#define COLUMN_SUM_FINISH_KERNEL(T, C, SUFFIX, V)                                                \
    extern "C" __global__ void column_sum_finish_##SUFFIX##_v##V(                               \
        const C* partials, const C* unused, T* out, long long rows, int cols)                    \
    {                                                                                            \
        column_sum<C, C, T, V>(partials, unused, out, rows, cols);                               \
    }
#define COLUMN_SUM_DIRECT_KERNEL(T, C, SUFFIX, V)                                                \
    extern "C" __global__ void column_sum_direct_##SUFFIX##_v##V(const T* x, const C* y, T* out, \
                                                                 long long rows, int cols)       \
    {                                                                                            \
        column_sum<T, C, T, V>(x, y, out, rows, cols);                                           \
    }
#define COLUMN_SUM_CAST_KERNEL(T, U, SUFFIX, V)                                                   \
    extern "C" __global__ void column_sum_cast_##SUFFIX##_v##V(                                 \
        const T* x, const float* unused, float* partials, long long rows, int cols, U* cast,     \
        const unsigned char* mask, float scale)                                                  \
    {                                                                                            \
        column_sum<T, float, float, V, U>(x, nullptr, partials, rows, cols, cast, mask, scale);  \
    }
// V: 16 bytes of T per load; the finish reads the partials (C), 16 bytes of those.
#define COLUMN_SUM_KERNELS(T, C, SUFFIX, V, FINISH_V)                                            \
    COLUMN_SUM_KERNEL(T, C, SUFFIX, 1) COLUMN_SUM_KERNEL(T, C, SUFFIX, V)                        \
    COLUMN_SUM_DIRECT_KERNEL(T, C, SUFFIX, 1) COLUMN_SUM_DIRECT_KERNEL(T, C, SUFFIX, V)          \
    COLUMN_SUM_FINISH_KERNEL(T, C, SUFFIX, 1) COLUMN_SUM_FINISH_KERNEL(T, C, SUFFIX, FINISH_V)

COLUMN_SUM_KERNELS(float, float, f32, 4, 4)
COLUMN_SUM_KERNELS(double, double, f64, 2, 2)
COLUMN_SUM_KERNELS(__nv_bfloat16, float, bf16, 8, 4)
COLUMN_SUM_KERNELS(__half, float, f16, 8, 4)
COLUMN_SUM_CAST_KERNEL(float, __nv_bfloat16, f32_bf16, 1)
COLUMN_SUM_CAST_KERNEL(float, __nv_bfloat16, f32_bf16, 4)
COLUMN_SUM_CAST_KERNEL(float, __half, f32_f16, 1)
COLUMN_SUM_CAST_KERNEL(float, __half, f32_f16, 4)
