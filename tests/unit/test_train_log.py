"""cupytp.train_log: CSV and JSONL rows, the loss plot, byte and MFU formatting."""
import csv
import json
import sys

import numpy as np
import pytest

from cupytp.train_log import COLUMNS, TrainLog, estimate_mfu, format_bytes, plot_loss, read_log


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
