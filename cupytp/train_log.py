"""Training logs: one row per logged step in `log.csv` and `log.jsonl`, a loss plot, and the
same rows as TensorBoard scalars (`TensorBoardLog`, through tensorboardX) or a Weights & Biases
run (`WandbLog`).

Only one process should write a run's log (rank 0). A new log replaces one already in its
directory; a log opened with `resume_at=N` keeps the rows of the steps before N and continues.
"""
import csv
import glob
import json
import os
import time

import numpy as np

__all__ = ["MissingPackageError", "TensorBoardLog", "TrainLog", "WandbLog", "estimate_mfu",
           "format_bytes", "plot_loss", "read_log"]

COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gib")
CSV_NAME = "log.csv"
JSONL_NAME = "log.jsonl"
PLOT_NAME = "loss.png"
# the columns' names as TensorBoard tags and W&B keys: grouped into sections
TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr",
        "grad_norm": "train/grad_norm", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
        "mem_gib": "perf/mem_gib"}


class MissingPackageError(ImportError):
    """An optional package a log needs is not installed; the message names the pip command."""


def _plain_number(value):
    """A Python int or float from a Python, NumPy or CuPy scalar (a device value syncs here)."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    return float(value)


class TrainLog:
    """Rows of `columns` in out_dir/log.csv and out_dir/log.jsonl.

    A new log (`resume_at` None) replaces the log and loss plot of an earlier run in out_dir
    (`replaced` tells whether there was one). `resume_at=N` continues the log there: rows of
    steps N and later, which the resumed run logs again, are dropped. A value left out of a row
    is an empty CSV cell and absent from its JSON line.
    """

    def __init__(self, out_dir, columns=COLUMNS, resume_at=None):
        self.columns = tuple(columns)
        if "step" not in self.columns:
            raise ValueError(f"a training log needs a 'step' column, got {self.columns}")
        os.makedirs(out_dir, exist_ok=True)
        self.csv_path = os.path.join(out_dir, CSV_NAME)
        self.jsonl_path = os.path.join(out_dir, JSONL_NAME)
        self.replaced = False
        if resume_at is None:
            for name in (CSV_NAME, JSONL_NAME, PLOT_NAME):
                path = os.path.join(out_dir, name)
                if os.path.exists(path):
                    os.remove(path)
                    self.replaced = True
            return
        existing = self._existing_columns()
        if existing is not None and existing != self.columns:
            raise ValueError(f"{self.csv_path} has columns {existing}, but this log writes "
                             f"{self.columns}: use another out_dir or the same columns")
        kept = [row for row in _read_rows(self.jsonl_path) if row["step"] < resume_at]
        self._rewrite(kept)

    def log(self, step, **values):
        """Append one row: log(100, loss=3.2, lr=6e-4). Values that are None are left out."""
        unknown = sorted(set(values) - set(self.columns))
        if unknown:
            raise ValueError(f"{unknown} are not columns of this log {self.columns}")
        row = {"step": int(step)}
        for name, value in values.items():
            if value is not None:
                row[name] = _plain_number(value)
        self._append([row], "a")

    def close(self):
        """Nothing to flush: each row is written as it comes."""

    def _append(self, rows, mode):
        write_header = mode == "w" or self._existing_columns() is None
        with open(self.csv_path, mode, newline="", encoding="utf-8") as csv_file:
            writer = csv.writer(csv_file)
            if write_header:
                writer.writerow(self.columns)
            for row in rows:
                writer.writerow([row.get(name, "") for name in self.columns])
        with open(self.jsonl_path, mode, encoding="utf-8") as jsonl_file:
            jsonl_file.writelines(json.dumps(row) + "\n" for row in rows)

    def _rewrite(self, rows):
        """Both files anew with `rows`, each replaced in one step (a crash keeps the old)."""
        final = self.csv_path, self.jsonl_path
        self.csv_path, self.jsonl_path = (path + ".tmp" for path in final)
        try:
            self._append(rows, "w")
            for temp, path in zip((self.csv_path, self.jsonl_path), final):
                os.replace(temp, path)
        finally:
            self.csv_path, self.jsonl_path = final

    def _existing_columns(self):
        """The header of an existing, non-empty log.csv, else None."""
        if not os.path.exists(self.csv_path) or os.path.getsize(self.csv_path) == 0:
            return None
        with open(self.csv_path, newline="", encoding="utf-8") as csv_file:
            return tuple(next(csv.reader(csv_file)))


class TensorBoardLog:
    """The rows as TensorBoard scalars (train/loss, val/loss, train/lr, train/grad_norm,
    perf/tokens_per_s, perf/mfu, perf/mem_gib) in event files under `log_dir`, written by
    tensorboardX (`pip install tensorboardX`). A new log removes the event files of an earlier
    run there; `resume_at=N` keeps them and has TensorBoard drop their points from step N on."""

    def __init__(self, log_dir, resume_at=None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise MissingPackageError("--tensorboard needs the tensorboardX package: pip install "
                                      "tensorboardX") from None
        if resume_at is None:
            for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
                os.remove(path)
        # the suffix keeps the files of two runs started in one second apart, in order
        self.writer = SummaryWriter(log_dir, purge_step=resume_at, flush_secs=10,
                                    filename_suffix=f".{time.time_ns()}")

    def log(self, step, **values):
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(TAGS[name], _plain_number(value), int(step))

    def close(self):
        self.writer.close()


class WandbLog:
    """The rows logged to a Weights & Biases run of `project` (`pip install wandb`). Offline
    (WANDB_MODE=offline) the run is kept under `run_dir`/wandb for a later `wandb sync`.
    `run_id` continues an earlier run (a resumed training run); `id` names this one."""

    def __init__(self, project, run_dir, config=None, run_id=None):
        try:
            import wandb
        except ImportError:
            raise MissingPackageError("--wandb needs the wandb package: pip install wandb") \
                from None
        os.makedirs(run_dir, exist_ok=True)
        try:
            self.run = wandb.init(project=project, dir=run_dir, config=config, id=run_id,
                                  resume="allow" if run_id else None)
        except Exception as err:     # wandb's own error types: no login, no network, ...
            raise RuntimeError(f"W&B could not start a run of {project!r}: "
                               f"{str(err).splitlines()[0] if str(err) else type(err).__name__} "
                               "(run `wandb login`, or set WANDB_MODE=offline)") from None
        self.id = self.run.id
        self.mode = "offline" if getattr(self.run, "offline", False) else "online"

    def log(self, step, **values):
        self.run.log({TAGS[name]: _plain_number(value) for name, value in values.items()
                      if value is not None}, step=int(step))

    def close(self):
        self.run.finish()


def read_log(out_dir):
    """The rows of out_dir/log.jsonl, as dicts."""
    path = os.path.join(out_dir, JSONL_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no training log at {path}: TrainLog({out_dir!r}) writes one")
    return _read_rows(path)


def _read_rows(path):
    """The rows of a log.jsonl; none where there is no file."""
    if not os.path.exists(path):
        return []
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
