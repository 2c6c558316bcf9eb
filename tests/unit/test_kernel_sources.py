"""Every CUDA source compiles for Hopper (sm_90) with the toolkit's nvcc, front end and ptxas, where
one is installed: a machine with no GPU catches a kernel that would not build (inline PTX
included) before any GPU run does. The options are the launchers' (the block reductions' thread
count, each head dimension of flash attention)."""
import concurrent.futures
import os
import shutil
import subprocess
import tempfile

import pytest

from cupytp.launchers import BLOCK_THREADS, sources
from cupytp.launchers.flash_attention import HEAD_DIMS

NVCC = shutil.which("nvcc")
ARCH = "sm_90"

pytestmark = pytest.mark.skipif(NVCC is None, reason="no CUDA toolkit (nvcc) on this machine")


def builds():
    """(source file, its -D options) of every compilation the launchers make."""
    for path in sorted(sources().glob("*.cu")):
        if path.name == "flash_attention.cu":
            for d in HEAD_DIMS:
                yield path, (f"-DFLASH_HEAD_DIM={d}",)
        else:
            yield path, ()


def compile_one(path, defines, folder):
    out = os.path.join(folder, f"{path.stem}{''.join(defines)}.cubin")
    command = [NVCC, f"-arch={ARCH}", "-std=c++17", "-cubin", f"-I{path.parent}",
               f"-DCUPYTP_BLOCK_THREADS={BLOCK_THREADS}", *defines, "-o", out, str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return path.name, defines, result.returncode, result.stderr


def test_every_kernel_source_compiles_for_hopper():
    with tempfile.TemporaryDirectory() as folder, \
            concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda build: compile_one(*build, folder), builds()))
    assert len(results) == len(list(sources().glob("*.cu"))) + len(HEAD_DIMS) - 1
    failures = [f"{name} {' '.join(defines)}:\n{stderr[-3000:]}"
                for name, defines, code, stderr in results if code]
    assert not failures, "\n".join(failures)
