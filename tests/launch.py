"""Run a command under mpiexec from a plain (single-process) pytest."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def under_mpiexec():
    """True inside a job started by mpiexec (any rank count)."""
    return any(var in os.environ for var in _MPI_SIZE_VARS)


def enough_devices(ranks):
    """True when a job of `ranks` ranks can run here: always on the CPU, one GPU per rank."""
    from cupytp import backend
    return not backend.on_gpu or backend.xp.cuda.runtime.getDeviceCount() >= ranks


def mpiexec(ranks, args, timeout, env=None):
    """Run `python args...` on `ranks` ranks; returns the CompletedProcess (output captured).
    Skips the calling test where the job would need more GPUs than this machine has."""
    if not enough_devices(ranks):
        pytest.skip(f"a {ranks}-rank job needs {ranks} GPUs")
    launcher = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) \
        or shutil.which("mpiexec")
    if launcher is None:
        raise RuntimeError("mpiexec not found: install an MPI runtime (pip install mpich)")
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout
    command = [launcher, "-n", str(ranks)]
    if "Open MPI" in version or "OpenRTE" in version:
        command.append("--oversubscribe")
    command += [sys.executable] + list(args)
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    try:
        return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else \
            (err.stdout or "")
        errors = (err.stderr or b"").decode() if isinstance(err.stderr, bytes) else \
            (err.stderr or "")
        raise AssertionError(f"{' '.join(command)} ran past {timeout} s; its output:\n"
                             f"{output[-5000:]}\n{errors[-5000:]}") from None
