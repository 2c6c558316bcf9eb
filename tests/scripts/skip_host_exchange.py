"""Rank 1 skips a host exchange (argv[1]: an object gathered over a group, an object broadcast
over the world, the creation of a mesh) that the other ranks make: they must fail, not hang."""
import sys
import time

import cupytp
from cupytp.distributed import CollectiveTimeoutError, broadcast_object

info = cupytp.init()
group = cupytp.DeviceMesh((info.world_size,)).get_process_group(0)
exchanges = {
    "all_gather_object": lambda: group.all_gather_object(info.rank),
    "broadcast_object": lambda: broadcast_object("seed", src=1),     # never sent
    "mesh": lambda: cupytp.DeviceMesh((1, info.world_size), ("dp", "tp")),
}
if info.rank != 1:
    try:
        exchanges[sys.argv[1]]()
    except CollectiveTimeoutError as err:
        print(f"rank {info.rank} raised CollectiveTimeoutError: {err}", flush=True)
        raise
else:
    time.sleep(30)
