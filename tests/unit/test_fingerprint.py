"""CUPYTP_DEBUG=1: a skipped or mismatched collective is an error naming every rank's call,
raised on every rank within seconds (the timeout is far away)."""
import time

import pytest

from cupytp import backend

from launch import mpiexec, under_mpiexec

pytestmark = pytest.mark.skipif(under_mpiexec(), reason="launches its own mpiexec jobs")
SCRIPT = "tests/scripts/mismatched_collective.py"


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("mode,rank1_call", [
    ("skip", "all_reduce(op=sum) of (4,) float32 at " + SCRIPT + ":21"),
    ("shape", "all_reduce(op=sum) of (5,) float32 at " + SCRIPT + ":20"),
])
def test_mismatch_is_named_error_within_seconds(ranks, mode, rank1_call):
    if backend.on_gpu and backend.xp.cuda.runtime.getDeviceCount() < ranks:
        pytest.skip(f"{ranks} ranks need {ranks} GPUs")
    start = time.monotonic()
    result = mpiexec(ranks, [SCRIPT, mode], timeout=120,
                     env={"CUPYTP_DEBUG": "1", "CUPYTP_TIMEOUT": "300"})
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert output.count("raised CollectiveMismatchError") == ranks, output
    others = "global ranks 0, 2, 3 call" if ranks == 4 else "global rank 0 calls"
    assert f"{others} all_reduce(op=sum) of (4,) float32 at {SCRIPT}:18" in output, output
    assert f"global rank 1 calls {rank1_call}" in output, output
    assert "finished without an error" not in output
    assert elapsed < 30, f"took {elapsed:.0f} s"


def test_without_debug_no_check():
    """The check is off by default: ranks that agree run with no exchange at all."""
    result = mpiexec(2, ["-c", "import cupytp.distributed.process_group as pg, cupytp; "
                               "cupytp.init(); print(f'observers {len(pg._observers)}')"],
                     timeout=60)
    assert result.stdout.count("observers 0") == 2, result.stdout + result.stderr
