"""bench/long_context.py trains GPT-2 and a Llama at each length, on one rank and over cp=2,
one RESULT line per length; with --anchor it runs the PyTorch model of the same shape (here a
stand-in script printing its command line and a peak that grows with T) and prints PEAK and
SLOPE lines from both; bad input stops it with one error before any work."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from cupytp import backend
from cupytp.models import model_spec
from launch import REPO, mpiexec, under_mpiexec

pytestmark = pytest.mark.skipif(under_mpiexec(), reason="launches its own jobs")
SCRIPT = "bench/long_context.py"
RESULT = re.compile(
    r"RESULT cupytp long-context (?P<model>\S+) dtype=(?:fp32|bf16) dp=1 cp=(?P<cp>\d) tp=1 "
    r"sp=0 recompute=(?P<recompute>\d) fsdp=(?P<fsdp>\d) B=1 T=(?P<T>\d+) tok/s=(?P<tok_s>\d+) "
    r"step_ms=(?P<ms>[\d.]+) peak_alloc_GiB=(?P<peak>[\d.]+) "
    r"peak_reserved_GiB=(?P<reserved>[\d.]+) state_GiB=(?P<state>[\d.]+) "
    r"act_KiB_per_token=(?P<per_token>[\d.]+)$")
# torch_llama.py's stand-in: its ANCHOR line holds T, its arguments, 10·T tokens/s and a peak of
# T/16 GiB; at T=96 it fails as an out-of-memory run does, at T=128 it outlasts --anchor-timeout
FAKE_ANCHOR = """import sys, time
T = int(sys.argv[sys.argv.index("--T") + 1])
if T == 96:
    sys.exit("torch.OutOfMemoryError: CUDA out of memory (stand-in)")
if T == 128:
    time.sleep(60)
print(f"ANCHOR torch-llama-eager T={T} args={' '.join(sys.argv[1:])} tok/s={T * 10} "
      f"peak_mem_GiB={T / 16:.2f}")
"""


def load(name):
    """bench/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PYTORCH = load("plot_benchmarks").PYTORCH


def bench(args, ranks=1):
    """The finished run of the benchmark (fp32 unless `args` say otherwise)."""
    command = [SCRIPT, "--dtype", "fp32", "--steps", "1", "--warmup", "1"] + args
    if ranks > 1:
        return mpiexec(ranks, command, timeout=300)
    return subprocess.run([sys.executable] + command, cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))


def results(done, model, lengths, cp=1, recompute=0, fsdp=0):
    """The RESULT lines of a finished run, checked: one per length, in order, each
    self-consistent (tokens/s is the tokens of a step over its time; the peak holds the
    state)."""
    assert done.returncode == 0, done.stderr[-3000:]
    found = [RESULT.match(line) for line in done.stdout.splitlines()
             if line.startswith("RESULT")]
    assert all(found), done.stdout
    assert [(m["model"], int(m["cp"]), int(m["recompute"]), int(m["fsdp"]), int(m["T"]))
            for m in found] == [(model, cp, recompute, fsdp, t) for t in lengths]
    for m in found:
        ms, tok_s = float(m["ms"]), int(m["tok_s"])
        assert ms > 0 and tok_s == pytest.approx(int(m["T"]) * 1e3 / ms, rel=0.02)
        assert float(m["peak"]) >= float(m["state"]) >= 0 and float(m["per_token"]) >= 0
        assert float(m["reserved"]) >= float(m["peak"])
    return found


def test_gpt2_runs_each_length():
    done = bench(["--model", "tiny", "--T", "32,64"])
    results(done, "tiny", [32, 64])
    assert "SLOPE cupytp T=32..64 " in done.stdout


def test_llama_runs_each_length_over_two_context_parallel_ranks_recomputed():
    done = bench(["--model", "llama-tiny", "--T", "32,64", "--cp", "2", "--recompute"], ranks=2)
    results(done, "llama-tiny", [32, 64], cp=2, recompute=1)


def test_gpt2_runs_over_two_context_parallel_ranks_fully_sharded_over_them():
    done = bench(["--model", "tiny", "--T", "32,64", "--cp", "2", "--fsdp"], ranks=2)
    results(done, "tiny", [32, 64], cp=2, fsdp=1)


def test_the_anchor_of_a_llama_has_its_shape_and_its_peaks_are_compared(tmp_path):
    (tmp_path / "torch_llama.py").write_text(FAKE_ANCHOR)
    done = bench(["--model", "llama-tiny", "--T", "32,64,96,128", "--recompute", "--dtype",
                  "bf16", "--anchor", str(tmp_path), "--anchor-timeout", "2"])
    results(done, "llama-tiny", [32, 64, 96, 128], recompute=1)
    lines = done.stdout.splitlines()
    anchors = [line for line in lines if line.startswith("ANCHOR")]
    assert anchors[0] == ("ANCHOR torch-llama-eager T=32 args=--layers 4 --dim 128 --heads 4 "
                          "--kv-heads 2 --ffn 352 --vocab 257 --tied 1 --theta 10000.0 --B 1 "
                          "--T 32 --steps 3 tok/s=320 peak_mem_GiB=2.00")
    assert anchors[2] == ("ANCHOR torch T=96: none (torch.OutOfMemoryError: CUDA out of memory "
                          "(stand-in))")
    assert anchors[3] == "ANCHOR torch T=128: none (timed out after 2 s)"
    peaks = [line for line in lines if line.startswith("PEAK")]
    assert [re.search(r"T=(\d+) .*torch_GiB=([\d.]+)", line).groups() for line in peaks] == \
        [("32", "2.00"), ("64", "4.00")]
    # (4 - 2) GiB over 32 more tokens
    assert "SLOPE torch T=32..64 act_KiB_per_token=65536.0 (peak growth per token)" in lines
    runs = load("plot_benchmarks").long_context_runs(done.stdout)       # what gets drawn
    assert list(runs) == ["llama-tiny"] and list(runs["llama-tiny"]) == ["cupytp, recompute",
                                                                         PYTORCH]
    assert runs["llama-tiny"][PYTORCH] == {32: (2.0, 320), 64: (4.0, 640), 96: None, 128: None}


def test_the_anchor_of_gpt2_has_its_shape():
    command = load("long_context").anchor_command(model_spec("tiny"), "DIR", 1, 32, "fp32")
    assert command[1:] == [os.path.join("DIR", "torch_tp_gpt2.py"), "--layers", "4", "--embd",
                           "128", "--heads", "4", "--vocab", "320", "--bias", "1", "--dtype",
                           "fp32", "--sdpa", "1", "--B", "1", "--T", "32", "--steps", "3"]


@pytest.mark.parametrize("args, error", [
    (["--model", "gpt3"], "argument --model: unknown model 'gpt3': choose one of gpt2-tiny, "),
    (["--model", "llama-tiny", "--anchor", "."],
     "argument --anchor: torch_llama.py trains in bf16 only: leave --dtype bf16"),
    (["--anchor", "."], "argument --anchor: . has no torch_tp_gpt2.py"),
    (["--T", "1k"], "argument --T: '1k' is not a comma-separated list of positive"),
    (["--memory-limit", "0"], "argument --memory-limit: 0.0 GiB is not a positive size"),
])
def test_bad_input_is_one_error_before_any_work(args, error):
    done = bench(args)
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(errors) == 1 and error in errors[0], done.stderr
    assert "RESULT" not in done.stdout and "Traceback" not in done.stderr


@pytest.mark.skipif(not backend.on_gpu, reason="the pool (and its limit) serves GPU arrays")
def test_a_memory_limit_makes_the_longer_length_run_out_of_memory():
    done = bench(["--model", "tiny", "--T", "32,16384", "--memory-limit", "0.05"])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert len(lines) == 2 and RESULT.match(lines[0]) and " T=32 " in lines[0]
    assert " T=16384 OOM (out of device memory" in lines[1], lines[1]
