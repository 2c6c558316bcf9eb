// Gradient of an embedding lookup: grad[ids[k]] += g[k] for each of the n looked-up rows k, one
// block per k, its threads over the `cols` columns. Ids outside [0, rows) (another rank's part of
// a vocab-parallel table) add nothing. grad (rows, cols) is in the compute dtype C (float for
// fp32/bf16/fp16, double for fp64), zeroed by the caller; repeated ids meet in atomicAdd, so the
// order of their additions (and so the last bits of a float sum) may vary from run to run.
#include "common.cuh"

template <typename T, typename C>
__device__ void embedding_backward(const long long* ids, const T* g, C* grad, int cols,
                                   long long rows)
{
    const long long k = blockIdx.x;
    const long long id = ids[k];
    if (id < 0 || id >= rows)
        return;
    const T* gk = g + k * cols;
    C* row = grad + id * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x)
        atomicAdd(row + j, widen<C>(gk[j]));
}

#define EMBEDDING_KERNELS(T, C, SUFFIX)                                                          \
    extern "C" __global__ void embedding_backward_##SUFFIX(const long long* ids, const T* g,    \
                                                           C* grad, int cols, long long rows)    \
    {                                                                                            \
        embedding_backward<T, C>(ids, g, grad, cols, rows);                                      \
    }

EMBEDDING_KERNELS(float, float, f32)
EMBEDDING_KERNELS(double, double, f64)
EMBEDDING_KERNELS(__nv_bfloat16, float, bf16)
EMBEDDING_KERNELS(__half, float, f16)
