"""init(): required before anything distributed, idempotent, and the backend choice is checked."""
import os
import subprocess
import sys

from launch import REPO

BEFORE_INIT = """
import cupytp
from cupytp.distributed import NotInitializedError
for attempt in (lambda: cupytp.DeviceMesh((1,)), lambda: cupytp.randn((2, 2)),
                lambda: cupytp.distributed.get_rank()):
    try:
        attempt()
    except NotInitializedError as err:
        assert "cupytp.init() must be called" in str(err), err
    else:
        raise SystemExit("no error before init()")
info = cupytp.init()
assert cupytp.init() is info and info.world_size == 1 and info.rank == 0
print("ok", info.backend)
"""


def run(code, **env):
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO), **env))


def test_distributed_calls_before_init_are_clear_errors():
    result = run(BEFORE_INIT)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-2000:]


def test_bad_device_choice_is_one_clear_error():
    result = run("import cupytp", CUPYTP_DEVICE="tpu")
    assert result.returncode != 0
    assert "CUPYTP_DEVICE='tpu' is not understood" in result.stderr


def test_gpu_demanded_without_one_is_an_error_not_a_fallback():
    probe = run("import cupy; print(cupy.cuda.runtime.getDeviceCount())")
    if probe.returncode == 0 and probe.stdout.strip() not in ("", "0"):
        return                                  # this machine has a GPU: nothing to check here
    result = run("import cupytp", CUPYTP_DEVICE="gpu")
    assert result.returncode != 0
    assert "CUPYTP_DEVICE=gpu, but" in result.stderr


def test_bad_allocator_choice_is_one_clear_error():
    result = run("import cupytp; cupytp.init()", CUPYTP_ALLOCATOR="torch")
    assert result.returncode != 0
    assert "CUPYTP_ALLOCATOR='torch' is not understood" in result.stderr
