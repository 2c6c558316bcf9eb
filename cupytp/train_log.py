"""Training logs: one row per logged step in `log.csv` and `log.jsonl`, and a loss plot.

Only one process should write a run's log (rank 0). Restarting into the same out_dir appends.
"""
import csv
import json
import os

import numpy as np

__all__ = ["TrainLog", "estimate_mfu", "format_bytes", "plot_loss", "read_log"]

COLUMNS = ("step", "loss", "val_loss", "lr", "tokens_per_s", "mfu", "mem_gib")
CSV_NAME = "log.csv"
JSONL_NAME = "log.jsonl"
PLOT_NAME = "loss.png"


def _plain_number(value):
    """A Python int or float from a Python, NumPy or CuPy scalar (a device value syncs here)."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    return float(value)


class TrainLog:
    """Append rows of `columns` to out_dir/log.csv and out_dir/log.jsonl.

    A value left out of a row is an empty CSV cell and absent from its JSON line.
    """

    def __init__(self, out_dir, columns=COLUMNS):
        self.columns = tuple(columns)
        if "step" not in self.columns:
            raise ValueError(f"a training log needs a 'step' column, got {self.columns}")
        os.makedirs(out_dir, exist_ok=True)
        self.csv_path = os.path.join(out_dir, CSV_NAME)
        self.jsonl_path = os.path.join(out_dir, JSONL_NAME)
        existing = self._existing_columns()
        if existing is not None and existing != self.columns:
            raise ValueError(f"{self.csv_path} has columns {existing}, but this log writes "
                             f"{self.columns}: use another out_dir or the same columns")

    def log(self, step, **values):
        """Append one row: log(100, loss=3.2, lr=6e-4). Values that are None are left out."""
        unknown = sorted(set(values) - set(self.columns))
        if unknown:
            raise ValueError(f"{unknown} are not columns of this log {self.columns}")
        row = {"step": int(step)}
        for name, value in values.items():
            if value is not None:
                row[name] = _plain_number(value)
        write_header = self._existing_columns() is None
        with open(self.csv_path, "a", newline="", encoding="utf-8") as csv_file:
            writer = csv.writer(csv_file)
            if write_header:
                writer.writerow(self.columns)
            writer.writerow([row.get(name, "") for name in self.columns])
        with open(self.jsonl_path, "a", encoding="utf-8") as jsonl_file:
            jsonl_file.write(json.dumps(row) + "\n")

    def _existing_columns(self):
        """The header of an existing, non-empty log.csv, else None."""
        if not os.path.exists(self.csv_path) or os.path.getsize(self.csv_path) == 0:
            return None
        with open(self.csv_path, newline="", encoding="utf-8") as csv_file:
            return tuple(next(csv.reader(csv_file)))


def read_log(out_dir):
    """The rows of out_dir/log.jsonl, as dicts."""
    path = os.path.join(out_dir, JSONL_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no training log at {path}: TrainLog({out_dir!r}) writes one")
    with open(path, encoding="utf-8") as jsonl_file:
        return [json.loads(line) for line in jsonl_file if line.strip()]


def plot_loss(out_dir):
    """Plot train and validation loss against step to out_dir/loss.png and return its path.

    Returns None, writing nothing, when matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    rows = read_log(out_dir)
    figure = Figure(figsize=(7, 4.5))
    axes = figure.add_subplot()
    for column, style in (("loss", "-"), ("val_loss", "o-")):
        points = [(row["step"], row[column]) for row in rows if column in row]
        if points:
            steps, losses = zip(*points)
            axes.plot(steps, losses, style, label=column, markersize=3)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend()
    path = os.path.join(out_dir, PLOT_NAME)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def format_bytes(num_bytes):
    """A byte count in binary units: format_bytes(3 * 2**30) == "3.00 GiB"."""
    if abs(num_bytes) < 1024:
        return f"{int(num_bytes)} B"
    value = num_bytes / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def estimate_mfu(flops_per_token, tokens_per_s, peak_flops):
    """Model FLOPs utilization: achieved FLOP/s (flops_per_token * tokens_per_s) / peak_flops."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return flops_per_token * tokens_per_s / peak_flops
