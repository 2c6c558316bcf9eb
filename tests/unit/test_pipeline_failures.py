"""A pipeline that goes wrong ends with a named error on every rank within seconds of the
timeout, not a hang: a stage that raises (its rank names the stage, the action and the
micro-batch, and the job ends), a rank that skips a send (the receive's timeout names both
ranks), a receive of another shape than the send under CUPYTP_DEBUG=1 (the first rank to
raise ends the job, so the others may not print theirs)."""
import re
import time

import pytest

from cupytp import backend
from launch import mpiexec, under_mpiexec

pytestmark = pytest.mark.skipif(under_mpiexec(), reason="launches its own mpiexec jobs")
SCRIPT = "tests/scripts/pipeline_failure.py"


def failed_job(mode, **env):
    if backend.on_gpu and backend.xp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    start = time.monotonic()
    result = mpiexec(2, [SCRIPT, mode], timeout=120, env={"CUPYTP_TIMEOUT": "2", **env})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "finished without an error" not in output, output
    assert time.monotonic() - start < 60, "the job should end soon after the timeout"
    return output


def test_a_stage_that_raises_is_named():
    """The raising rank ends the job itself: the other's timeout is long enough (20 s) that it
    does not end it first on a loaded machine, before the stage has run."""
    output = failed_job("raise", CUPYTP_TIMEOUT="20")
    assert "PipelineError: stage 1 (pp rank 1) failed in the forward of micro-batch 1: " \
           "RuntimeError: a layer blew up" in output, output


def test_a_skipped_send_is_a_timeout_naming_the_ranks():
    """Rank 1 waits for the activation that never comes, rank 0 for the gradient that then
    never comes: whichever times out first names its receive and ends the job."""
    output = failed_job("skip")
    assert re.search(r"CollectiveTimeoutError: (send to global rank \d; )?recv from global rank "
                     r"\d on group 'pp' \(global ranks \[0, 1\], this is rank \d\) did not "
                     r"complete within 2 s", output), output


def test_a_mismatched_transfer_is_named_under_debug():
    output = failed_job("shape", CUPYTP_DEBUG="1", CUPYTP_TIMEOUT="60")
    assert "CollectiveMismatchError: point-to-point mismatch on group 'pp'" in output
    assert "global rank 0 sends (2, 3) float64" in output
    assert "which global rank 1 receives as (2, 4) float64" in output
