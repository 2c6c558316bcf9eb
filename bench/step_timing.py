"""The timed loop the training benchmarks share: warm-up, then steps timed with the device
synchronized around them, the device time of one step from CUDA events, and the memory pool's
peaks over the steps (warm-up and capture included, as the anchors' peaks are).

`time_steps(step, batches, warmup, steps, before_timing)` → `Timing`; `timing.fields()` is the
part of a RESULT line that every training benchmark prints the same way.
"""
import sys
import time
from dataclasses import dataclass

import numpy

import cupytp
from cupytp import backend, memory

BF16_PEAK_FLOPS = 989e12     # H100/H200 SXM dense bf16, the usual MFU denominator


@dataclass
class Timing:
    loss: object            # the last step's loss (a DTensor)
    step_s: float           # wall seconds per step, device work included
    host_s: float           # host seconds to issue a step
    device_ms: float        # median device time of one step (CUDA events; 0 on the CPU)
    stats: dict             # the pool's statistics after the steps
    init_peak: int          # the pool's allocated peak before the steps (building the model)

    def fields(self):
        """`step_ms=… device_ms=… host_ms=… peak_alloc_GiB=… peak_reserved_GiB=…
        init_peak_GiB=…` of a RESULT line."""
        gib = 2 ** 30
        return (f"step_ms={1e3 * self.step_s:.2f} device_ms={self.device_ms:.2f} "
                f"host_ms={1e3 * self.host_s:.2f} "
                f"peak_alloc_GiB={self.stats['allocated_bytes_peak'] / gib:.2f} "
                f"peak_reserved_GiB={self.stats['reserved_bytes_peak'] / gib:.2f} "
                f"init_peak_GiB={self.init_peak / gib:.2f}")


def time_steps(step, batches, warmup, steps, before_timing=None):
    """Run `warmup` steps, call `before_timing()` (when given), then time `steps` steps over
    `batches` in turn; the pool's peaks restart after building the model."""
    init_peak = memory.memory_stats()["allocated_bytes_peak"]   # building and sharding
    memory.reset_peak_memory_stats()
    for i in range(warmup):
        step(*batches[i % len(batches)])
    if before_timing is not None:
        before_timing()
    profiler = sys.modules.get("kernel_profile")   # bench/kernel_profile.py runs the script
    if profiler is not None:
        profiler.mark()                             # count the steps below, not the warm-up
    backend.synchronize()
    cupytp.distributed.barrier()
    host = 0.0
    start = time.perf_counter()
    for i in range(steps):
        issued = time.perf_counter()
        loss = step(*batches[i % len(batches)])
        host += time.perf_counter() - issued
    backend.synchronize()
    elapsed = time.perf_counter() - start
    device_ms = device_time_ms(step, batches[0])
    return Timing(loss, elapsed / steps, host / steps, device_ms, memory.memory_stats(),
                  init_peak)


def device_time_ms(step, batch, repeats=5):
    """Median device time of one step, from CUDA events around it with nothing else queued (the
    step's own host gaps included when it runs eagerly); 0 on CPU."""
    if not backend.on_gpu:
        return 0.0
    xp = backend.xp
    times = []
    for _ in range(repeats):
        backend.synchronize()
        cupytp.distributed.barrier()
        begin, end = xp.cuda.Event(), xp.cuda.Event()
        begin.record()
        step(*batch)
        end.record()
        end.synchronize()
        times.append(xp.cuda.get_elapsed_time(begin, end))
    return float(numpy.median(times))
