"""Both ranks capture a step that all-reduces; later rank 1 stops replaying it while rank 0
replays on: rank 0's watchdog must end the job naming the replay, not hang."""
import sys
import time

import numpy

import cupytp
from cupytp import backend

info = cupytp.init()
group = cupytp.DeviceMesh((info.world_size,)).get_process_group(0)
total = backend.asarray(numpy.zeros(4, numpy.float32))


def reduce_step(x):
    y = group.all_reduce(x * 2)
    total[...] += y
    return y


step = cupytp.cuda_graph(reduce_step)
x = backend.asarray(numpy.ones(4, numpy.float32))
for _ in range(4):                  # warm-up, capture, two replays: every rank takes part
    step(x)
backend.synchronize()
print(f"rank {info.rank} replayed {float(total[0]):g}", flush=True)
if info.rank == 1:
    time.sleep(60)
    sys.exit(0)
step(x)                             # rank 1 never joins this replay's all_reduce
backend.synchronize()
print(f"rank {info.rank} passed the hung replay", flush=True)
