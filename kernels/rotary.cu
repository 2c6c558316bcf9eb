// Rotary position embeddings in Hugging Face's rotate-half form, over x (B, T, H, D) with D
// contiguous: for each pair (i, i + D/2) of a head at token t, with angle θ = position(t) f_i,
//     y_i = x_i cos θ - s x_{i+D/2} sin θ,   y_{i+D/2} = x_{i+D/2} cos θ + s x_i sin θ
// where s = +1 rotates (forward) and s = -1 rotates back (the backward: the rotation's
// transpose). position(t) = start + t; cos and sin come from tables (positions, D/2) in the
// compute dtype C. y may be x itself (in place) or another array; both are strided views (batch,
// token and head strides in elements). Each thread owns V consecutive pairs of one row (one b,
// t, h), moved as vectors (the launcher picks V > 1 only where every row start is aligned for
// them); grid-stride loops cover any size.
#include "common.cuh"

struct RotaryStrides {
    long long batch, token, head;
};

template <typename T, typename C, int V>
__device__ void rotary(const T* x, T* y, const C* cos_table, const C* sin_table, long long rows,
                       int tokens, int heads, int half, RotaryStrides xs, RotaryStrides ys,
                       long long start, C sign)
{
    const int per_row = half / V;
    const long long total = rows * per_row;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long row = idx / per_row;
        const int i = static_cast<int>(idx % per_row) * V;
        const int h = static_cast<int>(row % heads);
        const long long bt = row / heads;
        const int t = static_cast<int>(bt % tokens);
        const long long b = bt / tokens;
        const T* xr = x + b * xs.batch + t * xs.token + h * xs.head;
        T* yr = y + b * ys.batch + t * ys.token + h * ys.head;
        const C* c = cos_table + (start + t) * half + i;
        const C* s = sin_table + (start + t) * half + i;
        const Pack<T, V> first = load_pack<V>(xr + i), second = load_pack<V>(xr + half + i);
        Pack<T, V> out_first, out_second;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const C x1 = widen<C>(first.v[k]), x2 = widen<C>(second.v[k]);
            const C ck = c[k], sk = sign * s[k];
            out_first.v[k] = static_cast<T>(x1 * ck - x2 * sk);
            out_second.v[k] = static_cast<T>(x2 * ck + x1 * sk);
        }
        store_pack(yr + i, out_first);
        store_pack(yr + half + i, out_second);
    }
}

#define ROTARY_KERNEL(T, C, SUFFIX, V)                                                           \
    extern "C" __global__ void rotary_##SUFFIX##_v##V(                                           \
        const T* x, T* y, const C* cos_table, const C* sin_table, long long rows, int tokens,     \
        int heads, int half, long long x_batch, long long x_token, long long x_head,             \
        long long y_batch, long long y_token, long long y_head, long long start, C sign)         \
    {                                                                                            \
        rotary<T, C, V>(x, y, cos_table, sin_table, rows, tokens, heads, half,                   \
                        RotaryStrides{x_batch, x_token, x_head},                                 \
                        RotaryStrides{y_batch, y_token, y_head}, start, sign);                   \
    }
#define ROTARY_KERNELS(T, C, SUFFIX, V)                                                          \
    ROTARY_KERNEL(T, C, SUFFIX, 1) ROTARY_KERNEL(T, C, SUFFIX, V)

ROTARY_KERNELS(float, float, f32, 4)
ROTARY_KERNELS(double, double, f64, 2)
ROTARY_KERNELS(__nv_bfloat16, float, bf16, 8)
ROTARY_KERNELS(__half, float, f16, 8)
