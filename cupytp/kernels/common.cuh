// Shared by the kernels of this folder (included through the loader's -I).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// bf16/fp16 convert only to float, so loads widen through float unless T is double.
template <typename C, typename T>
__device__ __forceinline__ C widen(T x) { return static_cast<C>(static_cast<float>(x)); }
template <>
__device__ __forceinline__ double widen<double, double>(double x) { return x; }
