"""Side-by-side table of cupytp RESULT lines and PyTorch ANCHOR lines from one device call.

    python bench/compare.py LABEL=CUPYTP_LOG,ANCHOR_LOG [...]

Each log holds the output of one program; the last RESULT (cupytp) or ANCHOR (PyTorch) line of
each is read. A side may name several logs joined by "+" (rounds of the same program, run
alternately with the other side's so that both meet the same spells of host noise): its row
shows the round with the median tokens/s, and a line below lists every round's. Ratios are
cupytp over the anchor (tokens/s: > 1 is faster; memory: < 1 is less).
Memory: the framework pool's allocated_bytes_peak over the training steps, warm-up and graph
capture included, building the model not (its peak is the RESULT line's init_peak_GiB), beside
PyTorch's max_memory_allocated (over the whole run; torch_fsdp2.py resets it after its warm-up,
so there it covers the measured steps only). The pool's peak reserved bytes (what the device
gave it, fragmentation included) are shown beside them.
"""
import re
import sys

FIELD = re.compile(r"([\w/()]+)=([-\d.,]+)")


def last_line(path, tag):
    try:
        with open(path) as f:
            lines = [line for line in f if line.startswith(tag)]
    except OSError:
        return None
    if not lines:
        return None
    fields = {k: float(v.replace(",", "")) for k, v in FIELD.findall(lines[-1])}
    if "tok/s(total)" in fields:                      # the FSDP2 anchor's name for it
        fields["tok/s"] = fields.pop("tok/s(total)")
    return fields


def median_round(paths, tag):
    """(fields of the round with the median tokens/s, every round's tokens/s) of the logs."""
    rounds = [fields for fields in (last_line(path, tag) for path in paths.split("+")) if fields]
    if not rounds:
        return None, []
    rounds.sort(key=lambda fields: fields["tok/s"])
    return rounds[(len(rounds) - 1) // 2], [fields["tok/s"] for fields in rounds]


def main(pairs):
    header = (f"{'config':28} {'cupytp tok/s':>13} {'step ms':>8} {'dev ms':>7} {'host ms':>8} "
              f"{'GiB':>6} {'(resv)':>6} {'torch tok/s':>12} {'step ms':>8} {'GiB':>6} "
              f"{'speed x':>8} {'mem x':>6}")
    rows = [header]
    for pair in pairs:
        label, logs = pair.split("=", 1)
        ours_log, anchor_log = logs.split(",")
        ours, ours_rounds = median_round(ours_log, "RESULT")
        anchor, anchor_rounds = median_round(anchor_log, "ANCHOR")
        if ours is None or anchor is None:
            missing = ours_log if ours is None else anchor_log
            rows.append(f"{label:28} no result in {missing}")
            continue
        speed = ours["tok/s"] / anchor["tok/s"]
        memory = ours["peak_alloc_GiB"] / anchor["peak_mem_GiB"]
        rows.append(f"{label:28} {ours['tok/s']:13,.0f} {ours['step_ms']:8.2f} "
                    f"{ours['device_ms']:7.2f} {ours['host_ms']:8.2f} "
                    f"{ours['peak_alloc_GiB']:6.2f} {ours['peak_reserved_GiB']:6.2f} "
                    f"{anchor['tok/s']:12,.0f} {anchor['step_ms']:8.2f} "
                    f"{anchor['peak_mem_GiB']:6.2f} {speed:8.2f} {memory:6.2f}")
        if len(ours_rounds) > 1 or len(anchor_rounds) > 1:
            rows.append(f"{'':28} rounds: cupytp {_listed(ours_rounds)}; torch "
                        f"{_listed(anchor_rounds)} tok/s")
    print("\n".join(rows))


def _listed(values):
    return " ".join(f"{value:,.0f}" for value in values)


if __name__ == "__main__":
    main(sys.argv[1:])
