// dst = src (or dst += src with `add`) converted to dst's dtype, over `rows` rows of `cols`
// elements whose starts are `src_pitch` / `dst_pitch` elements apart (a 1-D array is one row):
// the conversion through float (double for double), summed in the wider of the two and rounded
// once. VEC consecutive elements per thread with one aligned vector load and store each (the
// launcher picks VEC = 4 only when every row start is aligned for it); a grid-stride loop.
#include "common.cuh"

template <typename S, typename D, typename C, int VEC>
__device__ void cast_rows(const S* src, long long src_pitch, D* dst, long long dst_pitch,
                          long long cols, long long rows, int add)
{
    const long long per_row = cols / VEC;
    const long long n = per_row * rows;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / per_row, col = (i - row * per_row) * VEC;
        const Pack<S, VEC> in = *reinterpret_cast<const Pack<S, VEC>*>(src + row * src_pitch + col);
        Pack<D, VEC>* target = reinterpret_cast<Pack<D, VEC>*>(dst + row * dst_pitch + col);
        Pack<D, VEC> out;
        if (add) {
            const Pack<D, VEC> old = *target;
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                out.v[k] = static_cast<D>(widen<C>(old.v[k]) + widen<C>(in.v[k]));
        } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                out.v[k] = static_cast<D>(widen<C>(in.v[k]));
        }
        *target = out;
    }
}

#define CAST_KERNEL(S, D, C, NAME, VEC)                                                          \
    extern "C" __global__ void cast_rows_##NAME##_v##VEC(                                       \
        const S* src, long long src_pitch, D* dst, long long dst_pitch, long long cols,          \
        long long rows, int add)                                                                 \
    {                                                                                            \
        cast_rows<S, D, C, VEC>(src, src_pitch, dst, dst_pitch, cols, rows, add);               \
    }
#define CAST_KERNELS(S, D, C, NAME) CAST_KERNEL(S, D, C, NAME, 1) CAST_KERNEL(S, D, C, NAME, 4)

CAST_KERNELS(float, __nv_bfloat16, float, f32_bf16)
CAST_KERNELS(__nv_bfloat16, float, float, bf16_f32)
CAST_KERNELS(float, __half, float, f32_f16)
CAST_KERNELS(__half, float, float, f16_f32)
CAST_KERNELS(float, float, float, f32_f32)
CAST_KERNELS(__nv_bfloat16, __nv_bfloat16, float, bf16_bf16)
CAST_KERNELS(double, double, double, f64_f64)
