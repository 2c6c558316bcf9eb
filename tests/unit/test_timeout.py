"""A rank that skips a collective, or a replay of a captured step, ends the job with an error
naming the op, group and ranks."""
import time

import pytest

from cupytp import backend
from launch import enough_devices, mpiexec, under_mpiexec


def hanging_job(script, *args):
    """The output of a 2-rank job of `script` (with `args`) with a 2 s timeout, checked to have
    failed soon after the timeout with the timeout's error."""
    start = time.monotonic()
    result = mpiexec(2, [script, *args], timeout=120, env={"CUPYTP_TIMEOUT": "2"})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "did not complete within 2 s" in output, output
    assert time.monotonic() - start < 60, "the job should end soon after the timeout"
    return output


@pytest.mark.skipif(under_mpiexec(), reason="launches its own mpiexec job")
def test_skipped_collective_ends_job_with_error():
    output = hanging_job("tests/scripts/skip_collective.py")
    assert "all_reduce on group 'world'" in output, output


@pytest.mark.skipif(under_mpiexec(), reason="launches its own mpiexec job")
@pytest.mark.parametrize("exchange,named", [
    ("all_gather_object", "all_gather_object on group 'world'"),
    ("broadcast_object", "broadcast_object over the world (2 ranks"),
    ("mesh", "creating process group")])
def test_skipped_host_exchange_ends_job_with_error(exchange, named):
    """Objects gathered or broadcast on the host, and the creation of a mesh's groups, run
    under the same timeout as the collectives."""
    output = hanging_job("tests/scripts/skip_host_exchange.py", exchange)
    assert named in output, output


@pytest.mark.skipif(under_mpiexec(), reason="launches its own mpiexec job")
@pytest.mark.skipif(not backend.on_gpu or not enough_devices(2),
                    reason="CUDA graphs are captured on GPUs only (two needed)")
def test_hung_graph_replay_ends_job_with_error():
    output = hanging_job("tests/scripts/hung_replay.py")
    assert "replayed 16" in output, output          # 4 calls adding 2 + 2 before the hang
    assert "CUDA graph replay of reduce_step on group 'world'" in output, output
    assert "passed the hung replay" not in output, output
