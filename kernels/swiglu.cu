// The SiLU gate of a SwiGLU MLP, over h (rows, 2, cols) holding each row's gate g = h[r, 0] and
// up projection u = h[r, 1] side by side (the output of one fused gate|up product):
//     y = silu(g) u,  silu(g) = g sigmoid(g)                              (y: (rows, cols))
//     dg = dy u sigmoid(g) (1 + g (1 - sigmoid(g))),  du = dy silu(g)     (dh: (rows, 2, cols))
// The backward may also write y again (`y` not null) for the next product's weight gradient, so
// the forward's y need not be kept. Computed in C (float for fp32/bf16/fp16, double for fp64);
// each thread owns V consecutive columns of a row, moved as vectors (the launcher picks V > 1
// only where cols and every pointer allow them); grid-stride loops cover any size.
#include "common.cuh"

template <typename C>
__device__ __forceinline__ C sigmoid(C g)
{
    return C(1) / (C(1) + exp(-g));
}

// Calls body(row, col, g, u) for each vector of V columns of every row (a grid-stride loop),
// with the gate's and the up projection's V values there.
template <typename T, int V, typename Body>
__device__ __forceinline__ void for_each_gate_vector(const T* h, long long rows, int cols,
                                                     Body body)
{
    const int per_row = cols / V;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < rows * per_row;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long row = idx / per_row;
        const int col = static_cast<int>(idx % per_row) * V;
        const T* hr = h + 2 * row * cols;
        body(row, col, load_pack<V>(hr + col), load_pack<V>(hr + cols + col));
    }
}

template <typename T, typename C, int V>
__device__ void swiglu_forward(const T* h, T* y, long long rows, int cols)
{
    for_each_gate_vector<T, V>(h, rows, cols, [&](long long row, int col, const Pack<T, V>& gv,
                                                   const Pack<T, V>& uv) {
        Pack<T, V> out;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const C g = widen<C>(gv.v[k]);
            out.v[k] = static_cast<T>(g * sigmoid(g) * widen<C>(uv.v[k]));
        }
        store_pack(y + row * cols + col, out);
    });
}

template <typename T, typename C, int V>
__device__ void swiglu_backward(const T* h, const T* dy, T* dh, T* y, long long rows, int cols)
{
    for_each_gate_vector<T, V>(h, rows, cols, [&](long long row, int col, const Pack<T, V>& gv,
                                                   const Pack<T, V>& uv) {
        const Pack<T, V> dyv = load_pack<V>(dy + row * cols + col);
        Pack<T, V> dg, du, out;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const C g = widen<C>(gv.v[k]), u = widen<C>(uv.v[k]), d = widen<C>(dyv.v[k]);
            const C s = sigmoid(g);
            dg.v[k] = static_cast<T>(d * u * s * (C(1) + g * (C(1) - s)));
            du.v[k] = static_cast<T>(d * g * s);
            out.v[k] = static_cast<T>(g * s * u);
        }
        T* dhr = dh + 2 * row * cols;
        store_pack(dhr + col, dg);
        store_pack(dhr + cols + col, du);
        if (y)
            store_pack(y + row * cols + col, out);
    });
}

#define SWIGLU_KERNELS(T, C, SUFFIX, V)                                                          \
    extern "C" __global__ void swiglu_forward_##SUFFIX##_v##V(const T* h, T* y, long long rows,  \
                                                              int cols)                          \
    {                                                                                            \
        swiglu_forward<T, C, V>(h, y, rows, cols);                                               \
    }                                                                                            \
    extern "C" __global__ void swiglu_backward_##SUFFIX##_v##V(                                  \
        const T* h, const T* dy, T* dh, T* y, long long rows, int cols)                          \
    {                                                                                            \
        swiglu_backward<T, C, V>(h, dy, dh, y, rows, cols);                                      \
    }
#define ALL_SWIGLU_KERNELS(T, C, SUFFIX, V)                                                      \
    SWIGLU_KERNELS(T, C, SUFFIX, 1) SWIGLU_KERNELS(T, C, SUFFIX, V)

ALL_SWIGLU_KERNELS(float, float, f32, 4)
ALL_SWIGLU_KERNELS(double, double, f64, 2)
ALL_SWIGLU_KERNELS(__nv_bfloat16, float, bf16, 8)
ALL_SWIGLU_KERNELS(__half, float, f16, 8)
