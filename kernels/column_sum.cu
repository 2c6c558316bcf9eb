// Column sums of a row-major [rows, cols] array x (dtype T), optionally of its product with a
// second array y of the same shape in the compute dtype C (LayerNorm's weight gradient: g xhat):
//     out[c] = sum_r x[r, c] (* y[r, c]),  accumulated in C.
// A block is 32 columns by 8 row lanes (blockDim (32, 8)); blockIdx.y picks one of gridDim.y
// row strides. Each block writes one row of `partials` [gridDim.y, cols] (dtype O): with
// gridDim.y == 1 that row is the result itself, so the launcher runs the kernel twice, the second
// time over the partials (always in the same order: the sums are deterministic).
#include "common.cuh"

template <typename T, typename C, typename O>
__device__ void column_sum(const T* x, const C* y, O* partials, long long rows, int cols)
{
    __shared__ C lanes[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    C acc = 0;
    if (c < cols) {
        for (long long r = blockIdx.y * 8 + threadIdx.y; r < rows; r += gridDim.y * 8LL) {
            const C v = widen<C>(x[r * cols + c]);
            acc += y ? v * widen<C>(y[r * cols + c]) : v;
        }
    }
    lanes[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        C total = 0;
        for (int i = 0; i < 8; ++i)
            total += lanes[i][threadIdx.x];
        partials[(long long)blockIdx.y * cols + c] = static_cast<O>(total);
    }
}

#define COLUMN_SUM_KERNELS(T, C, SUFFIX)                                                         \
    extern "C" __global__ void column_sum_##SUFFIX(const T* x, const C* y, C* partials,          \
                                                   long long rows, int cols)                     \
    {                                                                                            \
        column_sum<T, C, C>(x, y, partials, rows, cols);                                         \
    }                                                                                            \
    extern "C" __global__ void column_sum_finish_##SUFFIX(const C* partials, const C* unused,    \
                                                          T* out, long long rows, int cols)      \
    {                                                                                            \
        column_sum<C, C, T>(partials, unused, out, rows, cols);                                  \
    }

COLUMN_SUM_KERNELS(float, float, f32)
COLUMN_SUM_KERNELS(double, double, f64)
COLUMN_SUM_KERNELS(__nv_bfloat16, float, bf16)
COLUMN_SUM_KERNELS(__half, float, f16)
