// An embedding lookup and its gradient over this rank's rows [offset, offset + rows) of the table
// (all of it, or its part of a vocab-parallel table): row id - offset; ids outside those rows
// give zeros forward and add nothing backward. One block per looked-up row k, its threads over the
// `cols` columns.
// Forward: out[k] = weight[ids[k] - offset].
// Backward: grad[ids[k] - offset] += g[k]. grad (rows, cols) is in the compute dtype C (float for
// fp32/bf16/fp16, double for fp64), zeroed by the caller; repeated ids meet in atomicAdd, so the
// order of their additions (and so the last bits of a float sum) may vary from run to run.
#include "common.cuh"

template <typename T>
__device__ void embedding_forward(const long long* ids, const T* weight, T* out, int cols,
                                  long long offset, long long rows)
{
    const long long k = blockIdx.x;
    const long long id = ids[k] - offset;
    T* row = out + k * cols;
    if (id < 0 || id >= rows) {
        for (int j = threadIdx.x; j < cols; j += blockDim.x)
            row[j] = static_cast<T>(0.0f);
        return;
    }
    const T* source = weight + id * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x)
        row[j] = source[j];
}

template <typename T, typename C>
__device__ void embedding_backward(const long long* ids, const T* g, C* grad, int cols,
                                   long long offset, long long rows)
{
    const long long k = blockIdx.x;
    const long long id = ids[k] - offset;
    if (id < 0 || id >= rows)
        return;
    const T* gk = g + k * cols;
    C* row = grad + id * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x)
        atomicAdd(row + j, widen<C>(gk[j]));
}

#define EMBEDDING_KERNELS(T, C, SUFFIX)                                                          \
    extern "C" __global__ void embedding_forward_##SUFFIX(const long long* ids, const T* weight, \
                                                          T* out, int cols, long long offset,    \
                                                          long long rows)                        \
    {                                                                                            \
        embedding_forward<T>(ids, weight, out, cols, offset, rows);                              \
    }                                                                                            \
    extern "C" __global__ void embedding_backward_##SUFFIX(const long long* ids, const T* g,    \
                                                           C* grad, int cols, long long offset,  \
                                                           long long rows)                       \
    {                                                                                            \
        embedding_backward<T, C>(ids, g, grad, cols, offset, rows);                              \
    }

EMBEDDING_KERNELS(float, float, f32)
EMBEDDING_KERNELS(double, double, f64)
EMBEDDING_KERNELS(__nv_bfloat16, float, bf16)
EMBEDDING_KERNELS(__half, float, f16)
