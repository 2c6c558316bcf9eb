"""A rank that skips a collective, or a replay of a captured step, ends the job with an error
naming the op, group and ranks."""
import time

import pytest

from cupytp import backend
from launch import enough_devices, mpiexec, under_mpiexec


@pytest.mark.skipif(under_mpiexec(), reason="launches its own mpiexec job")
def test_skipped_collective_ends_job_with_error():
    start = time.monotonic()
    result = mpiexec(2, ["tests/scripts/skip_collective.py"], timeout=120,
                     env={"CUPYTP_TIMEOUT": "2"})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "all_reduce on group 'world'" in output, output
    assert "did not complete within 2 s" in output, output
    assert time.monotonic() - start < 60, "the job should end soon after the timeout"


@pytest.mark.skipif(under_mpiexec(), reason="launches its own mpiexec job")
@pytest.mark.skipif(not backend.on_gpu or not enough_devices(2),
                    reason="CUDA graphs are captured on GPUs only (two needed)")
def test_hung_graph_replay_ends_job_with_error():
    start = time.monotonic()
    result = mpiexec(2, ["tests/scripts/hung_replay.py"], timeout=120,
                     env={"CUPYTP_TIMEOUT": "2"})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "replayed 16" in output, output          # 4 calls adding 2 + 2 before the hang
    assert "CUDA graph replay of reduce_step on group 'world'" in output, output
    assert "did not complete within 2 s" in output, output
    assert "passed the hung replay" not in output, output
    assert time.monotonic() - start < 60, "the job should end soon after the timeout"
