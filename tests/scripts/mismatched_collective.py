"""Under CUPYTP_DEBUG=1, rank 1 goes wrong at the first collective: with `skip` it skips an
all_reduce and calls the next one; with `shape` it all-reduces another shape. Every rank must
raise CollectiveMismatchError naming both calls, long before the timeout."""
import sys

import numpy

import cupytp
from cupytp import backend
from cupytp.distributed.fingerprint import CollectiveMismatchError

info = cupytp.init()
group = cupytp.DeviceMesh((info.world_size,)).get_process_group(0)
mode = sys.argv[1]
first = backend.asarray(numpy.ones(4, numpy.float32))
try:
    if info.rank != 1:
        group.all_reduce(first)
    elif mode == "shape":
        group.all_reduce(backend.asarray(numpy.ones(5, numpy.float32)))
    group.all_reduce(first)                               # the collective rank 1 calls first
    backend.synchronize()
except CollectiveMismatchError as err:
    print(f"rank {info.rank} raised CollectiveMismatchError: {err}", flush=True)
    sys.exit(3)
print(f"rank {info.rank} finished without an error", flush=True)
