"""Small float64 vectors of per-step scalars in device memory: `values.cu` writes them on the GPU
(one launch, values as kernel arguments), the NumPy twin assigns them."""
import numpy

from cupytp.launchers import get_kernel, is_device_array

MAX_VALUES = 8


def write_values(out, values):
    """out[:len(values)] = values, for a float64 vector `out` (CuPy or NumPy), at most 8 values.
    On the GPU this is a kernel launch: asynchronous, and legal inside a CUDA-graph capture."""
    values = [float(v) for v in values]
    if len(values) > MAX_VALUES:
        raise ValueError(f"write_values takes at most {MAX_VALUES} values, got {len(values)}")
    if out.dtype != numpy.float64 or out.ndim != 1 or out.size < len(values):
        raise ValueError(f"write_values needs a float64 vector of at least {len(values)} "
                         f"elements, got {out.dtype} {out.shape}")
    if not is_device_array(out):
        out[:len(values)] = values
        return
    padded = values + [0.0] * (MAX_VALUES - len(values))
    get_kernel("values.cu", "write_values_f64")(
        (1,), (MAX_VALUES,), (out, numpy.int32(len(values)), *map(numpy.float64, padded)))
