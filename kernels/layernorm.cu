// LayerNorm over the last dimension (length `cols`), one block per row (the cached forward: a
// row per blockDim.x lanes, blockDim.y rows a block):
//     xhat = (x - mean) rstd,  rstd = 1 / sqrt(var + eps)  (two passes: mean, then variance)
//     y = xhat w + b                                       (w, b optional)
//     dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)) [+ add],  dxhat = g w
// The forward also writes mean and rstd (compute dtype C, one per row) for the backward, unless
// they are null (a forward no backward follows); the backward reads x again and recomputes xhat
// from them (the same operations as the forward's, so the same values), so nothing of the row's
// size is kept between the two but x itself. x, w, b and dx have the
// storage dtype T (so has `add`, an optional gradient summed into dx: the residual stream's);
// y and g have O, which is T or (under autocast) a 16-bit dtype for an fp32 x.
// Two forms of each: *_cached_vV_nN for rows that fit the block's registers (each thread holds
// N vectors of V elements, read from memory once, moved as vectors: the launcher picks it when
// cols is a multiple of V, at most BLOCK_THREADS V N, and every array is aligned for vectors),
// and a streaming form for any row, one element at a time.
#include "common.cuh"
#include "block_reduce.cuh"

template <typename T, typename O, typename C>
__device__ void layer_norm_forward(const T* x, const T* w, const T* b, O* y, C* mean_out,
                                   C* rstd, int cols, C eps)
{
    const long long row = blockIdx.x;
    const T* xr = x + row * cols;
    C sum = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        sum += widen<C>(xr[i]);
    const C mean = block_reduce(sum, Sum<C>()) / C(cols);
    C squares = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = widen<C>(xr[i]) - mean;
        squares += d * d;
    }
    const C r = C(1) / sqrt(block_reduce(squares, Sum<C>()) / C(cols) + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C h = (widen<C>(xr[i]) - mean) * r;
        C out = w ? h * widen<C>(w[i]) : h;
        y[row * cols + i] = static_cast<O>(b ? out + widen<C>(b[i]) : out);
    }
    if (rstd && threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd[row] = r;
    }
}

template <typename T, typename O, typename C>
__device__ void layer_norm_backward(const O* g, const T* x, const C* mean, const C* rstd,
                                    const T* w, const T* add, T* dx, int cols)
{
    const long long row = blockIdx.x;
    const O* gr = g + row * cols;
    const T* xr = x + row * cols;
    const C m = mean[row], r = rstd[row];
    C sum = 0, dot = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = w ? widen<C>(gr[i]) * widen<C>(w[i]) : widen<C>(gr[i]);
        sum += d;
        dot += d * ((widen<C>(xr[i]) - m) * r);
    }
    const C mean_d = block_reduce(sum, Sum<C>()) / C(cols);
    const C mean_dh = block_reduce(dot, Sum<C>()) / C(cols);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = w ? widen<C>(gr[i]) * widen<C>(w[i]) : widen<C>(gr[i]);
        const C v = r * (d - mean_d - (widen<C>(xr[i]) - m) * r * mean_dh);
        dx[row * cols + i] = static_cast<T>(add ? v + widen<C>(add[row * cols + i]) : v);
    }
}

template <typename T, typename O, typename C, int V, int N>
__device__ void layer_norm_forward_cached(const T* x, const T* w, const T* b, O* y,
                                          C* mean_out, C* rstd, long long rows, int cols, C eps)
{
    const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    const bool live = row < rows;   // a last block's rows past the end reduce zeros, store nothing
    const long long start = row * cols;
    C v[N][V];
    C sum = 0;
    FOR_EACH_VECTOR(j, col) {
        const Pack<T, V> p = live ? load_pack<V>(x + start + col) : Pack<T, V>{};
#pragma unroll
        for (int k = 0; k < V; ++k) {
            v[j][k] = widen<C>(p.v[k]);
            sum += v[j][k];
        }
    }
    const C mean = row_reduce(sum, Sum<C>()) / C(cols);
    C squares = 0;
    FOR_EACH_VECTOR(j, col) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            v[j][k] -= mean;
            squares += v[j][k] * v[j][k];
        }
    }
    const C r = C(1) / sqrt(row_reduce(squares, Sum<C>()) / C(cols) + eps);
    if (!live)
        return;
    FOR_EACH_VECTOR(j, col) {
        Pack<O, V> out;
        Pack<T, V> wv, bv;
        if (w)
            wv = load_pack<V>(w + col);
        if (b)
            bv = load_pack<V>(b + col);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const C h = v[j][k] * r;
            const C scaled = w ? h * widen<C>(wv.v[k]) : h;
            out.v[k] = static_cast<O>(b ? scaled + widen<C>(bv.v[k]) : scaled);
        }
        store_pack(y + start + col, out);
    }
    if (rstd && threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd[row] = r;
    }
}

// The cached backward strides over groups of blockDim.y rows (a row per blockDim.x lanes; block
// b: groups b, b + gridDim.x, ...). With `partials` each row lane y also sums the weight and bias
// gradients of its rows per column, g xhat and g, and writes them to partials[p][0] and
// partials[p][1], p = blockIdx.x blockDim.y + y ([gridDim.x blockDim.y, 2 + dx_sum, cols],
// summed by the caller); with `dx_sum` also the column sums of dx, to partials[p][2]. `dx_cast` (may be null): dx once more, in O (a gradient a product
// reads in its 16-bit dtype), rounded from the stored dx.
template <typename T, typename O, typename C, int V, int N>
__device__ void layer_norm_backward_cached(const O* g, const T* x, const C* mean, const C* rstd,
                                           const T* w, const T* add, T* dx, C* partials,
                                           O* dx_cast, int dx_sum, long long rows, int cols)
{
    C d[N][V], h[N][V], dw[N][V], db[N][V], ds[N][V];
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int k = 0; k < V; ++k)
            dw[j][k] = db[j][k] = ds[j][k] = 0;
    const long long stride = (long long)gridDim.x * blockDim.y;
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
         row - threadIdx.y < rows; row += stride) {     // the same passes for the whole block
        const bool live = row < rows;   // a last group's rows past the end: zeros, no stores
        const long long start = live ? row * cols : 0;
        const C m = live ? mean[row] : C(0), r = live ? rstd[row] : C(0);
        C sum = 0, dot = 0;
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
                h[j][k] = (widen<C>(xv.v[k]) - m) * r;
                sum += d[j][k];
                dot += d[j][k] * h[j][k];
                dw[j][k] += gk * h[j][k];
                db[j][k] += gk;
            }
        }
        const C mean_d = row_reduce(sum, Sum<C>()) / C(cols);
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
                const C value = r * (d[j][k] - mean_d - h[j][k] * mean_dh);
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
    const long long slots = 2 + (dx_sum ? 1 : 0);
    FOR_EACH_VECTOR(j, col) {
        Pack<C, V> wv, bv, sv;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            wv.v[k] = dw[j][k];
            bv.v[k] = db[j][k];
            sv.v[k] = ds[j][k];
        }
        store_pack(partials + slots * part * cols + col, wv);
        store_pack(partials + (slots * part + 1) * cols + col, bv);
        if (dx_sum)
            store_pack(partials + (slots * part + 2) * cols + col, sv);
    }
}

#define LAYER_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, N)                                         \
    extern "C" __global__ void layer_norm_forward_cached_##SUFFIX##_v##V##_n##N(                \
        const T* x, const T* w, const T* b, O* y, C* mean, C* rstd, long long rows, int cols,    \
        C eps)                                                                                   \
    {                                                                                            \
        layer_norm_forward_cached<T, O, C, V, N>(x, w, b, y, mean, rstd, rows, cols, eps);       \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(CUPYTP_BLOCK_THREADS, NORM_BACKWARD_BLOCKS(N))          \
        layer_norm_backward_cached_##SUFFIX##_v##V##_n##N(               \
        const O* g, const T* x, const C* mean, const C* rstd, const T* w, const T* add, T* dx,   \
        C* partials, O* dx_cast, int dx_sum, long long rows, int cols)                           \
    {                                                                                            \
        layer_norm_backward_cached<T, O, C, V, N>(g, x, mean, rstd, w, add, dx, partials,        \
                                                  dx_cast, dx_sum, rows, cols);                  \
    }
// V: 16 bytes of the narrower of x and y per vector
#define LAYER_NORM_ALL_KERNELS(T, O, C, SUFFIX, V)                                               \
    LAYER_NORM_KERNELS(T, O, C, SUFFIX) LAYER_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 1)         \
    LAYER_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 2)                                             \
    LAYER_NORM_CACHED_KERNELS(T, O, C, SUFFIX, V, 4)

#define LAYER_NORM_KERNELS(T, O, C, SUFFIX)                                                      \
    extern "C" __global__ void layer_norm_forward_##SUFFIX(const T* x, const T* w, const T* b,  \
                                                           O* y, C* mean, C* rstd, int cols,     \
                                                           C eps)                                \
    {                                                                                            \
        layer_norm_forward<T, O, C>(x, w, b, y, mean, rstd, cols, eps);                          \
    }                                                                                            \
    extern "C" __global__ void layer_norm_backward_##SUFFIX(const O* g, const T* x,             \
                                                            const C* mean, const C* rstd,        \
                                                            const T* w, const T* add, T* dx,     \
                                                            int cols)                            \
    {                                                                                            \
        layer_norm_backward<T, O, C>(g, x, mean, rstd, w, add, dx, cols);                        \
    }

LAYER_NORM_ALL_KERNELS(float, float, float, f32, 4)
LAYER_NORM_ALL_KERNELS(double, double, double, f64, 2)
LAYER_NORM_ALL_KERNELS(__nv_bfloat16, __nv_bfloat16, float, bf16, 8)
LAYER_NORM_ALL_KERNELS(__half, __half, float, f16, 8)
LAYER_NORM_ALL_KERNELS(float, __nv_bfloat16, float, f32_bf16, 8)
LAYER_NORM_ALL_KERNELS(float, __half, float, f32_f16, 8)
