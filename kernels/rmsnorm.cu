// RMSNorm over the last dimension (length `cols`), one block per row (the cached forward: a row
// per blockDim.x lanes, blockDim.y rows a block; Llama's norm):
//     rstd = 1 / sqrt(mean(x^2) + eps),  y = x rstd w                  (w optional)
//     dx = rstd (d - xhat mean(d xhat)) [+ add],  xhat = x rstd,  d = g w
// The forward writes y and rstd (compute dtype C, one per row); the backward reads x again and
// recomputes xhat from it, so nothing of the row's size is kept between the two but x itself
// (the residual stream, which the caller holds anyway). x, w and dx have the storage dtype T (so
// has `add`, an optional gradient summed into dx: the residual stream's); y and g have O, which
// is T or (under autocast) a 16-bit dtype for an fp32 x.
// Two forms of each, as in layernorm.cu: *_cached_vV_nN for rows that fit the block's registers
// (N vectors of V elements per thread, read once; the launcher picks it when cols is a multiple
// of V, at most BLOCK_THREADS V N, and every array is aligned for vectors), whose backward also
// sums the weight gradient g xhat of its rows per column into partials[blockIdx.x] ([gridDim.x,
// cols], summed over blocks by the caller); and a streaming form for any row, one element at a
// time (the caller takes the weight gradient's column sums).
#include "common.cuh"
#include "block_reduce.cuh"

template <typename T, typename O, typename C>
__device__ void rms_norm_forward(const T* x, const T* w, O* y, C* rstd, int cols, C eps)
{
    const long long row = blockIdx.x;
    const T* xr = x + row * cols;
    C squares = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C v = widen<C>(xr[i]);
        squares += v * v;
    }
    const C r = C(1) / sqrt(block_reduce(squares, Sum<C>()) / C(cols) + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C h = widen<C>(xr[i]) * r;
        y[row * cols + i] = static_cast<O>(w ? h * widen<C>(w[i]) : h);
    }
    if (threadIdx.x == 0)
        rstd[row] = r;
}

template <typename T, typename O, typename C>
__device__ void rms_norm_backward(const O* g, const T* x, const C* rstd, const T* w, const T* add,
                                  T* dx, int cols)
{
    const long long row = blockIdx.x;
    const O* gr = g + row * cols;
    const T* xr = x + row * cols;
    const C r = rstd[row];
    C dot = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = w ? widen<C>(gr[i]) * widen<C>(w[i]) : widen<C>(gr[i]);
        dot += d * widen<C>(xr[i]) * r;
    }
    const C mean_dh = block_reduce(dot, Sum<C>()) / C(cols);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = w ? widen<C>(gr[i]) * widen<C>(w[i]) : widen<C>(gr[i]);
        const C v = r * (d - widen<C>(xr[i]) * r * mean_dh);
        dx[row * cols + i] = static_cast<T>(add ? v + widen<C>(add[row * cols + i]) : v);
    }
}

template <typename T, typename O, typename C, int V, int N>
__device__ void rms_norm_forward_cached(const T* x, const T* w, O* y, C* rstd, long long rows,
                                        int cols, C eps)
{
    const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    const bool live = row < rows;   // a last block's rows past the end reduce zeros, store nothing
    const long long start = row * cols;
    C v[N][V];
    C squares = 0;
    FOR_EACH_VECTOR(j, col) {
        const Pack<T, V> p = live ? load_pack<V>(x + start + col) : Pack<T, V>{};
#pragma unroll
        for (int k = 0; k < V; ++k) {
            v[j][k] = widen<C>(p.v[k]);
            squares += v[j][k] * v[j][k];
        }
    }
    const C r = C(1) / sqrt(row_reduce(squares, Sum<C>()) / C(cols) + eps);
    if (!live)
        return;
    FOR_EACH_VECTOR(j, col) {
        Pack<O, V> out;
        Pack<T, V> wv;
        if (w)
            wv = load_pack<V>(w + col);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const C h = v[j][k] * r;
            out.v[k] = static_cast<O>(w ? h * widen<C>(wv.v[k]) : h);
        }
        store_pack(y + start + col, out);
    }
    if (threadIdx.x == 0)
        rstd[row] = r;
}

// Strides over groups of blockDim.y rows as layernorm.cu's backward does; with `partials`, also
// the column sums of g xhat over a row lane's rows (the weight gradient) into partials[p][0]
// ([gridDim.x blockDim.y, 1 + dx_sum, cols], p = blockIdx.x blockDim.y + threadIdx.y), and with
// `dx_sum` those of dx into partials[p][1]. `dx_cast`
// (may be null): dx once more, in O, rounded from the stored dx (layernorm.cu's).
template <typename T, typename O, typename C, int V, int N>
__device__ void rms_norm_backward_cached(const O* g, const T* x, const C* rstd, const T* w,
                                         const T* add, T* dx, C* partials, O* dx_cast,
                                         int dx_sum, long long rows, int cols)
{
    C d[N][V], h[N][V], dw[N][V], ds[N][V];
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int k = 0; k < V; ++k)
            dw[j][k] = ds[j][k] = 0;
    const long long stride = (long long)gridDim.x * blockDim.y;
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
         row - threadIdx.y < rows; row += stride) {     // the same passes for the whole block
        const bool live = row < rows;   // a last group's rows past the end: zeros, no stores
        const long long start = live ? row * cols : 0;
        const C r = live ? rstd[row] : C(0);
        C dot = 0;
        FOR_EACH_VECTOR(j, col) {
            const Pack<O, V> gv = live ? load_pack<V>(g + start + col) : Pack<O, V>{};
            const Pack<T, V> xv = live ? load_pack<V>(x + start + col) : Pack<T, V>{};
            Pack<T, V> wv;
            if (w)
                wv = load_pack<V>(w + col);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const C gk = widen<C>(gv.v[k]);
                d[j][k] = w ? gk * widen<C>(wv.v[k]) : gk;
                h[j][k] = widen<C>(xv.v[k]) * r;
                dot += d[j][k] * h[j][k];
                dw[j][k] += gk * h[j][k];
            }
        }
        const C mean_dh = row_reduce(dot, Sum<C>()) / C(cols);
        if (!live)
            continue;
        FOR_EACH_VECTOR(j, col) {
            Pack<T, V> addv, out;
            Pack<O, V> cast;
            if (add)
                addv = load_pack<V>(add + start + col);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const C value = r * (d[j][k] - h[j][k] * mean_dh);
                out.v[k] = static_cast<T>(add ? value + widen<C>(addv.v[k]) : value);
                cast.v[k] = static_cast<O>(out.v[k]);
                ds[j][k] += widen<C>(out.v[k]);
            }
            store_pack(dx + start + col, out);
            if (dx_cast)
                store_pack(dx_cast + start + col, cast);
        }
    }
    if (!partials)
        return;
    const long long part = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    const long long slots = 1 + (dx_sum ? 1 : 0);
    FOR_EACH_VECTOR(j, col) {
        Pack<C, V> wv, sv;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            wv.v[k] = dw[j][k];
            sv.v[k] = ds[j][k];
        }
        store_pack(partials + slots * part * cols + col, wv);
        if (dx_sum)
            store_pack(partials + (slots * part + 1) * cols + col, sv);
    }
}

#define RMS_NORM_KERNELS(T, O, C, SUFFIX)                                                        \
    extern "C" __global__ void rms_norm_forward_##SUFFIX(const T* x, const T* w, O* y, C* rstd,  \
                                                         int cols, C eps)                        \
    {                                                                                            \
        rms_norm_forward<T, O, C>(x, w, y, rstd, cols, eps);                                     \
    }                                                                                            \
    extern "C" __global__ void rms_norm_backward_##SUFFIX(const O* g, const T* x, const C* rstd, \
                                                          const T* w, const T* add, T* dx,       \
                                                          int cols)                              \
    {                                                                                            \
        rms_norm_backward<T, O, C>(g, x, rstd, w, add, dx, cols);                                \
    }

#define RMS_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, N)                                           \
    extern "C" __global__ void rms_norm_forward_cached_##SUFFIX##_v##V##_n##N(                  \
        const T* x, const T* w, O* y, C* rstd, long long rows, int cols, C eps)                  \
    {                                                                                            \
        rms_norm_forward_cached<T, O, C, V, N>(x, w, y, rstd, rows, cols, eps);                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(CUPYTP_BLOCK_THREADS, NORM_BACKWARD_BLOCKS(N))          \
        rms_norm_backward_cached_##SUFFIX##_v##V##_n##N(                 \
        const O* g, const T* x, const C* rstd, const T* w, const T* add, T* dx, C* partials,     \
        O* dx_cast, int dx_sum, long long rows, int cols)                                        \
    {                                                                                            \
        rms_norm_backward_cached<T, O, C, V, N>(g, x, rstd, w, add, dx, partials, dx_cast,       \
                                                dx_sum, rows, cols);                             \
    }

// V: as layernorm.cu's (16 bytes of the narrower of x and y per vector)
#define RMS_NORM_ALL_KERNELS(T, O, C, SUFFIX, V)                                                 \
    RMS_NORM_KERNELS(T, O, C, SUFFIX) RMS_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 1)             \
    RMS_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 2)                                               \
    RMS_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 4)

RMS_NORM_ALL_KERNELS(float, float, float, f32, 4)
RMS_NORM_ALL_KERNELS(double, double, double, f64, 2)
RMS_NORM_ALL_KERNELS(__nv_bfloat16, __nv_bfloat16, float, bf16, 8)
RMS_NORM_ALL_KERNELS(__half, __half, float, f16, 8)
RMS_NORM_ALL_KERNELS(float, __nv_bfloat16, float, f32_bf16, 8)
RMS_NORM_ALL_KERNELS(float, __half, float, f32_f16, 8)
