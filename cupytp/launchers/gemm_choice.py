"""Which of cuBLASLt's algorithms a product runs. cuBLASLt's heuristic ranks up to CANDIDATES
algorithms for a product's shape; its first is often not the fastest (GPT-2 774M's captured
bf16 step on an H200: 92.6 ms with the heuristic's first algorithms, 90.7 with the fastest).
With CUPYTP_GEMM_TUNE=1 (the default) the first run outside a CUDA-graph capture of a product of
TUNED_FROM multiply-adds or more times each candidate on its own operands and keeps the fastest;
with 0, or for smaller products, it runs the heuristic's first, as a product run inside a
capture before any eager run does.

A choice is the candidate's place in the heuristic's list, which is the same for the same GPU,
cuBLASLt version and product. Choices are kept in a JSON file (CUPYTP_GEMM_CACHE, default
$XDG_CACHE_HOME/cupytp/gemm_algorithms.json) that every process reads and adds to, so that a
later run (a resumed one, another rank) runs the same algorithms as the first and computes the
same bits, and times nothing it has timed before. The file is rewritten whole through a
temporary file and a rename: a process stopped half-way leaves the previous file; a file that
cannot be read or written is reported once, and the choices then live in the process only.
Processes add to it one at a time (an exclusive lock on `<file>.lock` around each read, merge
and write), so the first choice written for a product is the one every later process reads
and runs: the ranks of a job that time a product at once run the first writer's algorithm from
the product's first run on, as a resumed job does.
"""
import fcntl
import json
import os
import time
import warnings
from contextlib import contextmanager

from cupytp import env

CANDIDATES = 8          # the heuristic's candidates asked for, and timed
TUNED_FROM = 2 ** 30    # multiply-adds from which a product is tuned: smaller ones are bound by
                        # their launch, and a decoder's growing shapes would each be timed
TIMED_RUNS = 5          # timed runs per candidate; its time is its fastest run's
LOCK_WAIT = 10.0        # seconds an addition waits for the file's lock before writing without it


def tuning():
    """CUPYTP_GEMM_TUNE: True (time the candidates, the default) or False (the first)."""
    return env.get("CUPYTP_GEMM_TUNE")


def cache_path():
    """The choices file: CUPYTP_GEMM_CACHE, or gemm_algorithms.json in the user's cache folder."""
    path = env.get("CUPYTP_GEMM_CACHE")
    if not path:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(home, "cupytp", "gemm_algorithms.json")
    return path


class Choices:
    """The file-backed choices: product key (a string naming the GPU, the cuBLASLt version and
    the product) -> the candidate's index in the heuristic's list."""

    def __init__(self, path):
        self.path, self._warned = path, False
        self.known = self._read()

    def _read(self):
        try:
            with open(self.path, encoding="utf-8") as file:
                known = json.load(file)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            self._warn(f"cannot read it ({err})")
            return {}
        if not isinstance(known, dict):
            self._warn("it does not hold a JSON object")
            return {}
        return {key: index for key, index in known.items()
                if isinstance(index, int) and 0 <= index < CANDIDATES}

    def get(self, key):
        return self.known.get(key)

    def lookup(self, key):
        """key's index as the file has it now (what other processes added is read in), else
        None."""
        self.known = {**self.known, **self._read()}
        return self.known.get(key)

    def add(self, key, index):
        """Keep `index` for `key` and write the file again with what other processes added to it
        meanwhile (theirs first: a key that two processes timed keeps one choice), holding the
        file's lock; the index kept for `key`."""
        self.known[key] = index
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with self._locked():
            merged = {**self.known, **self._read()}
            self.known = merged
            try:
                with open(temporary, "w", encoding="utf-8") as file:
                    json.dump(merged, file, indent=0, sort_keys=True)
                os.replace(temporary, self.path)
            except OSError as err:
                self._warn(f"cannot write it ({err})")
                try:
                    os.remove(temporary)
                except OSError:
                    pass
        return merged[key]

    @contextmanager
    def _locked(self):
        """Hold an exclusive lock on `<file>.lock` (made where missing, never removed; closing
        it releases the lock, also when a process is killed); where none can be had, on a
        file system without locks or after LOCK_WAIT seconds, the body runs without it."""
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            lock = os.open(f"{self.path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        except OSError:
            lock = None
        deadline = time.monotonic() + LOCK_WAIT
        try:
            while lock is not None:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.002)
                except OSError:
                    break
            yield
        finally:
            if lock is not None:
                os.close(lock)

    def _warn(self, what):
        if not self._warned:
            self._warned = True
            warnings.warn(f"cupytp: the GEMM algorithm choices file {self.path}: {what}; the "
                          f"choices of this process are not kept for the next (set "
                          f"CUPYTP_GEMM_CACHE to a writable file, or CUPYTP_GEMM_TUNE=0)",
                          RuntimeWarning, stacklevel=3)


_choices = {}           # path -> Choices


def choices():
    """The Choices of the current CUPYTP_GEMM_CACHE, read once per path."""
    path = cache_path()
    if path not in _choices:
        _choices[path] = Choices(path)
    return _choices[path]


def timings(run, count, timer):
    """Each of `count` candidates' time in seconds (inf where cuBLASLt refuses it): `run(i)`
    runs candidate i once (raising RuntimeError where refused), `timer(fn)` returns fn's device
    time. A candidate runs twice untimed, then is timed TIMED_RUNS times, its fastest run
    counting."""
    times = []
    for index in range(count):
        try:
            run(index)
            run(index)
        except RuntimeError:
            times.append(float("inf"))
            continue
        times.append(min(timer(lambda: run(index)) for _ in range(TIMED_RUNS)))
    return times


def fastest(run, count, timer):
    """The index of the fastest candidate by `timings`, None where every one was refused."""
    times = timings(run, count, timer)
    best = min(range(count), key=times.__getitem__, default=None)
    return None if best is None or times[best] == float("inf") else best


def timed_from_memory(tune):
    """tune(timer) with a timer that returns fn's device time on the current stream (two CUDA
    events) after writing twice the GPU's L2 cache over, so that each timed run reads its
    operands from memory, as a product of a step mostly does (GPT-2 774M on an H200: 88.8 ms a
    step with the choices so timed, 89.1 with choices timed on operands left in L2 by the runs
    before). Where that scratch cannot be had, runs are timed as they come."""
    from cupytp.backend import xp
    nbytes = 2 * xp.cuda.Device().attributes["L2CacheSize"]
    try:
        scratch = xp.cuda.memory.Memory(nbytes)      # outside the pool, freed on return
    except (xp.cuda.memory.OutOfMemoryError, xp.cuda.runtime.CUDARuntimeError):   # cudaMalloc's
        scratch = None

    def timer(fn):
        stream = xp.cuda.get_current_stream()
        if scratch is not None:
            xp.cuda.runtime.memsetAsync(scratch.ptr, 0, nbytes, stream.ptr)
        start, stop = xp.cuda.Event(), xp.cuda.Event()
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        return xp.cuda.get_elapsed_time(start, stop) / 1000
    return tune(timer)
