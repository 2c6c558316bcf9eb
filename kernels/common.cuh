// Shared by the kernels of this folder (included through the loader's -I).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// bf16/fp16 convert only to float, so loads widen through float unless T is double.
template <typename C, typename T>
__device__ __forceinline__ C widen(T x) { return static_cast<C>(static_cast<float>(x)); }
template <>
__device__ __forceinline__ double widen<double, double>(double x) { return x; }

// -infinity and NaN without <math.h> (NVRTC compiles without the host headers)
template <typename C>
__device__ __forceinline__ C negative_infinity();
template <>
__device__ __forceinline__ float negative_infinity<float>() { return __int_as_float(0xff800000); }
template <>
__device__ __forceinline__ double negative_infinity<double>()
{
    return __longlong_as_double(0xfff0000000000000ULL);
}
template <typename C>
__device__ __forceinline__ C quiet_nan();
template <>
__device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <>
__device__ __forceinline__ double quiet_nan<double>()
{
    return __longlong_as_double(0x7ff8000000000000ULL);
}
