// Dropout drawn, applied and scaled in one pass, keeping a 1-bit mask for the backward:
//     dropout:          out = r + (x + b[col]) * (keep ? scale : 0)    (b and r optional)
//     dropout_backward: dx = g * (bit ? scale : 0)
// computed in the compute dtype C and rounded once to the output's dtype; scale = 1 / (1 - p).
// x has dtype T; b, r and out have R (T, or C under autocast: an fp32 residual stream beside a
// 16-bit product); col = i % cols. Element i (local row-major index) of counter
// P = base + add + block.global(i) is kept iff 16-bit half P mod 8 of the Philox draw at
// P - P mod 8 is >= threshold = ceil(p 2^16) (philox.cuh's dropout rule). Its mask bit is bit i % 8 of byte i / 8
// (numpy.packbits' little bit order). Each thread owns 8 consecutive elements, one mask byte,
// moved as one vector of 8 per array when `vectors` (the launcher found every array aligned).
#include "common.cuh"
#include "philox.cuh"

constexpr int ELEMENTS = 8;  // per thread: one mask byte

template <typename C, int N, typename T>
__device__ __forceinline__ void load_widened(C (&v)[N], const T* p, int n, bool vectors)
{
    if (vectors && n == N) {
        const Pack<T, N> packed = load_pack<N>(p);
#pragma unroll
        for (int k = 0; k < N; ++k)
            v[k] = widen<C>(packed.v[k]);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (k < n)
                v[k] = widen<C>(p[k]);
    }
}

template <typename O, int N, typename C>
__device__ __forceinline__ void store_rounded(O* p, const C (&v)[N], int n, bool vectors)
{
    if (vectors && n == N) {
        Pack<O, N> packed;
#pragma unroll
        for (int k = 0; k < N; ++k)
            packed.v[k] = static_cast<O>(v[k]);
        store_pack(p, packed);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (k < n)
                p[k] = static_cast<O>(v[k]);
    }
}

// The grid strides over threads' groups of ELEMENTS elements: calls body(i0, n, t) for group t
// (elements i0 = 8 t to i0 + n).
#define FOR_EACH_GROUP(count, body)                                                              \
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;                         \
         t * ELEMENTS < (count); t += (long long)gridDim.x * blockDim.x) {                       \
        const long long i0 = t * ELEMENTS;                                                       \
        const int n = static_cast<int>(min(static_cast<long long>(ELEMENTS), (count) - i0));     \
        body                                                                                     \
    }

template <typename T, typename R, typename C>
__device__ void dropout_forward(const T* x, const R* bias, const R* residual, R* out,
                                unsigned char* mask, long long count, int cols, bool vectors,
                                unsigned long long threshold, C scale,
                                unsigned long long counter0, unsigned long long seed,
                                const PhiloxBlock& block)
{
    const bool runs = block.runs_of(ELEMENTS);
    FOR_EACH_GROUP(count, {
        C v[ELEMENTS];
        load_widened(v, x + i0, n, vectors);
        if (bias) {
            int col = static_cast<int>(i0 % cols);
#pragma unroll
            for (int k = 0; k < ELEMENTS; ++k) {
                if (k < n)
                    v[k] += widen<C>(bias[col]);
                col = col + 1 == cols ? 0 : col + 1;
            }
        }
        // one call for eight global neighbours where the group's counters are first .. first + 7
        // with first a multiple of 8, else a call per element (draws past the tail are made and
        // masked off)
        const unsigned long long first = counter0 + block.global(i0);
        unsigned bits = 0;
        if (runs && block.s3 == 1 && (first & 7) == 0) {
            bits = dropout_byte(first, seed, threshold);
        } else {
#pragma unroll
            for (int k = 0; k < ELEMENTS; ++k) {
                const unsigned long long counter =
                    runs ? first + k * block.s3 : counter0 + block.global(i0 + k);
                bits |= static_cast<unsigned>(dropout_keeps(counter, seed, threshold)) << k;
            }
        }
        bits &= (1u << n) - 1;
#pragma unroll
        for (int k = 0; k < ELEMENTS; ++k)
            v[k] *= (bits >> k) & 1u ? scale : C(0);
        if (residual) {
            C r[ELEMENTS];
            load_widened(r, residual + i0, n, vectors);
#pragma unroll
            for (int k = 0; k < ELEMENTS; ++k)
                v[k] = r[k] + v[k];
        }
        store_rounded(out + i0, v, n, vectors);
        if (mask)
            mask[t] = static_cast<unsigned char>(bits);
    })
}

template <typename G, typename T, typename C>
__device__ void dropout_backward(const G* g, const unsigned char* mask, T* dx, long long count,
                                 bool vectors, C scale)
{
    FOR_EACH_GROUP(count, {
        C v[ELEMENTS];
        load_widened(v, g + i0, n, vectors);
        const unsigned bits = mask[t];
#pragma unroll
        for (int k = 0; k < ELEMENTS; ++k)
            v[k] *= (bits >> k) & 1u ? scale : C(0);
        store_rounded(dx + i0, v, n, vectors);
    })
}

// dropout_<T>_<R> and dropout_backward_<R>_<T> (the gradient of out has R, dx has T)
#define DROPOUT_KERNELS(T, R, C, SUFFIX)                                                         \
    extern "C" __global__ void dropout_##SUFFIX(                                                 \
        const T* x, const R* bias, const R* residual, R* out, unsigned char* mask,               \
        long long count, int cols, bool vectors, unsigned long long threshold, C scale,          \
        PHILOX_BLOCK_PARAMS)                                                                     \
    {                                                                                            \
        dropout_forward<T, R, C>(x, bias, residual, out, mask, count, cols, vectors, threshold,  \
                                 scale, *base + add, seed, PHILOX_BLOCK);                        \
    }                                                                                            \
    extern "C" __global__ void dropout_backward_##SUFFIX(const R* g, const unsigned char* mask,  \
                                                         T* dx, long long count, bool vectors,   \
                                                         C scale)                                \
    {                                                                                            \
        dropout_backward<R, T, C>(g, mask, dx, count, vectors, scale);                           \
    }

DROPOUT_KERNELS(float, float, float, f32_f32)
DROPOUT_KERNELS(double, double, double, f64_f64)
DROPOUT_KERNELS(__nv_bfloat16, __nv_bfloat16, float, bf16_bf16)
DROPOUT_KERNELS(__half, __half, float, f16_f16)
DROPOUT_KERNELS(__nv_bfloat16, float, float, bf16_f32)
DROPOUT_KERNELS(__half, float, float, f16_f32)
