"""Rank 1 skips an all_reduce that the other ranks call: they must fail, not hang."""
import numpy

import cupytp
from cupytp import backend
from cupytp.distributed import CollectiveTimeoutError

info = cupytp.init()
group = cupytp.DeviceMesh((info.world_size,)).get_process_group(0)
if info.rank != 1:
    try:
        group.all_reduce(backend.asarray(numpy.ones(4, numpy.float32)))
        backend.synchronize()      # NCCL: the watchdog ends the job while we wait here
    except CollectiveTimeoutError as err:
        print(f"rank {info.rank} raised CollectiveTimeoutError: {err}", flush=True)
        raise
else:
    import time
    time.sleep(30)
