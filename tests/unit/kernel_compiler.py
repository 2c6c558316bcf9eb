"""The CUDA sources of kernels/ compiled without a GPU: CUDA 13's NVRTC from the
nvidia-cuda-nvrtc wheel (headers from nvidia-cuda-runtime and nvidia-cuda-cccl, all under
nvidia/cu13), called through ctypes with the include paths and defines the launchers give CuPy,
for a chosen architecture. Reports each kernel's registers and spilled bytes as this NVRTC's
ptxas prints them (another CUDA release may allocate registers a little differently). With
`--sass REGEX` (and the nvidia-cuda-nvdisasm wheel) it also prints, for each kernel whose name
matches, how many machine instructions of each kind it holds (the code as built, not as run), or
with `--listing` the whole disassembly: what ptxas made of a change, before any device time.

    python tests/unit/kernel_compiler.py [--arch sm_90a] [-D FLASH_HOPPER=1 ...] [sources ...]
    python tests/unit/kernel_compiler.py --arch sm_90a -D FLASH_HOPPER=1 -D FLASH_HEAD_DIM=64 \
        --sass 'backward_d64_dropout_bf16' [--listing] flash_attention.cu
"""
import argparse
import collections
import ctypes
import functools
import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SECTION = re.compile(r"^\.text\.(\w+):")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)


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


def disassembler():
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, or None."""
    if not available():
        return None
    path = _cuda() / "bin" / "nvdisasm"
    return path if path.is_file() else None


@functools.cache
def _nvrtc():
    return ctypes.CDLL(str(_cuda() / "lib" / "libnvrtc.so.13"))


def _checked(status, what):
    if status != 0:
        raise CompileError(f"{what} failed with NVRTC status {status}")


def compile_source(source, arch, defines=()):
    """{kernel: (registers, spilled bytes)} of kernels/`source` built for `arch` (sm_80, sm_90,
    sm_90a, ...) with the launchers' options and `defines` ("NAME=value" strings)."""
    text, _ = _build(source, arch, defines)
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


def performance_losses(source, arch, defines=()):
    """ptxas's "Potential Performance Loss" notes on kernels/`source` built as compile_source
    builds it (such as warpgroup products serialized, and why), one line each."""
    text, _ = _build(source, arch, defines)
    return [line.strip() for line in text.splitlines() if "Potential Performance Loss" in line]


def disassemble(source, arch, defines=()):
    """{kernel: its machine code as nvdisasm lists it} of kernels/`source` built as
    compile_source builds it (needs `disassembler()`)."""
    _, cubin = _build(source, arch, defines)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        listing = subprocess.run([str(disassembler()), "-c", file.name], check=True,
                                 capture_output=True, text=True).stdout
    kernels, name = {}, None
    for line in listing.splitlines():
        if match := _SECTION.match(line):
            name = match.group(1)
            kernels[name] = []
        elif name:
            kernels[name].append(line)
    return {kernel: "\n".join(lines) for kernel, lines in kernels.items()}


def instruction_counts(listing):
    """How many instructions of each kind (the opcode before its first dot) a listing holds."""
    return collections.Counter(match.group(1) for match in _INSTRUCTION.finditer(listing))


def loops(listing):
    """The bodies of a listing's loops, innermost and outermost alike: from each branch that
    jumps back, the listing's text from its target label to it."""
    lines = listing.splitlines()
    labels = {match.group(1): i for i, line in enumerate(lines)
              if (match := _LABEL.match(line))}
    bodies = []
    for i, line in enumerate(lines):
        if (match := _BRANCH.search(line)) and labels.get(match.group(1), i) < i:
            bodies.append("\n".join(lines[labels[match.group(1)]:i + 1]))
    return bodies


def _build(source, arch, defines):
    """(NVRTC's log, the cubin) of kernels/`source`, built once per process for each source,
    architecture and defines (the registers, the notes and the disassembly read one build)."""
    return _built(source, arch, tuple(defines))


@functools.cache
def _built(source, arch, defines):
    from cupytp.launchers import _source_options
    nvrtc = _nvrtc()
    options = [f"-arch={arch}", *_source_options(KERNELS), f"-I{_cuda() / 'include'}",
               f"-I{_cuda() / 'include' / 'cccl'}", "--ptxas-options=-v"]
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
        cubin = None
        if status == 0:
            _checked(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "reading the cubin")
            cubin = ctypes.create_string_buffer(size.value)
            _checked(nvrtc.nvrtcGetCUBIN(program, cubin), "reading the cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    text = log.value.decode(errors="replace")
    if status != 0:
        raise CompileError(f"{source} for {arch} with {list(defines)}:\n{text}")
    return text, cubin.raw


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", help="files of kernels/ (default: all)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("-D", dest="defines", action="append", default=[])
    parser.add_argument("--sass", metavar="REGEX",
                        help="the instruction counts of the kernels whose names match")
    parser.add_argument("--listing", action="store_true",
                        help="with --sass: their whole disassembly instead")
    args = parser.parse_args()
    if args.sass is not None and disassembler() is None:
        parser.error("--sass needs nvdisasm: pip install nvidia-cuda-nvdisasm (the dev extra)")
    for source in args.sources or sorted(p.name for p in KERNELS.glob("*.cu")):
        for kernel, (registers, spilled) in compile_source(source, args.arch,
                                                           args.defines).items():
            print(f"{source} {kernel}: {registers} registers, {spilled} bytes spilled")
        for line in performance_losses(source, args.arch, args.defines):
            print(f"{source} {line}")
        if args.sass is None:
            continue
        for kernel, listing in disassemble(source, args.arch, args.defines).items():
            if re.search(args.sass, kernel):
                counts = instruction_counts(listing)
                print(f"{source} {kernel}: {sum(counts.values())} instructions\n" +
                      (listing if args.listing else
                       " ".join(f"{name} {n}" for name, n in counts.most_common())))


if __name__ == "__main__":
    main()
