"""The CUDA sources of kernels/ compiled without a GPU: CUDA 13's NVRTC from the
nvidia-cuda-nvrtc wheel (headers from nvidia-cuda-runtime and nvidia-cuda-cccl, all under
nvidia/cu13), called through ctypes with the include paths and defines the launchers give CuPy,
for a chosen architecture. Reports each kernel's registers and spilled bytes as this NVRTC's
ptxas prints them (another CUDA release may allocate registers a little differently).

    python tests/unit/kernel_compiler.py [--arch sm_90a] [-D FLASH_HOPPER=1 ...] [sources ...]
"""
import argparse
import ctypes
import functools
import importlib.util
import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores")
_REGISTERS = re.compile(r"Used (\d+) registers")


class CompileError(RuntimeError):
    """NVRTC refused a source; the message is its log."""


@functools.cache
def _cuda():
    """The wheels' nvidia/cu13 folder, or None."""
    try:
        spec = importlib.util.find_spec("nvidia.cu13")
    except ModuleNotFoundError:
        return None
    for folder in map(Path, spec.submodule_search_locations if spec else ()):
        if (folder / "lib" / "libnvrtc.so.13").is_file() and \
                (folder / "include" / "cuda_bf16.h").is_file() and \
                (folder / "include" / "cccl" / "cub").is_dir():
            return folder
    return None


def available():
    """Whether the NVRTC and header wheels are installed (Linux)."""
    return _cuda() is not None


@functools.cache
def _nvrtc():
    return ctypes.CDLL(str(_cuda() / "lib" / "libnvrtc.so.13"))


def _checked(status, what):
    if status != 0:
        raise CompileError(f"{what} failed with NVRTC status {status}")


def compile_source(source, arch, defines=()):
    """{kernel: (registers, spilled bytes)} of kernels/`source` built for `arch` (sm_80, sm_90,
    sm_90a, ...) with the launchers' options and `defines` ("NAME=value" strings)."""
    from cupytp.launchers import BLOCK_THREADS
    nvrtc = _nvrtc()
    options = [f"-arch={arch}", f"-I{KERNELS}", f"-I{_cuda() / 'include'}",
               f"-I{_cuda() / 'include' / 'cccl'}",
               f"-DCUPYTP_BLOCK_THREADS={BLOCK_THREADS}", "--ptxas-options=-v"]
    options += [f"-D{define}" for define in defines]
    program = ctypes.c_void_p()
    _checked(nvrtc.nvrtcCreateProgram(ctypes.byref(program), (KERNELS / source).read_bytes(),
                                      source.encode(), 0, None, None), "nvrtcCreateProgram")
    try:
        status = nvrtc.nvrtcCompileProgram(
            program, len(options), (ctypes.c_char_p * len(options))(*map(str.encode, options)))
        size = ctypes.c_size_t()
        _checked(nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size)), "reading the log")
        log = ctypes.create_string_buffer(size.value)
        _checked(nvrtc.nvrtcGetProgramLog(program, log), "reading the log")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    text = log.value.decode(errors="replace")
    if status != 0:
        raise CompileError(f"{source} for {arch} with {list(defines)}:\n{text}")
    kernels, name = {}, None
    for line in text.splitlines():
        if match := _ENTRY.search(line):
            name = match.group(1)
            kernels[name] = [0, 0]
        elif name and (match := _SPILL.search(line)):
            kernels[name][1] = int(match.group(1))
        elif name and (match := _REGISTERS.search(line)):
            kernels[name][0] = int(match.group(1))
    return {kernel: tuple(numbers) for kernel, numbers in kernels.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", help="files of kernels/ (default: all)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("-D", dest="defines", action="append", default=[])
    args = parser.parse_args()
    for source in args.sources or sorted(p.name for p in KERNELS.glob("*.cu")):
        for kernel, (registers, spilled) in compile_source(source, args.arch,
                                                           args.defines).items():
            print(f"{source} {kernel}: {registers} registers, {spilled} bytes spilled")


if __name__ == "__main__":
    main()
