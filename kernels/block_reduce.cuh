// Block-wide reductions through CUB's BlockReduce (CuPy's bundled CCCL headers; the loader puts
// them on the include path). CUB needs the block size at compile time: the loader defines
// CUPYTP_BLOCK_THREADS from `cupytp.launchers.BLOCK_THREADS`, and every kernel that calls
// block_reduce is launched with exactly that many threads per block.
#pragma once
#include <cub/block/block_reduce.cuh>

#ifndef CUPYTP_BLOCK_THREADS
#error "CUPYTP_BLOCK_THREADS is undefined: compile through cupytp.launchers.get_kernel"
#endif

template <typename C>
struct Max {
    __device__ C operator()(C a, C b) const { return a > b ? a : b; }
};

template <typename C>
struct Sum {
    __device__ C operator()(C a, C b) const { return a + b; }
};

// The reduction of v over the block, returned to every thread. All threads must call it.
template <typename C, typename Op>
__device__ C block_reduce(C v, Op op)
{
    using Reduce = cub::BlockReduce<C, CUPYTP_BLOCK_THREADS>;
    __shared__ typename Reduce::TempStorage storage;
    __shared__ C result;
    const C total = Reduce(storage).Reduce(v, op);  // valid in thread 0
    if (threadIdx.x == 0)
        result = total;
    __syncthreads();
    v = result;
    __syncthreads();  // the next reduction may reuse `storage` and `result`
    return v;
}

// The reduction of v over the threads of one threadIdx.y (a block of blockDim.y rows of
// blockDim.x lanes, a multiple of 32: a row's warps are consecutive), returned to each of them:
// the warps' sums by shuffles, then the row's warps in order (deterministic). All threads of the
// block must call it.
template <typename C, typename Op>
__device__ C row_reduce(C v, Op op)
{
    __shared__ C warps[CUPYTP_BLOCK_THREADS / 32];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    const int per_row = blockDim.x / 32, first = threadIdx.y * per_row;
    if (threadIdx.x % 32 == 0)
        warps[first + threadIdx.x / 32] = v;
    __syncthreads();
    v = warps[first];
    for (int w = 1; w < per_row; ++w)
        v = op(v, warps[first + w]);
    __syncthreads();  // the next reduction may reuse `warps`
    return v;
}

// Blocks per multiprocessor the norms' row-cached backward kernels keep registers for: the
// one-vector-per-thread kernels (N = 1) run as PARAM_GRAD_BLOCKS_PER_SM (cupytp.launchers.
// layernorm) blocks of partial sums per multiprocessor, all resident at once.
#define NORM_BACKWARD_BLOCKS(N) ((N) == 1 ? 4 : 1)
