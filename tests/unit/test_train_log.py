"""cupytp.train_log: CSV and JSONL rows, the loss plot, byte and MFU formatting, throughput
timed to the device's completion of the steps."""
import csv
import json
import sys

import numpy as np
import pytest

from cupytp.train_log import (COLUMNS, Throughput, TrainLog, estimate_mfu, format_bytes,
                              plot_loss, read_log)


def read_csv(path):
    with open(path, newline="") as file:
        return list(csv.reader(file))


def test_rows_go_to_csv_and_jsonl(tmp_path):
    log = TrainLog(tmp_path / "run")
    log.log(0, loss=np.float32(4.5), lr=6e-4, tokens_per_s=np.int64(12000))
    log.log(10, loss=3.25, val_loss=3.5, mfu=0.41, mem_gib=None)
    rows = read_csv(tmp_path / "run" / "log.csv")
    assert rows == [
        ["step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gib"],
        ["0", "4.5", "", "0.0006", "", "12000", "", ""],
        ["10", "3.25", "3.5", "", "", "", "0.41", ""],
    ]
    with open(tmp_path / "run" / "log.jsonl") as file:
        lines = [json.loads(line) for line in file]
    assert lines == [{"step": 0, "loss": 4.5, "lr": 6e-4, "tokens_per_s": 12000},
                     {"step": 10, "loss": 3.25, "val_loss": 3.5, "mfu": 0.41}]
    assert read_log(tmp_path / "run") == lines


def test_a_new_log_replaces_an_earlier_runs(tmp_path):
    """A second run into the same directory holds only its own rows (and no stale plot)."""
    first = TrainLog(tmp_path)
    first.log(0, loss=3.0)
    first.log(5, loss=2.0)
    (tmp_path / "loss.png").write_bytes(b"old plot")
    second = TrainLog(tmp_path)
    assert second.replaced and not first.replaced
    second.log(0, loss=9.0)
    assert read_csv(tmp_path / "log.csv") == [list(COLUMNS), ["0", "9.0"] + [""] * 6]
    assert read_log(tmp_path) == [{"step": 0, "loss": 9.0}]
    assert not (tmp_path / "loss.png").exists()


def test_resuming_continues_the_log_without_the_steps_it_redoes(tmp_path):
    log = TrainLog(tmp_path)
    for step in range(6):
        log.log(step, loss=10.0 - step)
    resumed = TrainLog(tmp_path, resume_at=4)       # the checkpoint was at step 4
    resumed.log(4, loss=5.5)
    assert [row[0] for row in read_csv(tmp_path / "log.csv")] == ["step", "0", "1", "2", "3",
                                                                  "4"]
    assert [(row["step"], row["loss"]) for row in read_log(tmp_path)] == [
        (0, 10.0), (1, 9.0), (2, 8.0), (3, 7.0), (4, 5.5)]
    TrainLog(tmp_path / "new", resume_at=4).log(4, loss=1.0)     # resumed into a new directory
    assert read_log(tmp_path / "new") == [{"step": 4, "loss": 1.0}]


def test_column_errors(tmp_path):
    log = TrainLog(tmp_path, columns=("step", "loss", "grad_norm"))
    with pytest.raises(ValueError, match=r"\['lr'\] are not columns"):
        log.log(0, loss=1.0, lr=1e-3)
    log.log(0, loss=1.0, grad_norm=0.5)
    with pytest.raises(ValueError, match="log.csv has columns .*use another out_dir"):
        TrainLog(tmp_path, resume_at=1)
    with pytest.raises(ValueError, match="needs a 'step' column"):
        TrainLog(tmp_path / "other", columns=("loss",))


def test_read_log_without_a_log(tmp_path):
    with pytest.raises(FileNotFoundError, match="no training log"):
        read_log(tmp_path)


def test_plot_loss_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    log = TrainLog(tmp_path)
    for step in range(20):
        log.log(step, loss=4.0 / (step + 1), val_loss=4.2 / (step + 1) if step % 5 == 0 else None)
    path = plot_loss(tmp_path)
    assert path == str(tmp_path / "loss.png")
    with open(path, "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_loss_without_matplotlib_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    TrainLog(tmp_path).log(0, loss=1.0)
    assert plot_loss(tmp_path) is None
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize("num_bytes, text", [
    (0, "0 B"),
    (1023, "1023 B"),
    (1536, "1.50 KiB"),
    (3 * 2**30, "3.00 GiB"),
    (80 * 2**30 - 2**20, "80.00 GiB"),
    (5 * 2**40, "5.00 TiB"),
])
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


def test_estimate_mfu():
    # 124M-parameter GPT-2 at ~6N flops/token, 400k tokens/s on a 989 TFLOP/s peak.
    assert estimate_mfu(6 * 124e6, 400e3, 989e12) == pytest.approx(0.3009, abs=1e-4)
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        estimate_mfu(1.0, 1.0, 0)


def read_scalars(log_dir):
    """{tag: [(step, value)]} of the TensorBoard event files in `log_dir` (TFRecord framing:
    length, its CRC, the Event message, its CRC), purged steps dropped as TensorBoard does."""
    import struct
    from tensorboardX.proto import event_pb2
    found = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            if event.session_log.status == event.session_log.START:    # purge_step
                found = {tag: [p for p in points if p[0] < event.step]
                         for tag, points in found.items()}
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


def test_tensorboard_log_writes_every_metric(tmp_path):
    pytest.importorskip("tensorboardX")
    from cupytp.train_log import TensorBoardLog
    log = TensorBoardLog(str(tmp_path))
    log.log(0, loss=4.0, val_loss=4.5, lr=1e-3, grad_norm=2.0, tokens_per_s=1000.0, mfu=0.25,
            mem_gib=1.5)
    log.log(10, loss=3.0, lr=None)
    log.close()
    scalars = read_scalars(tmp_path)
    assert scalars == {"train/loss": [(0, 4.0), (10, 3.0)], "val/loss": [(0, 4.5)],
                       "train/lr": [(0, pytest.approx(1e-3))], "train/grad_norm": [(0, 2.0)],
                       "perf/tokens_per_s": [(0, 1000.0)], "perf/mfu": [(0, 0.25)],
                       "perf/mem_gib": [(0, 1.5)]}
    resumed = TensorBoardLog(str(tmp_path), resume_at=5)         # keeps step 0, drops 10
    resumed.log(5, loss=3.5)
    resumed.close()
    assert read_scalars(tmp_path)["train/loss"] == [(0, 4.0), (5, 3.5)]
    fresh = TensorBoardLog(str(tmp_path))                        # a new run: earlier files go
    fresh.log(0, loss=9.0)
    fresh.close()
    assert read_scalars(tmp_path) == {"train/loss": [(0, 9.0)]}


@pytest.mark.parametrize("kind,package", [("TensorBoardLog", "tensorboardX"),
                                          ("WandbLog", "wandb")])
def test_a_missing_package_names_the_pip_command(tmp_path, monkeypatch, kind, package):
    import cupytp.train_log as train_log
    monkeypatch.setitem(sys.modules, package, None)          # import fails as if not installed
    arguments = (str(tmp_path),) if kind == "TensorBoardLog" else ("project", str(tmp_path))
    with pytest.raises(train_log.MissingPackageError, match=f"needs the {package} package: "
                                                            f"pip install {package}$"):
        getattr(train_log, kind)(*arguments)


def test_wandb_log_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from cupytp.train_log import WandbLog
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = WandbLog("cupytp-test", str(tmp_path), config={"lr": 1e-3})
    log.log(0, loss=4.0, val_loss=4.5, grad_norm=1.0, mem_gib=None)
    log.log(1, loss=3.0)
    log.close()
    assert log.mode == "offline"
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{log.id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


class QueuedDevice:
    """A device whose steps queue: each launch costs the host `launch` seconds and the device
    `step` seconds after the work queued before it; `synchronize` waits (moves the clock) until
    the queue is done."""

    def __init__(self, launch, step):
        self.now, self.busy_until, self.launch_cost, self.step_cost = 0.0, 0.0, launch, step

    def clock(self):
        return self.now

    def launch(self):
        self.now += self.launch_cost
        self.busy_until = max(self.busy_until, self.now) + self.step_cost

    def synchronize(self):
        self.now = max(self.now, self.busy_until)


def test_throughput_is_timed_to_the_device_not_the_launches():
    """The GPU default's numbers: 16384 tokens a step, 6.7 ms of device work each, launched in
    0.1 ms. Read after 10 steps the rate is 16384 / 6.7 ms = 2.45M tokens/s (not the launch
    rate, 164M/s, nor anything between), and the MFU that rate's FLOPs over the peak; a paused
    validation counts neither its own time nor that of the steps queued before it."""
    device = QueuedDevice(launch=1e-4, step=6.7e-3)
    flops, peak = 71e6, 989e12
    meter = Throughput(16384, flops, peak, devices=1, synchronize=device.synchronize,
                       clock=device.clock)
    for _ in range(10):
        device.launch()
        meter.step()
    tokens_per_s, mfu = meter.read()
    # the device's 10 steps, after the first launch's 0.1 ms: 2.44M tokens/s
    assert tokens_per_s == pytest.approx(10 * 16384 / (1e-4 + 10 * 6.7e-3), rel=1e-12)
    assert mfu == pytest.approx(flops * tokens_per_s / peak, rel=1e-12)
    for _ in range(10):
        device.launch()
        meter.step()
    with meter.paused():               # the 10 queued steps finish first: they are timed
        device.now += 5.0              # validation: left out
    device.launch()
    meter.step()
    tokens_per_s, _ = meter.read()
    # 11 steps of the device, and the host's two launches that found it idle
    assert tokens_per_s == pytest.approx(11 * 16384 / (11 * 6.7e-3 + 2e-4), rel=1e-12)
    with pytest.raises(ValueError, match="no steps to time"):
        meter.read()


def test_throughput_counts_every_device_and_knows_no_peak():
    """tokens/s are the global batch's; the MFU divides the FLOP/s over the devices. Without a
    peak (the CPU) there is no MFU; without a synchronize the host clock is the device's."""
    times = iter([0.0, 2.0])
    meter = Throughput(4096, 6e6, 100e12, devices=4, clock=lambda: next(times))
    meter.step(8)
    tokens_per_s, mfu = meter.read()
    assert tokens_per_s == 8 * 4096 / 2.0
    assert mfu == pytest.approx(6e6 * tokens_per_s / 4 / 100e12)
    meter = Throughput(100, clock=iter([0.0, 0.5]).__next__)
    meter.step()
    assert meter.read() == (200.0, None)
    with pytest.raises(ValueError, match="flops_per_token"):
        Throughput(100, peak_flops=1e12)
