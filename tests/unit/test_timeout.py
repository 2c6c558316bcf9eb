"""A rank that skips a collective ends the job with an error naming the op, group and ranks."""
import time

import pytest

from launch import mpiexec, under_mpiexec


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
