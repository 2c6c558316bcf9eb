"""examples/train_gpt2.py end to end on the CPU: it learns, TP=2 follows TP=1, and bad input
ends in one clear error line (once, not once per rank) with a non-zero exit."""
import csv
import math
import os
import subprocess
import sys

import pytest

from launch import REPO, mpiexec, under_mpiexec

pytestmark = pytest.mark.skipif(under_mpiexec(), reason="launches its own jobs")
SMALL = ["--batch-size", "4", "--seq-len", "32", "--sample-tokens", "0", "--eval-batches", "2"]


def run(args, ranks=1, timeout=600):
    command = ["examples/train_gpt2.py"] + args
    if ranks > 1:
        return mpiexec(ranks, command, timeout=timeout)
    return subprocess.run([sys.executable] + command, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))


def losses(out):
    with open(os.path.join(out, "log.csv")) as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


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
    two = run(common + ["--tp", "2", "--out", str(tmp_path / "tp2")], ranks=2)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    a, b = losses(str(tmp_path / "tp1")), losses(str(tmp_path / "tp2"))
    assert len(a) == len(b) == 20
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 2e-4 * abs(x), f"step {step}: tp1 {x} vs tp2 {y}"


@pytest.mark.parametrize("args,message", [
    (["--data", "no/such/file.txt"], "does not exist"),
    (["--data", "EMPTY"], "empty"),
    (["--seq-len", "4096"], "longer than the model's context"),
    (["--model", "13B"], "unknown GPT-2 preset"),
    (["--init-from", "BAD"], "not a readable safetensors"),
    (["--tp", "3"], "must equal"),
    (["--steps", "many"], "invalid int value"),
])
def test_bad_input_one_line_nonzero_exit(tmp_path, args, message):
    empty, bad = tmp_path / "empty.txt", tmp_path / "bad.safetensors"
    empty.write_text("")
    bad.write_bytes(b"garbage")
    args = [str(empty) if a == "EMPTY" else str(bad) if a == "BAD" else a for a in args]
    result = run(args + ["--steps", "1", "--out", str(tmp_path / "out")], ranks=2, timeout=120)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
