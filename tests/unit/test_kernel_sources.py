"""Every CUDA source compiles, on a machine with no GPU, for the targets the launchers build:
CUDA 13's NVRTC (what CuPy compiles with) from the nvidia-cuda-nvrtc wheel, through
`kernel_compiler`, with the launchers' options (the block reductions' thread count, each head
dimension of flash attention). Each file builds for Hopper (sm_90), and flash attention also for
sm_80 (mma.sync elsewhere) and sm_90a (Hopper's warpgroup products). A kernel that would not
build, inline PTX and ptxas included, is caught before any GPU run."""
import concurrent.futures
import os

import pytest

from cupytp.launchers import sources
from cupytp.launchers.flash_attention import HEAD_DIMS
from kernel_compiler import (CompileError, available, compile_source, disassemble,
                             disassembler, instruction_counts, loops, performance_losses)

pytestmark = pytest.mark.skipif(not available(), reason="needs CUDA 13's nvidia-cuda-nvrtc, "
                                "nvidia-cuda-runtime and nvidia-cuda-cccl wheels (Linux)")


def builds():
    """(source file, architecture, defines) of every compilation the launchers make."""
    for path in sorted(sources().glob("*.cu")):
        if path.name == "flash_attention.cu":
            for d in HEAD_DIMS:
                for arch, extra in (("sm_80", ()), ("sm_90", ()), ("sm_90a", ("FLASH_HOPPER=1",))):
                    yield path.name, arch, (f"FLASH_HEAD_DIM={d}",) + extra
        else:
            yield path.name, "sm_90", ()


def compile_one(source, arch, defines):
    try:
        return source, arch, defines, compile_source(source, arch, defines), ""
    except CompileError as error:
        return source, arch, defines, {}, str(error)[-3000:]


def test_every_kernel_source_compiles():
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda build: compile_one(*build), builds()))
    assert len(results) == len(list(sources().glob("*.cu"))) - 1 + 3 * len(HEAD_DIMS)
    failures = [error for *_, error in results if error]
    assert not failures, "\n".join(failures)
    empty = [source for source, _, _, kernels, _ in results if not kernels]
    assert not empty, f"no kernel compiled from {empty}"


@pytest.mark.skipif(disassembler() is None, reason="needs the nvidia-cuda-nvdisasm wheel")
def test_disassembly_shows_which_tensor_core_instruction_flash_attention_uses():
    """The sm_90a build (FLASH_HOPPER) multiplies with warpgroup products (HGMMA) only, the
    sm_90 build with mma.sync (HMMA) only, in every kernel of the forward and the backward. The
    warpgroup products run as the source groups them: where ptxas cannot prove an in-flight
    product's registers untouched it makes each product wait for itself (an arrive and a wait
    beside every HGMMA), which the counts show."""
    defines = ("FLASH_HEAD_DIM=64",)
    hopper = disassemble("flash_attention.cu", "sm_90a", defines + ("FLASH_HOPPER=1",))
    plain = disassemble("flash_attention.cu", "sm_90", defines)
    assert set(hopper) == set(plain) == set(compile_source("flash_attention.cu", "sm_90",
                                                           defines))
    products = [name for name in hopper if "_forward_" in name or "_backward_d64_" in name]
    assert len(products) == 12          # forward and backward, 3 dropout variants, 2 dtypes
    for name in products:
        hopper_counts = instruction_counts(hopper[name])
        plain_counts = instruction_counts(plain[name])
        assert hopper_counts["HGMMA"] > 0 and hopper_counts["HMMA"] == 0, name
        assert hopper_counts["WARPGROUP"] < hopper_counts["HGMMA"], name     # not serialized
        assert plain_counts["HMMA"] > 0 and plain_counts["HGMMA"] == 0, name


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_ptxas_keeps_flash_attention_warpgroup_products_in_flight(d):
    """ptxas notes nothing it had to give up in the sm_90a build of flash attention: a
    product's accumulators read by other instructions while it may be in flight, or its wait on
    a branch, make it serialize every warpgroup product of the kernel (notes C7514, C7518)."""
    notes = performance_losses("flash_attention.cu", "sm_90a",
                               (f"FLASH_HEAD_DIM={d}", "FLASH_HOPPER=1"))
    assert not notes, "\n".join(notes)


@pytest.mark.skipif(disassembler() is None, reason="needs the nvidia-cuda-nvdisasm wheel")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_90"])
def test_flash_attention_loads_its_tiles_without_loops_of_their_own(arch):
    """A thread's cp.async copies of a tile are straight-line code: the trip count is known when
    compiling, so no loop runs only to copy (with one, its address and bound arithmetic cost as
    many instructions as the softmax, and the forward ran at the issue rate)."""
    for d in HEAD_DIMS:
        defines = (f"FLASH_HEAD_DIM={d}",) + (("FLASH_HOPPER=1",) if arch == "sm_90a" else ())
        for name, listing in disassemble("flash_attention.cu", arch, defines).items():
            for body in loops(listing):
                counts = instruction_counts(body)
                if counts["LDGSTS"]:
                    assert counts["HGMMA"] + counts["HMMA"] > 0, (name, d)
