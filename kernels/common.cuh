// Shared by the kernels of this folder (included through the loader's -I).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// bf16/fp16 convert only to float, so loads widen through float unless T is double.
template <typename C, typename T>
__device__ __forceinline__ C widen(T x) { return static_cast<C>(static_cast<float>(x)); }
template <>
__device__ __forceinline__ double widen<double, double>(double x) { return x; }

// -infinity and NaN without <math.h> (NVRTC compiles without the host headers)
template <typename C>
__device__ __forceinline__ C negative_infinity();
template <>
__device__ __forceinline__ float negative_infinity<float>() { return __int_as_float(0xff800000); }
template <>
__device__ __forceinline__ double negative_infinity<double>()
{
    return __longlong_as_double(0xfff0000000000000ULL);
}
template <typename C>
__device__ __forceinline__ C quiet_nan();
template <>
__device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <>
__device__ __forceinline__ double quiet_nan<double>()
{
    return __longlong_as_double(0x7ff8000000000000ULL);
}

// 2^x by the special-function unit (ex2.approx.ftz: 2^-inf = 0, relative error ~2^-22;
// subnormal arguments and results flush to zero): the exponential of the float kernels whose
// results are sums of exponentials, with e^x = 2^(x log2 e).
__device__ __forceinline__ float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// N consecutive elements moved by one aligned vector load or store (the caller checks alignment).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack { T v[N]; };

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p)
{
    return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& x)
{
    *reinterpret_cast<Pack<T, N>*>(p) = x;
}

// The optimizers' (param, grad) dtype pairs: M(P, G, SUFFIX) for each (params and states P,
// gradients G widened on load).
#define FOR_OPTIMIZER_DTYPES(M)                                                                  \
    M(float, float, f32_f32) M(float, __nv_bfloat16, f32_bf16) M(float, __half, f32_f16)         \
    M(double, double, f64_f64) M(double, __nv_bfloat16, f64_bf16) M(double, __half, f64_f16)

// The columns of the thread's j-th vector in a row cached in registers (N vectors of V elements
// per thread, needs V, N and `cols` in scope): (j * blockDim.x + threadIdx.x) * V.
#define FOR_EACH_VECTOR(j, col)                                                                  \
    _Pragma("unroll") for (int j = 0, col = threadIdx.x * V; j < N;                              \
                           ++j, col += blockDim.x * V) if (col < cols)

// The first of the V consecutive columns that thread x of a row kernel owns.
template <int V>
__device__ __forceinline__ int vector_column()
{
    return V * (blockIdx.x * blockDim.x + threadIdx.x);
}

// The rows of a thread whose block covers blockDim.y rows at a time (from
// blockIdx.y * blockDim.y + threadIdx.y, every gridDim.y * blockDim.y), R at a time:
// load(u, at) for each of R rows, then body(u, at) for each, so that R rows' loads are in flight
// before the first is used (the row kernels are memory-bound, and one row's load-use chain per
// thread leaves most of the memory's latency exposed); the rows left over one at a time, as
// u = 0. `at` is the index of column `col` in the row. Each thread still meets its rows in
// order (sums over them do not change).
template <int R, typename Load, typename Body>
__device__ __forceinline__ void for_rows_in_flight(long long rows, int cols, int col, Load load,
                                                   Body body)
{
    const long long step = (long long)gridDim.y * blockDim.y;
    long long row = blockIdx.y * blockDim.y + threadIdx.y;
    for (; row + (R - 1) * step < rows; row += R * step) {
#pragma unroll
        for (int u = 0; u < R; ++u)
            load(u, (row + u * step) * cols + col);
#pragma unroll
        for (int u = 0; u < R; ++u)
            body(u, (row + u * step) * cols + col);
    }
    for (; row < rows; row += step) {
        load(0, row * cols + col);
        body(0, row * cols + col);
    }
}

// Rows loaded ahead by the row kernels (for_rows_in_flight's R).
#define ROWS_IN_FLIGHT 4

// for_rows_in_flight over the thread's V columns of each row: load(u, at), then body(u, at, b)
// with `b` the V values of `bias` (cols,) at its columns (zeros for a null bias). Threads past
// the last column return at once.
template <int V, typename B, typename Load, typename Body>
__device__ __forceinline__ void for_each_row_vector(const B* bias, long long rows, int cols,
                                                    Load load, Body body)
{
    const int col = vector_column<V>();
    if (col >= cols)
        return;
    const Pack<B, V> b = bias ? load_pack<V>(bias + col) : Pack<B, V>{};
    for_rows_in_flight<ROWS_IN_FLIGHT>(rows, cols, col, load,
                                       [&](int u, long long at) { body(u, at, b); });
}

// A block's column sums: adds the V sums of every thread (threadIdx.x, y) into those of thread
// (threadIdx.x, 0), in the order of y, which writes them to partials[blockIdx.y][its columns]
// (rounded to O). `scratch` (shared) holds blockDim.x * blockDim.y * V values; every thread of
// the block calls this.
template <typename C, int V, typename O>
__device__ __forceinline__ void store_column_sums(C (&sum)[V], C* scratch, O* partials, int cols)
{
    C* mine = scratch + (threadIdx.y * blockDim.x + threadIdx.x) * V;
#pragma unroll
    for (int k = 0; k < V; ++k)
        mine[k] = sum[k];
    __syncthreads();
    const int col = vector_column<V>();
    if (threadIdx.y != 0 || col >= cols)
        return;
    for (int lane = 1; lane < blockDim.y; ++lane) {
        const C* other = scratch + (lane * blockDim.x + threadIdx.x) * V;
#pragma unroll
        for (int k = 0; k < V; ++k)
            sum[k] += other[k];
    }
#pragma unroll
    for (int k = 0; k < V; ++k)
        partials[(long long)blockIdx.y * cols + col + k] = static_cast<O>(sum[k]);
}
