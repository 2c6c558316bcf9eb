"""Draw the ratio tables of docs/benchmarks.md into docs/img/*.png:
`python bench/plot_benchmarks.py` (or give the page and the output folder).

The numbers come from the markdown tables themselves (nothing is measured or typed in here):
- collectives.png: latency and bus bandwidth against raw NCCL, per op and size, for each
  collectives table (columns "latency ×" and "bandwidth %");
- training_vs_pytorch.png: training-step speed and memory against PyTorch, per configuration
  (columns "speed ×" and "memory ×");
- attention.png: flash attention against PyTorch's, forward and forward+backward, per shape
  (column "flash vs torch flash").
Needs matplotlib (`pip install matplotlib`); without it the script says so and draws nothing.
"""
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


def main(page=REPO / "docs" / "benchmarks.md", out=REPO / "docs" / "img"):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plots drawn")
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
    main(*sys.argv[1:])
