"""A plain `python -m pytest` also runs the distributed suite on 2 and 4 ranks under mpiexec
(the 1-rank run is the in-process collection of tests/mpi itself)."""
import pytest

from launch import mpiexec, under_mpiexec


@pytest.mark.skipif(under_mpiexec(), reason="already running under mpiexec")
@pytest.mark.parametrize("ranks", [2, 4])
def test_distributed_suite(ranks):
    result = mpiexec(ranks, ["-m", "pytest", "tests/mpi", "-q", "--tb=short", "-x"],
                     timeout=1800, env={"CUPYTP_TIMEOUT": "120"})
    assert result.returncode == 0, (f"mpiexec -n {ranks} pytest tests/mpi failed:\n"
                                    f"{result.stdout[-20000:]}\n{result.stderr[-5000:]}")
