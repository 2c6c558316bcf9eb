"""examples/train_gpt2.py end to end on the CPU: it learns, TP=2 follows TP=1, validation is
measured before the update, bad input (flags, a non-finite loss, Ctrl-C) ends in one clear line
(once, not once per rank) with a non-zero exit."""
import csv
import importlib.util
import math
import os
import signal
import subprocess
import sys
import time

import numpy
import pytest

from launch import REPO, mpiexec, under_mpiexec

pytestmark = pytest.mark.skipif(under_mpiexec(), reason="launches its own jobs")
# the tiny model on every device (the script's own default is 124M on a GPU)
SMALL = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "0",
         "--eval-batches", "2"]


def run(args, ranks=1, timeout=600, env=None):
    command = ["examples/train_gpt2.py"] + args
    if ranks > 1:
        return mpiexec(ranks, command, timeout=timeout, env=env)
    return subprocess.run([sys.executable] + command, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))


def rows(out):
    with open(os.path.join(out, "log.csv")) as f:
        return list(csv.DictReader(f))


def losses(out):
    return [float(row["loss"]) for row in rows(out) if row["loss"]]


def test_tiny_model_learns(tmp_path):
    out = str(tmp_path / "run")
    result = run(["--steps", "40", "--log-interval", "5", "--eval-interval", "20",
                  "--batch-size", "8", "--seq-len", "64", "--sample-tokens", "16", "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(out)
    assert abs(curve[0] - math.log(257)) < 0.15, curve[0]
    assert curve[-1] < curve[0] - 1.0, curve
    assert "--- sample ---" in result.stdout
    assert os.path.isfile(os.path.join(out, "log.jsonl"))


def test_tp2_follows_tp1(tmp_path):
    common = ["--steps", "20", "--log-interval", "1", "--eval-interval", "1000"] + SMALL
    one = run(common + ["--out", str(tmp_path / "tp1")])
    two = run(common + ["--tp", "2", "--out", str(tmp_path / "tp2")], ranks=2,
              env={"CUPYTP_LOG_RANKS": "1"})
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    a, b = losses(str(tmp_path / "tp1")), losses(str(tmp_path / "tp2"))
    assert len(a) == len(b) == 20
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 2e-4 * abs(x), f"step {step}: tp1 {x} vs tp2 {y}"
    for rank in (0, 1):             # CUPYTP_LOG_RANKS: every rank's lines, its memory in them
        assert f"[rank {rank}] GPT-2 tiny" in two.stdout
        head = f"[rank {rank}] step 19/20: loss"      # forwarded output may join ranks' lines
        line = next(line[line.index(head):] for line in two.stdout.splitlines() if head in line)
        assert "mem (now/peak GiB) " in line and " r1 " not in line


def val_losses(out):
    return [float(row["val_loss"]) for row in rows(out) if row["val_loss"]]


def test_splits_of_one_global_batch_train_alike(tmp_path):
    """A global batch of 8 sequences taken whole on one rank, in micro-batches (--grad-accum),
    over data-parallel ranks (replicated, fully sharded) and over tensor-parallel ranks: the same
    training and validation losses at every step (fp32: to its rounding).
    The logged loss is the whole batch's, and validation takes whole batches, however split."""
    common = ["--steps", "6", "--log-interval", "1", "--eval-interval", "3", "--model", "tiny",
              "--seq-len", "32", "--sample-tokens", "0", "--eval-batches", "2"]
    splits = {"whole": (1, ["--batch-size", "8"]),
              "accum": (1, ["--batch-size", "4", "--grad-accum", "2"]),
              "dp": (2, ["--batch-size", "2", "--grad-accum", "2"]),
              "fsdp": (2, ["--batch-size", "4", "--fsdp"]),
              "tp": (2, ["--batch-size", "8", "--tp", "2"])}
    curves = {}
    for name, (ranks, args) in splits.items():
        out = str(tmp_path / name)
        result = run(common + args + ["--out", out], ranks=ranks)
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
        curves[name] = losses(out), val_losses(out)
    whole = curves.pop("whole")
    assert len(whole[0]) == 6 and len(whole[1]) == 3
    for name, (train, val) in curves.items():
        numpy.testing.assert_allclose(train, whole[0], rtol=2e-4, err_msg=name)
        numpy.testing.assert_allclose(val, whole[1], rtol=2e-4, err_msg=name)


def test_validation_before_the_update(tmp_path):
    """The validation loss logged at a step is the model's before that step's update (as the
    training loss is): step 0's does not depend on the learning rate; the trained model's is
    logged at step --steps."""
    common = ["--steps", "1"] + SMALL
    logs = []
    for lr in ("1e-4", "1e-2"):
        result = run(common + ["--lr", lr, "--out", str(tmp_path / lr)])
        assert result.returncode == 0, result.stderr[-3000:]
        logs.append(rows(str(tmp_path / lr)))
    assert [row["step"] for row in logs[0]] == ["0", "1"]
    assert logs[0][0]["val_loss"] == logs[1][0]["val_loss"]
    assert abs(float(logs[0][0]["val_loss"]) - math.log(257)) < 0.1
    assert logs[0][1]["loss"] == "" and logs[0][1]["val_loss"] != logs[1][1]["val_loss"]


def test_nonfinite_loss_stops_with_the_step(tmp_path):
    result = run(["--lr", "1e30", "--grad-clip", "0", "--warmup", "0", "--steps", "4",
                  "--log-interval", "2"] + SMALL + ["--out", str(tmp_path)], ranks=2,
                 timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0
    assert len(errors) == 1 and "the training loss is not finite from step 1 on" in errors[0], \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Warning" not in result.stderr
    assert "mem (now/peak GiB) r0 " in result.stdout and ", r1 " in result.stdout  # every rank's


def test_ctrl_c_is_one_line_and_plots_what_was_logged(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "examples/train_gpt2.py", "--steps", "100000", "--log-interval",
               "2"] + SMALL + ["--out", str(out)]
    process = subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (out / "log.csv").is_file() or len(rows(str(out))) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, errors = process.communicate(timeout=120)
    assert process.returncode == 130, errors
    lines = errors.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted at step "), errors
    assert lines[0].endswith(f"; logs in {out}")
    assert int(lines[0].split()[3].rstrip(";")) >= 2
    assert (out / "loss.png").stat().st_size > 0


@pytest.mark.parametrize("args,message", [
    (["--data", "no/such/file.txt"], "does not exist"),
    (["--data", "EMPTY"], "empty"),
    (["--seq-len", "4096"], "longer than the model's context"),
    (["--model", "13B"], "unknown GPT-2 preset"),
    (["--init-from", "BAD"], "not a readable safetensors"),
    (["--init-from", "BADCONFIG"], "config.json is not valid JSON"),
    (["--tp", "3"], "--tp 3 does not divide the model's 4 attention heads: with 2 ranks use "
                    "--tp 1 or --tp 2"),
    (["--tp", "2", "--dp", "2"], "is 4 ranks, but 2 were launched: run mpiexec -n 4, or leave "
                                 "--dp out"),
    (["--steps", "many"], "invalid int value"),
    (["--steps", "0"], "argument --steps: 0 is not an integer > 0"),
    (["--lr", "nan"], "argument --lr: nan is not a finite number > 0"),
    (["--eval-interval", "0"], "argument --eval-interval: 0 is not an integer > 0"),
    (["--log-interval", "0"], "argument --log-interval: 0 is not an integer > 0"),
    (["--grad-accum", "-1"], "argument --grad-accum: -1 is not an integer > 0"),
    (["--checkpoint", "UNWRITABLE"], "is not a writable directory"),
    pytest.param(["--tokenizer", "tiktoken"], "needs the tiktoken package",
                 marks=pytest.mark.skipif(importlib.util.find_spec("tiktoken") is not None,
                                          reason="tiktoken is installed")),
])
def test_bad_input_one_line_nonzero_exit(tmp_path, args, message):
    empty, bad, config = tmp_path / "empty.txt", tmp_path / "bad.safetensors", tmp_path / "hf"
    empty.write_text("")
    bad.write_bytes(b"garbage")
    config.mkdir()
    (config / "model.safetensors").write_bytes(b"garbage")
    (config / "config.json").write_text("{garbage")
    (tmp_path / "file").write_text("")
    named = {"EMPTY": empty, "BAD": bad, "BADCONFIG": config, "UNWRITABLE": tmp_path / "file/x"}
    args = [str(named.get(a, a)) for a in args]
    result = run(["--model", "tiny", "--seq-len", "32"] + args +      # the GPU default is 1024
                 ["--steps", "1", "--out", str(tmp_path / "out")], ranks=2, timeout=120)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "log.csv").exists(), "training started"
