"""Memory of building a GPT on the mesh:  mpiexec -n N python bench/construction.py

Builds the model inside `cupytp.deferred_init()`, fully shards it over the N ranks and
materializes it, measuring on each rank the bytes allocated by the construction: tracemalloc's
peak on the CPU (it sees every NumPy array; the Python objects of the deferred model are
counted apart), the memory pool's peak on a GPU. Prints one RESULT line per rank with the
measured peak beside the bound, the rank's share of the fp32 weights plus one group's
parameters.

    mpiexec -n 4 python bench/construction.py                         # 24 x 1024 (~350M)
    python bench/construction.py --layers 32 --embd 4096 --deferred-only   # 7B, never made
"""
import argparse
import time
import tracemalloc

import cupytp
from cupytp import backend, memory
from cupytp.models.gpt2 import GPT2, preset
from cupytp.parallel import fully_shard


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--group-mib", type=float, default=1.0, help="fully_shard's group_bytes")
    p.add_argument("--untied", action="store_true", help="an LM head of its own")
    p.add_argument("--deferred-only", action="store_true",
                   help="build the deferred model and stop: its parameters take no memory")
    args = p.parse_args()
    info = cupytp.init()
    config = preset("124M", n_layer=args.layers, n_embd=args.embd, n_head=args.heads,
                    tie_word_embeddings=not args.untied)
    mesh = cupytp.DeviceMesh((info.world_size,), ("dp",))
    measure = Peak()
    start = time.perf_counter()
    with cupytp.deferred_init():
        model = GPT2(config)
    deferred = measure.now()
    total = sum(p.size for p in model.parameters()) * 4
    if args.deferred_only:
        report(info.rank, f"deferred L={args.layers} C={args.embd} "
               f"params={total / 4 / 1e9:.2f}B fp32_GiB={total / 2 ** 30:.2f}",
               peak=deferred, seconds=time.perf_counter() - start)
        return
    fully_shard(model, mesh, group_bytes=int(args.group_mib * 2 ** 20))
    objects = measure.now()
    cupytp.materialize(model)
    peak = measure.peak() - objects
    shard = sum(p.to_local().nbytes for p in model.parameters())
    group = max(g.nbytes() for g in model.fsdp_groups)
    bound = total / info.world_size + group
    report(info.rank, f"fsdp L={args.layers} C={args.embd} ranks={info.world_size} "
           f"params={total / 4 / 1e6:.0f}M fp32_GiB={total / 2 ** 30:.3f} "
           f"shard_GiB={shard / 2 ** 30:.3f} group_GiB={group / 2 ** 30:.3f} "
           f"bound_GiB={bound / 2 ** 30:.3f} within_bound={int(peak <= bound)}",
           peak=peak, seconds=time.perf_counter() - start)


class Peak:
    """Bytes allocated: tracemalloc's on the CPU, the pool's on a GPU (`now()` also starts a
    new peak from here)."""

    def __init__(self):
        if not backend.on_gpu:
            tracemalloc.start()
        self.now()

    def now(self):
        if backend.on_gpu:
            memory.reset_peak_memory_stats()
            return memory.memory_stats()["allocated_bytes"]
        current = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        return current

    def peak(self):
        if backend.on_gpu:
            return memory.memory_stats()["allocated_bytes_peak"]
        return tracemalloc.get_traced_memory()[1]


def report(rank, text, peak, seconds):
    print(f"RESULT construction rank={rank} {text} peak_GiB={peak / 2 ** 30:.3f} "
          f"({peak / 2 ** 20:.1f} MiB) seconds={seconds:.1f}", flush=True)


if __name__ == "__main__":
    main()
