// Write up to eight float64 values, passed as kernel arguments, into device memory: one launch, no
// host-to-device copy, ordered on the stream like any kernel. Optimizers keep their per-step
// scalars (learning rate, bias corrections) in device memory this way, so that a CUDA graph that
// reads them sees new values on every replay.
extern "C" __global__ void write_values_f64(double* out, int n, double v0, double v1, double v2,
                                            double v3, double v4, double v5, double v6, double v7)
{
    const double values[8] = {v0, v1, v2, v3, v4, v5, v6, v7};
    const int i = threadIdx.x;
    if (i < n) {
        out[i] = values[i];
    }
}
