// The row norms of layernorm.cu and rmsnorm.cu, each form (streaming, cached; forward, backward)
// one template for both: with CENTERED (LayerNorm) xhat = (x - mean) rstd and y = xhat w + b;
// without (RMSNorm) xhat = x rstd and y = xhat w, there being neither a mean nor a bias (their
// pointers are null and never read). Each file's header says what its kernels compute and take;
// the expressions below are each norm's own, operation for operation.
#pragma once
#include "common.cuh"
#include "block_reduce.cuh"

// xhat of one element
template <bool CENTERED, typename C>
__device__ __forceinline__ C normalized(C x, C mean, C r)
{
    return CENTERED ? (x - mean) * r : x * r;
}

// the row's statistics for the backward: mean (CENTERED) and rstd; a LayerNorm forward that no
// backward follows passes null for both
template <bool CENTERED, typename C>
__device__ __forceinline__ void keep_statistics(C* mean_out, C* rstd, long long row, C mean,
                                                C r)
{
    if ((!CENTERED || rstd) && threadIdx.x == 0) {
        if (CENTERED)
            mean_out[row] = mean;
        rstd[row] = r;
    }
}

template <bool CENTERED, typename T, typename O, typename C>
__device__ void norm_forward(const T* x, const T* w, const T* b, O* y, C* mean_out, C* rstd,
                             int cols, C eps)
{
    const long long row = blockIdx.x;
    const T* xr = x + row * cols;
    C mean = 0;
    if (CENTERED) {
        C sum = 0;
        for (int i = threadIdx.x; i < cols; i += blockDim.x)
            sum += widen<C>(xr[i]);
        mean = block_reduce(sum, Sum<C>()) / C(cols);
    }
    C squares = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = CENTERED ? widen<C>(xr[i]) - mean : widen<C>(xr[i]);
        squares += d * d;
    }
    const C r = C(1) / sqrt(block_reduce(squares, Sum<C>()) / C(cols) + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C h = normalized<CENTERED>(widen<C>(xr[i]), mean, r);
        const C out = w ? h * widen<C>(w[i]) : h;
        y[row * cols + i] = static_cast<O>(CENTERED && b ? out + widen<C>(b[i]) : out);
    }
    keep_statistics<CENTERED>(mean_out, rstd, row, mean, r);
}

template <bool CENTERED, typename T, typename O, typename C>
__device__ void norm_backward(const O* g, const T* x, const C* mean, const C* rstd, const T* w,
                              const T* add, T* dx, int cols)
{
    const long long row = blockIdx.x;
    const O* gr = g + row * cols;
    const T* xr = x + row * cols;
    const C m = CENTERED ? mean[row] : C(0), r = rstd[row];
    C sum = 0, dot = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = w ? widen<C>(gr[i]) * widen<C>(w[i]) : widen<C>(gr[i]);
        if (CENTERED)
            sum += d;
        dot += CENTERED ? d * normalized<CENTERED>(widen<C>(xr[i]), m, r) : d * widen<C>(xr[i]) * r;
    }
    const C mean_d = CENTERED ? block_reduce(sum, Sum<C>()) / C(cols) : C(0);
    const C mean_dh = block_reduce(dot, Sum<C>()) / C(cols);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const C d = w ? widen<C>(gr[i]) * widen<C>(w[i]) : widen<C>(gr[i]);
        const C v = r * ((CENTERED ? d - mean_d : d) -
                         normalized<CENTERED>(widen<C>(xr[i]), m, r) * mean_dh);
        dx[row * cols + i] = static_cast<T>(add ? v + widen<C>(add[row * cols + i]) : v);
    }
}

template <bool CENTERED, typename T, typename O, typename C, int V, int N>
__device__ void norm_forward_cached(const T* x, const T* w, const T* b, O* y, C* mean_out,
                                    C* rstd, long long rows, int cols, C eps)
{
    const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    const bool live = row < rows;   // a last block's rows past the end reduce zeros, store nothing
    const long long start = row * cols;
    C v[N][V];
    C sum = 0, squares = 0;
    FOR_EACH_VECTOR(j, col) {
        const Pack<T, V> p = live ? load_pack<V>(x + start + col) : Pack<T, V>{};
#pragma unroll
        for (int k = 0; k < V; ++k) {
            v[j][k] = widen<C>(p.v[k]);
            if (CENTERED)
                sum += v[j][k];
            else
                squares += v[j][k] * v[j][k];
        }
    }
    C mean = 0;
    if (CENTERED) {   // a second pass over the registers, centring
        mean = row_reduce(sum, Sum<C>()) / C(cols);
        FOR_EACH_VECTOR(j, col) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                v[j][k] -= mean;
                squares += v[j][k] * v[j][k];
            }
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
        if (CENTERED && b)
            bv = load_pack<V>(b + col);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const C h = v[j][k] * r;
            const C scaled = w ? h * widen<C>(wv.v[k]) : h;
            out.v[k] = static_cast<O>(CENTERED && b ? scaled + widen<C>(bv.v[k]) : scaled);
        }
        store_pack(y + start + col, out);
    }
    keep_statistics<CENTERED>(mean_out, rstd, row, mean, r);
}

// The cached backward strides over groups of blockDim.y rows (a row per blockDim.x lanes; block
// b: groups b, b + gridDim.x, ...). With `partials` each row lane y also sums per column the
// weight gradient g xhat of its rows into slot 0 of partials[p] (p = blockIdx.x blockDim.y + y),
// with CENTERED the bias gradient g into slot 1, and with `dx_sum` the column sums of dx into
// the slot after those ([gridDim.x blockDim.y, slots, cols], summed by the caller). `dx_cast`
// (may be null): dx once more, in O (a gradient a product reads in its 16-bit dtype), rounded
// from the stored dx.
template <bool CENTERED, typename T, typename O, typename C, int V, int N>
__device__ void norm_backward_cached(const O* g, const T* x, const C* mean, const C* rstd,
                                     const T* w, const T* add, T* dx, C* partials, O* dx_cast,
                                     int dx_sum, long long rows, int cols)
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
        const C m = CENTERED && live ? mean[row] : C(0), r = live ? rstd[row] : C(0);
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
                h[j][k] = normalized<CENTERED>(widen<C>(xv.v[k]), m, r);
                if (CENTERED)
                    sum += d[j][k];
                dot += d[j][k] * h[j][k];
                dw[j][k] += gk * h[j][k];
                if (CENTERED)
                    db[j][k] += gk;
            }
        }
        const C mean_d = CENTERED ? row_reduce(sum, Sum<C>()) / C(cols) : C(0);
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
                const C value = r * ((CENTERED ? d[j][k] - mean_d : d[j][k]) -
                                     h[j][k] * mean_dh);
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
    constexpr int SUMS = CENTERED ? 2 : 1;   // the parameters' gradient slots before dx's sums
    const long long slots = SUMS + (dx_sum ? 1 : 0);
    FOR_EACH_VECTOR(j, col) {
        Pack<C, V> wv, bv, sv;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            wv.v[k] = dw[j][k];
            bv.v[k] = db[j][k];
            sv.v[k] = ds[j][k];
        }
        store_pack(partials + slots * part * cols + col, wv);
        if (CENTERED)
            store_pack(partials + (slots * part + 1) * cols + col, bv);
        if (dx_sum)
            store_pack(partials + (slots * part + SUMS) * cols + col, sv);
    }
}
