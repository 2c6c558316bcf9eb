"""Draw the ratio tables of docs/benchmarks.md into docs/img/*.png:
`python bench/plot_benchmarks.py` (or give the page and the output folder).

The numbers come from the markdown tables themselves (nothing is measured or typed in here):
- collectives.png: latency and bus bandwidth against raw NCCL, per op and size, for each
  collectives table (columns "latency ×" and "bandwidth %");
- training_vs_pytorch.png: training-step speed and memory against PyTorch, per configuration
  (columns "speed ×" and "memory ×");
- attention.png: flash attention against PyTorch's, forward and forward+backward, per shape
  (column "flash vs torch flash").

`python bench/plot_benchmarks.py long LOG... [--out PNG]` draws long_context.png from the logs
of bench/long_context.py (its RESULT and ANCHOR lines, e.g. gpu_bench.sh long's or cp's): peak
memory and tokens/s against the sequence length per model, one line per split of cupytp's
(recomputation, cp, tp, sequence parallelism, fsdp) and PyTorch's.
Needs matplotlib (`pip install matplotlib`); without it the script says so and draws nothing.
"""
import argparse
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def tables(markdown):
    """[(heading, header cells, rows of cells)] of every pipe table, under its nearest heading."""
    found, heading, lines = [], "", markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: "):
            header = cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            found.append((heading, header, rows))
            continue
        i += 1
    return found


def cells(line):
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def numbers(cell):
    """The numbers written in a cell: '0.84×, 0.88×' gives [0.84, 0.88]; '—' gives []."""
    return [float(n) for n in NUMBER.findall(cell.replace(",", ", "))]


def mebibytes(size):
    """'2 MiB (1 MiB per rank)' gives 2.0, '4 GiB' gives 4096.0."""
    value, unit = size.split()[:2]
    return float(value) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[unit]


def column(header, rows, name):
    """The cells of column `name` (by header text) in every row."""
    index = header.index(name)
    return [row[index] for row in rows]


def with_columns(found, *names):
    return [(heading, header, rows) for heading, header, rows in found
            if all(name in header for name in names)]


def plot_collectives(plt, found, path):
    chosen = with_columns(found, "op", "size", "latency ×", "bandwidth %")
    figure, (latency, bandwidth) = plt.subplots(1, 2, figsize=(12, 4.5))
    for heading, header, rows in chosen:
        ranks = "4 ranks" if "4 ranks" in heading else "2 ranks"
        ops = column(header, rows, "op")
        for op in dict.fromkeys(ops):
            picked = [row for row, name in zip(rows, ops) if name == op]
            sizes = [mebibytes(size) for size in column(header, picked, "size")]
            style = "-o" if ranks == "2 ranks" else "--s"
            latency.plot(sizes, [numbers(v)[0] for v in column(header, picked, "latency ×")],
                         style, label=f"{op}, {ranks}")
            bandwidth.plot(sizes, [numbers(v)[0] for v in column(header, picked, "bandwidth %")],
                           style, label=f"{op}, {ranks}")
    latency.axhline(1.2, color="red", linewidth=0.8, linestyle=":", label="target ≤ 1.2×")
    bandwidth.axhline(97, color="red", linewidth=0.8, linestyle=":", label="target ≥ 97%")
    for axis, title in ((latency, "latency, × raw NCCL (lower is better)"),
                        (bandwidth, "bus bandwidth, % of raw NCCL (higher is better)")):
        axis.set(title=title, xlabel="size (MiB)", xscale="log")
    latency.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_bars(plt, labels, series, title, path, reference=1.0):
    """Grouped horizontal bars: `series` is [(name, values)], one value per label."""
    figure, axis = plt.subplots(figsize=(10, 0.6 * len(labels) * len(series) + 1.5))
    height = 0.8 / len(series)
    for k, (name, values) in enumerate(series):
        positions = [i + k * height for i in range(len(labels))]
        bars = axis.barh(positions, values, height=height, label=name)
        axis.bar_label(bars, fmt="%.2f×", fontsize=8, padding=2)
    axis.axvline(reference, color="black", linewidth=0.8)
    axis.set_yticks([i + height * (len(series) - 1) / 2 for i in range(len(labels))], labels,
                    fontsize=8)
    axis.invert_yaxis()
    axis.set_title(title)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_training(plt, found, path):
    _, header, rows = with_columns(found, "config", "speed ×", "memory ×")[-1]
    labels = column(header, rows, "config")
    series = [(f"{name} (cupytp / PyTorch)", [numbers(v)[0] for v in column(header, rows, name)])
              for name in ("speed ×", "memory ×")]
    plot_bars(plt, labels, series, "GPT-2 training step, cupytp against PyTorch in the same call",
              path)


def plot_attention(plt, found, path):
    _, header, rows = with_columns(found, "B,H,T,D", "flash vs torch flash")[-1]
    labels = [f"{shape}, {mask}, dropout {p}" for shape, mask, p in
              zip(*(column(header, rows, name) for name in ("B,H,T,D", "mask", "dropout")))]
    ratios = [numbers(v) for v in column(header, rows, "flash vs torch flash")]
    series = [("forward", [r[0] for r in ratios]), ("forward + backward", [r[1] for r in ratios])]
    plot_bars(plt, labels, series, "flash attention, × PyTorch's flash speed (higher is better)",
              path)


LONG_RESULT = re.compile(r"^RESULT cupytp long-context (?P<model>\S+) .*?\bcp=(?P<cp>\d+) "
                         r"tp=(?P<tp>\d+) sp=(?P<sp>\d) recompute=(?P<recompute>\d) "
                         r"(?:fsdp=(?P<fsdp>\d) )?.*?"
                         r"\bT=(?P<T>\d+) (?P<rest>.*)$")
PYTORCH = "PyTorch SDPA, no recompute"


def long_context_runs(text):
    """{model: {series: {T: (peak GiB, tokens/s), or None where it did not run}}} from
    bench/long_context.py's lines: a RESULT line is cupytp's (its series named by its split and
    recomputation), an ANCHOR line PyTorch's, of the model of the RESULT lines before it."""
    runs, model = {}, None
    for line in text.splitlines():
        line = line.strip()
        found = LONG_RESULT.match(line)
        if found:
            model, length = found["model"], int(found["T"])
            series = "cupytp" + "".join(
                label for label, on in ((f", cp={found['cp']}", found["cp"] != "1"),
                                        (f", tp={found['tp']}", found["tp"] != "1"),
                                        ("+sp", found["sp"] == "1"),
                                        (", recompute", found["recompute"] == "1"),
                                        (", fsdp", found["fsdp"] == "1")) if on)
            rest = found["rest"]
        elif line.startswith("ANCHOR") and model is not None and re.search(r"\bT=\d", line):
            length = int(re.search(r"\bT=(\d+)", line)[1])
            series, rest = PYTORCH, line
        else:
            continue
        peak = re.search(r"peak_(?:alloc_GiB|mem_GiB)=([\d.]+)", rest)
        speed = re.search(r"tok/s=([\d,]+)", rest)
        runs.setdefault(model, {}).setdefault(series, {})[length] = \
            (float(peak[1]), float(speed[1].replace(",", ""))) if peak and speed else None
    return runs


def spaced(lengths, apart=0.3):
    """The lengths, ascending, less those within `apart` (in log2) of the last one kept: tick
    labels that do not overlap on a log axis."""
    kept = []
    for t in sorted(lengths):
        if not kept or math.log2(t) - math.log2(kept[-1]) >= apart:
            kept.append(t)
    return kept


def plot_long_context(plt, runs, path):
    """Peak memory (top) and tokens/s (bottom) against T, one column per model, one line per
    series; the lengths a series has no number for are named in its label."""
    figure, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 8.5), squeeze=False)
    for column, (model, series) in enumerate(runs.items()):
        lengths = sorted({t for points in series.values() for t in points})
        for row, (what, unit) in enumerate((("peak memory of a training step (B=1)",
                                             "peak allocated (GiB)"),
                                            ("speed of a training step (B=1)", "tokens/s"))):
            axis = axes[row][column]
            for name, points in series.items():
                ran = sorted(t for t, point in points.items() if point is not None)
                missing = sorted(t for t, point in points.items() if point is None)
                label = name + (f" (none at T={', '.join(map(str, missing))})" if missing
                                else "")
                axis.plot(ran, [points[t][row] for t in ran],
                          "--s" if name == PYTORCH else "-o", label=label)
            axis.set(title=f"{model}: {what}", xlabel="sequence length T", ylabel=unit)
            axis.set_xscale("log", base=2)
            axis.minorticks_off()
            shown = spaced(lengths)
            axis.set_xticks(shown, [f"{t // 1024}k" if t >= 1024 else str(t) for t in shown])
            axis.set_ylim(bottom=0)
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def pyplot():
    """matplotlib.pyplot drawing to files, or None (said) where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plots drawn")
        return None
    return plt


def main_long(argv):
    """`long LOG... [--out PNG]`: long_context.png from bench/long_context.py's logs; returns
    the path drawn (None without matplotlib)."""
    p = argparse.ArgumentParser(prog="plot_benchmarks.py long")
    p.add_argument("logs", nargs="+", help="logs of bench/long_context.py")
    p.add_argument("--out", default=REPO / "docs" / "img" / "long_context.png", type=Path)
    args = p.parse_args(argv)
    runs = long_context_runs("\n".join(Path(log).read_text() for log in args.logs))
    if not runs:
        p.error(f"no RESULT line of bench/long_context.py in {', '.join(args.logs)}")
    plt = pyplot()
    if plt is None:
        return None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_long_context(plt, runs, args.out)
    print(f"wrote {args.out}")
    return args.out


def main(page=REPO / "docs" / "benchmarks.md", out=REPO / "docs" / "img"):
    plt = pyplot()
    if plt is None:
        return []
    found = tables(Path(page).read_text())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    drawn = []
    for name, plot in (("collectives.png", plot_collectives),
                       ("training_vs_pytorch.png", plot_training),
                       ("attention.png", plot_attention)):
        plot(plt, found, out / name)
        drawn.append(out / name)
        print(f"wrote {out / name}")
    return drawn


if __name__ == "__main__":
    if sys.argv[1:2] == ["long"]:
        main_long(sys.argv[2:])
    else:
        main(*sys.argv[1:])
