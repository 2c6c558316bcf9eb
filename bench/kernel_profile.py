"""Where a program's GPU time goes, kernel by kernel: runs a Python script under the CUDA
profiler that PyTorch ships (CUPTI; it sees every kernel of the process, CuPy's and cuBLAS's
too, also inside CUDA graphs) and prints device time per kernel and per kind of kernel.

    python bench/kernel_profile.py --per 10 -- bench/train_gpt2.py --B 8 --dtype bf16 --steps 5
    python bench/kernel_profile.py --per 10 -- .carry/anchors/torch_tp_gpt2.py --sdpa 1 --steps 10

`--per` divides the totals, so the figures read as ms per step: the number of steps run after
the mark, where the script calls `mark()` of this module (the training benchmarks do after
their warm-up, and then run `--steps` timed steps and 5 more for the device time: `--per` is
steps + 5) or, for the PyTorch anchors, at their first `torch.cuda.synchronize()` (after their
warm-up); without a mark, everything counts (initialization included). Needs torch with CUDA.
Under mpiexec or torchrun every rank is profiled and the first prints.
"""
import argparse
import collections
import os
import re
import runpy
import sys

KINDS = (   # first match wins
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("matmul", r"gemm|nvjet|cutlass|sm90_xmma|sm80_xmma|ampere|hopper|cublas|splitK"),
    ("layernorm", r"layer_?norm|ln_|rms_?norm"),
    ("rotary", r"rotary|rope"),
    ("silu gate", r"swiglu|silu"),
    ("cross-entropy", r"cross_entropy|softmax|log_softmax|nll"),
    ("optimizer", r"adam|sgd|multi_tensor|l2norm|scale|clip|values"),
    ("gelu", r"gelu"),
    ("embedding", r"embedding|index|gather|scatter"),
    ("dropout", r"dropout|philox|random"),
    ("copy/cast", r"copy|cast|convert|astype|transpose|contiguous|memcpy|memset|fill"),
    ("elementwise", r"elementwise|vectorized|cupy_|add|mul|where"),
)


_marks = []
_synchronize = None     # torch.cuda.synchronize, kept by main() before it is wrapped


def mark():
    """Count only the kernels launched from now on (the device is synchronized first)."""
    from torch.profiler import record_function
    _synchronize()
    with record_function("kernel_profile.mark") as event:
        _marks.append(event)


def kind(name):
    low = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, low)), "other")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per", type=float, default=1.0, help="divide totals by this (steps run)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--sites", metavar="REGEX", help="for kernels whose name matches, print the "
                   "Python lines that launch them (records every Python call: eager runs only)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile
    sys.modules.setdefault("kernel_profile", sys.modules[__name__])   # for mark()
    sys.argv = [a.script] + [x for x in a.args if x != "--"]
    global _synchronize
    _synchronize = torch.cuda.synchronize

    def first_synchronize_marks(*args, **kwargs):     # an anchor's first one, after warm-up
        torch.cuda.synchronize = _synchronize
        if not _marks:
            mark()
    torch.cuda.synchronize = first_synchronize_marks
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=bool(a.sites)) as prof:
        try:
            runpy.run_path(a.script, run_name="__main__")
        except SystemExit as done:      # a script ending in sys.exit(main()): profiled still
            if done.code not in (None, 0):
                raise
        _synchronize()
    events = prof.events()
    marked = [e.time_range.start for e in events if e.name == "kernel_profile.mark"]
    since = marked[0] if marked else float("-inf")
    per_name = collections.defaultdict(lambda: [0.0, 0])
    spans = {True: [], False: []}      # is NCCL -> [(start, end)] µs
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA or \
                event.time_range.start < since:
            continue
        entry = per_name[event.name]
        entry[0] += event.device_time_total if hasattr(event, "device_time_total") \
            else event.cuda_time_total
        entry[1] += 1
        spans[kind(event.name) == "nccl"].append((event.time_range.start,
                                                  event.time_range.end))
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))
    if rank != "0":
        return
    total = sum(t for t, _ in per_name.values())
    per_kind = collections.defaultdict(lambda: [0.0, 0])
    for name, (t, n) in per_name.items():
        per_kind[kind(name)][0] += t
        per_kind[kind(name)][1] += n
    scale = 1e-3 / a.per       # µs in total -> ms per step
    print(f"\n{a.script}: {total * scale:.2f} ms of kernels per step "
          f"({'after the mark' if marked else 'initialization included'}), "
          f"{sum(n for _, n in per_name.values()) / a.per:.0f} kernels per step")
    comm, compute = union(spans[True]), union(spans[False])
    print(f"busy {(length(union(spans[True] + spans[False]))) * scale:.2f} ms per step; "
          f"communication {length(comm) * scale:.2f} ms, of which exposed (no other kernel "
          f"running) {(length(comm) - overlap(comm, compute)) * scale:.2f} ms")
    print(f"{'kind':16} {'ms/step':>8} {'share':>6} {'kernels':>8}")
    for k, (t, n) in sorted(per_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"{k:16} {t * scale:8.2f} {100 * t / total:5.1f}% {n / a.per:8.0f}")
    print(f"\ntop {a.top} kernels:")
    for name, (t, n) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"{t * scale:8.3f} ms {n / a.per:6.0f}x  {kind(name):13} {name[:110]}")
    if a.sites:
        print_sites(prof, a.sites, a.per, a.top)
    print(f"\nmost launched {a.top} kernels:")
    for name, (t, n) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"{n / a.per:6.0f}x {t * scale:8.3f} ms  {kind(name):13} {name[:110]}")


def print_sites(prof, pattern, per, top):
    """Launches of kernels named like `pattern`, by the innermost lines of the profiled program
    (outside torch and this file) on the Python stack of the launching call: from the chrome
    trace, kernels joined to their launch by correlation id, launches to the Python calls open
    on their thread."""
    import json
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as exported:
            trace = json.load(exported)["traceEvents"]
    wanted = {e["args"]["correlation"]: e["name"] for e in trace
              if e.get("cat") == "kernel" and re.search(pattern, e["name"])
              and "correlation" in e.get("args", {})}
    launches = [(e["ts"], 1, e["tid"], wanted[e["args"]["correlation"]]) for e in trace
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and e.get("args", {}).get("correlation") in wanted]
    calls = [(e["ts"], 0, e["tid"], e) for e in trace if e.get("cat") == "python_function"
             and "torch" not in e["name"] and "kernel_profile" not in e["name"]]
    open_calls = collections.defaultdict(list)        # tid -> stack of (end, name)
    sites = collections.Counter()
    marks = [e["ts"] for e in trace if e.get("name") == "kernel_profile.mark"]
    since_us = min(marks) if marks else float("-inf")
    for ts, is_launch, tid, item in sorted(launches + calls, key=lambda t: (t[0], t[1])):
        stack = open_calls[tid]
        while stack and stack[-1][0] < ts:
            stack.pop()
        if is_launch:
            if ts >= since_us:
                where = " <- ".join(name.split("/")[-1] for _, name in stack[::-1][:4])
                sites[(item[:40], where)] += 1
        else:
            stack.append((ts + item.get("dur", 0), item["name"]))
    print(f"\nlaunch sites of kernels matching {pattern!r} (per step):")
    if not sites:
        print(f"none: {len(wanted)} kernels matched, {len(launches)} of their launches found, "
              f"{len(calls)} Python calls recorded")
    for (name, where), n in sites.most_common(top):
        print(f"{n / per:6.0f}x  {name:40} {where}")


def union(spans):
    """Disjoint sorted (start, end) intervals covering `spans`."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(intervals):
    return sum(end - start for start, end in intervals)


def overlap(a, b):
    """Total length of the intersection of two disjoint sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


if __name__ == "__main__":
    main()
