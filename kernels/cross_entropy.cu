// Cross-entropy of rows of logits against integer targets, one block per row. The vocabulary
// (the last dimension) may be sharded: this rank holds the `cols` global columns
// [offset, offset + cols), of which only those below `vocab_size` exist; the others (padding)
// are never read.
//   forward, one pass over the row (online softmax):
//     row_max[row] = m = max_j x_j,  stats[row] = (sum_j exp(x_j - m), x[target - offset])
//     over the existing columns; the target's logit is 0 when another rank holds it, NaN when
//     the target is outside [0, vocab_size) and not ignore_index. The caller combines shards:
//     M = max of the m, S = sum of s exp(m - M), loss = log S + M - target logit.
//   backward, with M, S and g = dL/dloss per row:
//     dx_j = (exp(x_j - M) g / S - [offset + j == target] g),
//     zero in the padding columns and in rows whose target is ignore_index.
// Storage dtype T, compute dtype C (float for fp32/bf16/fp16, double for fp64).
#include "common.cuh"
#include "block_reduce.cuh"

// The number of this rank's columns that exist (global index below vocab_size).
__device__ __forceinline__ int existing_columns(int cols, long long offset, long long vocab_size)
{
    const long long n = vocab_size - offset;
    return n <= 0 ? 0 : (n < cols ? (int)n : cols);
}

template <typename T, typename C>
__device__ void cross_entropy_forward(const T* logits, const long long* targets, C* row_max,
                                      C* stats, int cols, long long offset, long long vocab_size,
                                      long long ignore_index)
{
    const long long row = blockIdx.x;
    const T* xr = logits + row * cols;
    const int existing = existing_columns(cols, offset, vocab_size);
    // Each thread: the max m of its columns and the sum of exp(x - m), rescaled as m grows.
    C m = negative_infinity<C>(), s = 0;
    for (int j = threadIdx.x; j < existing; j += blockDim.x) {
        const C x = widen<C>(xr[j]);
        if (x > m) {
            s = s * exp(m - x) + C(1);  // exp(-inf) = 0 for the first column
            m = x;
        } else if (x != negative_infinity<C>()) {  // -inf adds nothing; NaN propagates
            s += exp(x - m);
        }
    }
    const C block_max = block_reduce(m, Max<C>());
    s = m == negative_infinity<C>() ? C(0) : s * exp(m - block_max);
    s = block_reduce(s, Sum<C>());
    if (threadIdx.x == 0) {
        const long long target = targets[row];
        const long long local = target - offset;
        C picked = 0;
        if (target != ignore_index && (target < 0 || target >= vocab_size))
            picked = quiet_nan<C>();
        else if (target != ignore_index && local >= 0 && local < existing)
            picked = widen<C>(xr[local]);
        row_max[row] = block_max;
        stats[2 * row] = s;
        stats[2 * row + 1] = picked;
    }
}

template <typename T, typename C>
__device__ void cross_entropy_backward(const T* logits, const C* row_max, const C* row_sum,
                                       const long long* targets, const C* grad, T* dx, int cols,
                                       long long offset, long long vocab_size,
                                       long long ignore_index)
{
    const long long row = blockIdx.x;
    const T* xr = logits + row * cols;
    T* dr = dx + row * cols;
    const long long target = targets[row];
    const int existing = target == ignore_index ? 0 : existing_columns(cols, offset, vocab_size);
    const C m = row_max[row], g = grad[row];
    const C scale = g / row_sum[row];
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        C d = 0;
        if (j < existing)
            d = exp(widen<C>(xr[j]) - m) * scale - (offset + j == target ? g : C(0));
        dr[j] = static_cast<T>(d);
    }
}

#define CROSS_ENTROPY_KERNELS(T, C, SUFFIX)                                                      \
    extern "C" __global__ void cross_entropy_forward_##SUFFIX(                                   \
        const T* logits, const long long* targets, C* row_max, C* stats, int cols,               \
        long long offset, long long vocab_size, long long ignore_index)                          \
    {                                                                                            \
        cross_entropy_forward<T, C>(logits, targets, row_max, stats, cols, offset, vocab_size,   \
                                    ignore_index);                                               \
    }                                                                                            \
    extern "C" __global__ void cross_entropy_backward_##SUFFIX(                                  \
        const T* logits, const C* row_max, const C* row_sum, const long long* targets,           \
        const C* grad, T* dx, int cols, long long offset, long long vocab_size,                  \
        long long ignore_index)                                                                  \
    {                                                                                            \
        cross_entropy_backward<T, C>(logits, row_max, row_sum, targets, grad, dx, cols, offset,  \
                                     vocab_size, ignore_index);                                  \
    }

CROSS_ENTROPY_KERNELS(float, float, f32)
CROSS_ENTROPY_KERNELS(double, double, f64)
CROSS_ENTROPY_KERNELS(__nv_bfloat16, float, bf16)
CROSS_ENTROPY_KERNELS(__half, float, f16)
