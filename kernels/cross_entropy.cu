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
//   forward_grad (an unsharded row, so m and s are M and S): the forward's statistics and dx for
//     the g that the last backward brought (learned[0]), from the row kept in shared memory as
//     it was read; the backward then writes only rows whose g is another.
// Storage dtype T, compute dtype C (float for fp32/bf16/fp16, double for fp64).
//
// Both directions stream the row (the forward reads it once, the backward reads it once and
// writes dx once), so they are bound by memory: each comes as *_vV, moving V = 16 bytes of T per
// load and store (the launcher picks it where cols is a multiple of V and the arrays' bases are
// aligned for it; the existing columns past the last whole vector are read one at a time), and
// as *_v1, one element at a time. A thread issues UNROLL loads before it uses them. exp is
// double's for double; for float it is 2^((x - m) log2 e) by the special-function unit
// (fast_exp2: about 1e-6 relative against exp for |x - m| up to 10, the terms that count). The
// forward's running sum is rescaled once per UNROLL vectors, to their max, never per element.
#include "common.cuh"
#include "block_reduce.cuh"

constexpr int UNROLL = 4;   // vectors a thread loads before it uses them: loads in flight

// The number of this rank's columns that exist (global index below vocab_size).
__device__ __forceinline__ int existing_columns(int cols, long long offset, long long vocab_size)
{
    const long long n = vocab_size - offset;
    return n <= 0 ? 0 : (n < cols ? (int)n : cols);
}

// exp(x - shift) in the compute dtype.
__device__ __forceinline__ double shifted_exp(double x, double shift) { return exp(x - shift); }
__device__ __forceinline__ float shifted_exp(float x, float shift)
{
    return fast_exp2((x - shift) * 1.44269504088896341f);   // log2(e)
}

// The shift of exponentials against a max m: m, or 0 where m = -inf (all values -inf, so that
// each exp(-inf - 0) is 0 where exp(-inf + inf) would be NaN).
template <typename C>
__device__ __forceinline__ C shift_of(C m) { return m == negative_infinity<C>() ? C(0) : m; }

// What a thread has seen of a row: the max m of its values and s, the sum of exp(x - m).
template <typename C>
struct RunningSum {
    C m, s;

    // Adds N values: one rescale of s to their max, then their exponentials. -inf adds nothing;
    // a NaN makes s NaN (fmax passes over it, the sum does not).
    template <int N>
    __device__ __forceinline__ void add(const C (&x)[N])
    {
        C top = x[0];
#pragma unroll
        for (int k = 1; k < N; ++k)
            top = fmax(top, x[k]);
        if (top > m) {
            s *= shifted_exp(m, top);   // 0 while m is -inf
            m = top;
        }
        const C shift = shift_of(m);
#pragma unroll
        for (int k = 0; k < N; ++k)
            s += shifted_exp(x[k], shift);
    }
};

// x = the U vectors v, v + blockDim.x, ..., v + (U - 1) blockDim.x of V elements of the row xr,
// widened; the U loads are issued before any is used. With `keep`, the vectors are also stored
// there as they were read (a copy of the row in shared memory).
template <typename C, int V, int U, typename T>
__device__ __forceinline__ void load_vectors(C (&x)[U * V], const T* __restrict__ xr, int v,
                                             T* keep = nullptr)
{
    Pack<T, V> p[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
        p[u] = load_pack<V>(xr + (v + u * (int)blockDim.x) * V);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (keep)
            store_pack(keep + (v + u * (int)blockDim.x) * V, p[u]);
#pragma unroll
        for (int k = 0; k < V; ++k)
            x[u * V + k] = widen<C>(p[u].v[k]);
    }
}

// Writes d(x, column) to the row dr at the columns of the U vectors load_vectors read into x.
template <int V, int U, typename T, typename C, typename D>
__device__ __forceinline__ void store_vectors(T* __restrict__ dr, int v, const C (&x)[U * V],
                                              D d)
{
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int col = (v + u * (int)blockDim.x) * V;
        Pack<T, V> out;
#pragma unroll
        for (int k = 0; k < V; ++k)
            out.v[k] = static_cast<T>(d(x[u * V + k], col + k));
        store_pack(dr + col, out);
    }
}

// Adds the first n values of the row xr to the thread's running sum (its vectors of V, by
// UNROLL, then the columns past the last whole vector one at a time).
template <int V, typename T, typename C>
__device__ __forceinline__ void add_row(RunningSum<C>& sum, const T* __restrict__ xr, int n,
                                        T* keep = nullptr)
{
    const int vectors = n / V, stride = blockDim.x;
    int v = threadIdx.x;
    for (; v + (UNROLL - 1) * stride < vectors; v += UNROLL * stride) {
        C x[UNROLL * V];
        load_vectors<C, V, UNROLL>(x, xr, v, keep);
        sum.add(x);
    }
    for (; v < vectors; v += stride) {
        C x[V];
        load_vectors<C, V, 1>(x, xr, v, keep);
        sum.add(x);
    }
    for (int j = vectors * V + threadIdx.x; j < n; j += stride) {
        const T value = xr[j];
        if (keep)
            keep[j] = value;
        const C x[1] = {widen<C>(value)};
        sum.add(x);
    }
}

// The row's max m and s = sum of exp(x - m) over its `existing` columns (every thread gets both),
// and thread 0's the target's logit (0 when another shard holds it, NaN when the target is
// outside [0, vocab_size) and not ignore_index).
template <int V, typename T, typename C>
__device__ __forceinline__ void row_statistics(const T* __restrict__ xr, long long target,
                                               int existing, long long offset,
                                               long long vocab_size, long long ignore_index,
                                               C& m, C& s, C& picked, T* keep = nullptr)
{
    picked = 0;     // the target's logit: loaded first, so that it arrives while the row streams
    if (threadIdx.x == 0) {
        const long long local = target - offset;
        if (target != ignore_index && (target < 0 || target >= vocab_size))
            picked = quiet_nan<C>();
        else if (target != ignore_index && local >= 0 && local < existing)
            picked = widen<C>(xr[local]);
    }
    RunningSum<C> sum{negative_infinity<C>(), C(0)};
    add_row<V>(sum, xr, existing, keep);
    m = block_reduce(sum.m, Max<C>());
    // each thread's sum against the block's max (a NaN sum stays NaN)
    s = block_reduce(sum.s * shifted_exp(sum.m, shift_of(m)), Sum<C>());
}

template <int V, typename T, typename C>
__device__ void cross_entropy_forward(const T* __restrict__ logits,
                                      const long long* __restrict__ targets,
                                      C* __restrict__ row_max, C* __restrict__ stats, int cols,
                                      long long offset, long long vocab_size,
                                      long long ignore_index)
{
    const long long row = blockIdx.x;
    C m, s, picked;
    row_statistics<V>(logits + row * cols, targets[row],
                      existing_columns(cols, offset, vocab_size), offset, vocab_size,
                      ignore_index, m, s, picked);
    if (threadIdx.x == 0) {
        row_max[row] = m;
        stats[2 * row] = s;
        stats[2 * row + 1] = picked;
    }
}

// dx of the row xr into dr (cols a multiple of V): (exp(x_j - m) g / sum - [j == target] g) in
// its existing columns, 0 in the others (all of them where the target is ignore_index).
template <int V, typename T, typename C>
__device__ __forceinline__ void row_gradient(const T* __restrict__ xr, T* __restrict__ dr,
                                             long long target, C m, C sum, C g, int cols,
                                             long long offset, long long vocab_size,
                                             long long ignore_index)
{
    const int existing = target == ignore_index ? 0 : existing_columns(cols, offset, vocab_size);
    const long long local = target - offset;
    const int hit = local >= 0 && local < existing ? (int)local : -1;   // the target's column
    const C scale = g / sum;
    const auto d = [=](C x, int col) {     // dx of column col holding x
        return shifted_exp(x, m) * scale - (col == hit ? g : C(0));
    };
    const int full = existing / V, vectors = cols / V, stride = blockDim.x;
    int v = threadIdx.x;
    for (; v + (UNROLL - 1) * stride < full; v += UNROLL * stride) {
        C x[UNROLL * V];
        load_vectors<C, V, UNROLL>(x, xr, v);
        store_vectors<V, UNROLL>(dr, v, x, d);
    }
    for (; v < vectors; v += stride) {
        C x[V];
        if (v < full) {
            load_vectors<C, V, 1>(x, xr, v);
            store_vectors<V, 1>(dr, v, x, d);
            continue;
        }
        // the vectors from the last existing columns on: padding is never read, its dx is 0
#pragma unroll
        for (int k = 0; k < V; ++k)
            x[k] = v * V + k < existing ? widen<C>(xr[v * V + k]) : C(0);
        store_vectors<V, 1>(dr, v, x, [=](C value, int col) {
            return col < existing ? d(value, col) : C(0);
        });
    }
}

// The forward's statistics and, in the same pass, dx for the per-row upstream gradient
// g = expected[0] = learned[0] (a whole, unsharded vocabulary): the row is read once, kept in
// shared memory (the launch's dynamic shared memory holds cols elements) for dx.
template <int V, typename T, typename C>
__device__ void cross_entropy_forward_grad(const T* __restrict__ logits,
                                           const long long* __restrict__ targets,
                                           const C* __restrict__ learned,
                                           C* __restrict__ expected, C* __restrict__ row_max,
                                           C* __restrict__ stats, T* __restrict__ dx, int cols,
                                           long long offset, long long vocab_size,
                                           long long ignore_index)
{
    extern __shared__ __align__(16) unsigned char cache[];
    T* kept = reinterpret_cast<T*>(cache);
    const long long row = blockIdx.x;
    const T* xr = logits + row * cols;
    const long long target = targets[row];
    const C g = learned[0];
    C m, s, picked;
    row_statistics<V>(xr, target, existing_columns(cols, offset, vocab_size), offset,
                      vocab_size, ignore_index, m, s, picked, kept);
    if (threadIdx.x == 0) {
        row_max[row] = m;
        stats[2 * row] = s;
        stats[2 * row + 1] = picked;
        if (row == 0)
            expected[0] = g;
    }
    row_gradient<V>(kept, dx + row * cols, target, m, s, g, cols, offset, vocab_size,
                    ignore_index);   // block_reduce synchronized the block: the row is kept
}

// dx with the global M and S and g = grad[row]. With `expected` (the g a forward_grad wrote dx
// for): rows whose g is that one keep dx as it is; the others are written, and learned[0]
// becomes row 0's g where it differs and is finite and not 0 (the next forward writes for it).
template <int V, typename T, typename C>
__device__ void cross_entropy_backward(const T* __restrict__ logits,
                                       const C* __restrict__ row_max,
                                       const C* __restrict__ row_sum,
                                       const long long* __restrict__ targets,
                                       const C* __restrict__ grad, const C* __restrict__ expected,
                                       C* __restrict__ learned, T* __restrict__ dx, int cols,
                                       long long offset, long long vocab_size,
                                       long long ignore_index)
{
    const long long row = blockIdx.x;
    const C g = grad[row];
    if (expected) {
        const C e = expected[0];
        if (g == e)
            return;
        if (row == 0 && threadIdx.x == 0 && isfinite(g) && g != C(0))
            learned[0] = g;
    }
    row_gradient<V>(logits + row * cols, dx + row * cols, targets[row], row_max[row],
                    row_sum[row], g, cols, offset, vocab_size, ignore_index);
}

#define CROSS_ENTROPY_KERNELS(T, C, SUFFIX, V)                                                   \
    extern "C" __global__ void cross_entropy_forward_##SUFFIX##_v##V(                            \
        const T* __restrict__ logits, const long long* __restrict__ targets,                     \
        C* __restrict__ row_max, C* __restrict__ stats, int cols, long long offset,              \
        long long vocab_size, long long ignore_index)                                            \
    {                                                                                            \
        cross_entropy_forward<V, T, C>(logits, targets, row_max, stats, cols, offset,            \
                                       vocab_size, ignore_index);                                \
    }                                                                                            \
    extern "C" __global__ void cross_entropy_forward_grad_##SUFFIX##_v##V(                       \
        const T* __restrict__ logits, const long long* __restrict__ targets,                     \
        const C* __restrict__ learned, C* __restrict__ expected, C* __restrict__ row_max,        \
        C* __restrict__ stats, T* __restrict__ dx, int cols, long long offset,                   \
        long long vocab_size, long long ignore_index)                                            \
    {                                                                                            \
        cross_entropy_forward_grad<V, T, C>(logits, targets, learned, expected, row_max, stats,  \
                                            dx, cols, offset, vocab_size, ignore_index);         \
    }                                                                                            \
    extern "C" __global__ void cross_entropy_backward_##SUFFIX##_v##V(                           \
        const T* __restrict__ logits, const C* __restrict__ row_max,                             \
        const C* __restrict__ row_sum, const long long* __restrict__ targets,                    \
        const C* __restrict__ grad, const C* __restrict__ expected, C* __restrict__ learned,     \
        T* __restrict__ dx, int cols, long long offset, long long vocab_size,                    \
        long long ignore_index)                                                                  \
    {                                                                                            \
        cross_entropy_backward<V, T, C>(logits, row_max, row_sum, targets, grad, expected,       \
                                        learned, dx, cols, offset, vocab_size, ignore_index);    \
    }

// Each dtype's two forms: one element at a time, and vectors of 16 bytes.
#define CROSS_ENTROPY_FORMS(T, C, SUFFIX, V)                                                     \
    CROSS_ENTROPY_KERNELS(T, C, SUFFIX, 1) CROSS_ENTROPY_KERNELS(T, C, SUFFIX, V)

CROSS_ENTROPY_FORMS(float, float, f32, 4)
CROSS_ENTROPY_FORMS(double, double, f64, 2)
CROSS_ENTROPY_FORMS(__nv_bfloat16, float, bf16, 8)
CROSS_ENTROPY_FORMS(__half, float, f16, 8)
