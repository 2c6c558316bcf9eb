"""Training logs: one row per logged step in `log.csv` and `log.jsonl`, a loss plot, and the
same rows as TensorBoard scalars (`TensorBoardLog`, through tensorboardX) or a Weights & Biases
run (`WandbLog`); the throughput the rows report (`Throughput`: tokens/s and MFU timed to the
device's completion of the steps).

Only one process should write a run's log (rank 0). A new log replaces one already in its
directory; a log opened with `resume_at=N` keeps the rows of the steps before N and continues.
"""
import contextlib
import csv
import glob
import json
import os
import time

import numpy as np

__all__ = ["MissingPackageError", "TensorBoardLog", "Throughput", "TrainLog", "WandbLog",
           "estimate_mfu", "format_bytes", "plot_loss", "read_log"]

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


class Throughput:
    """Tokens per second and model FLOPs utilization of the steps between two readings.

    A training step on a GPU only queues its work (a captured step returns once its graph is
    launched), so a host clock read after the step measures how fast steps are queued, not how
    fast they run. Each reading (`read`, where the logged loss is read anyway) and each pause
    (`paused`: validation, checkpoints) first waits for the device through `synchronize`, so an
    interval holds exactly the device work of its steps; nothing synchronizes inside a step.

    `tokens_per_step`: the global batch's tokens. `flops_per_token`: the model's training FLOPs
    per token (forward and backward); with `peak_flops` (one device's) and `devices` (how many
    ran the steps) readings give the MFU, the achieved FLOP/s per device over its peak.
    `synchronize`: waits for the device (None: nothing to wait for, as on the CPU); `clock`:
    seconds (time.perf_counter).
    """

    def __init__(self, tokens_per_step, flops_per_token=None, peak_flops=None, devices=1,
                 synchronize=None, clock=time.perf_counter):
        if peak_flops is not None and flops_per_token is None:
            raise ValueError("an MFU needs flops_per_token as well as peak_flops")
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_flops, self.devices = peak_flops, devices
        self._synchronize = synchronize or (lambda: None)
        self._clock = clock
        self.start()

    def start(self):
        """Begin an interval now (after the device's queued work)."""
        self._synchronize()
        self._began, self._paused, self.steps = self._clock(), 0.0, 0

    def step(self, count=1):
        """`count` more steps were issued in this interval."""
        self.steps += count

    @contextlib.contextmanager
    def paused(self):
        """Leave out the time of the block (validation, a checkpoint): the steps issued before
        it finish first and count in the interval; the block's own work is waited for too."""
        self._synchronize()
        began = self._clock()
        try:
            yield
        finally:
            self._synchronize()
            self._paused += self._clock() - began

    def read(self):
        """(tokens/s, MFU or None) of the steps since the last reading (or `start`), once the
        device has finished them; then a new interval begins."""
        self._synchronize()
        now = self._clock()
        elapsed = now - self._began - self._paused
        if self.steps < 1 or elapsed <= 0:
            raise ValueError(f"no steps to time: {self.steps} steps in {elapsed:.3g} s")
        tokens_per_s = self.tokens_per_step * self.steps / elapsed
        mfu = None
        if self.peak_flops is not None:
            mfu = estimate_mfu(self.flops_per_token, tokens_per_s / self.devices,
                               self.peak_flops)
        self._began, self._paused, self.steps = now, 0.0, 0
        return tokens_per_s, mfu
