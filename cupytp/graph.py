"""CUDA-graph capture of a whole training step: `cuda_graph(fn)` records every kernel and NCCL
collective that `fn` launches on its first captured call and replays them afterwards, so a step
costs one graph launch of host time.

A replay runs no Python, so whatever changes from step to step must live in device memory. Host
objects that own such state (the RNG's counter offset, an optimizer's learning rate and step
count) take part through `GraphState`: the first time one is used while a capture runs it joins
the capture (`capture_begin`: remember the host state), when the capture ends it puts its host
state back as it was (`capture_end`: the capture computed nothing), and before every replay it
advances its host state as one eager call would and writes what the graph reads into device
memory (`before_replay`). Each hook gets a dict private to that capture and that object, so one
object may take part in several graphs. Everything else the step reads (parameters, gradients, optimizer
moments) already lives in device memory at fixed addresses.

Allocations made while capturing come from a pool private to the graph, so its addresses stay
valid while the graph lives. A host synchronization inside the captured function, or a call with
other input shapes, is an error that says where, never a silent wrong graph. On the NumPy backend
the function simply runs eagerly.
"""
import functools
import threading
import traceback
from pathlib import Path

from cupytp import backend

_state = threading.local()
_PACKAGE = str(Path(__file__).resolve().parent)


class GraphCaptureError(RuntimeError):
    """The function cannot be captured as it is, or a replay was called with other inputs."""


class GraphState:
    """Host state that a captured step reads from device memory; see the module docstring.
    `record` is a dict kept by the capture for this object."""

    def capture_begin(self, record):
        raise NotImplementedError

    def capture_end(self, record):
        raise NotImplementedError

    def before_replay(self, record):
        raise NotImplementedError


class _Capture:
    """What one capture collects: the states it touched, each with its record, and the process
    groups it used."""

    def __init__(self):
        self.states = []
        self.groups = []
        self.kept = {}          # id -> object kept alive (once, however often it is asked)
        self.memo = {}

    def end(self):
        for state, record in self.states:
            state.capture_end(record)

    def before_replay(self):
        for state, record in self.states:
            state.before_replay(record)


def is_capturing():
    """True while this thread records a graph."""
    return getattr(_state, "capture", None) is not None


def join(state):
    """Make `state` (a GraphState) part of the capture in progress, once, and return its record
    (None outside a capture)."""
    capture = getattr(_state, "capture", None)
    if capture is None:
        return None
    for joined, record in capture.states:
        if joined is state:
            return record
    record = {}
    state.capture_begin(record)
    capture.states.append((state, record))
    return record


def note_group(group):
    """Record that the capture in progress launched a collective on `group` (for the watchdog)."""
    capture = getattr(_state, "capture", None)
    if capture is not None and group not in capture.groups:
        capture.groups.append(group)


def keep_alive(obj):
    """Keep `obj` (device memory made before the capture that the graph reads, such as a cached
    pointer table) alive as long as the graph being captured; no-op outside a capture."""
    capture = getattr(_state, "capture", None)
    if capture is not None:
        capture.kept[id(obj)] = obj


def kept_by_capture(obj):
    """True when the graph being captured keeps `obj` alive (`keep_alive`)."""
    capture = getattr(_state, "capture", None)
    return capture is not None and capture.kept.get(id(obj)) is obj


def capture_memo():
    """A dict that lives as long as the capture in progress (None outside one): for what is
    made while capturing and valid only in its replays, such as a table the graph copies to the
    device itself."""
    capture = getattr(_state, "capture", None)
    return None if capture is None else capture.memo


def forbid_in_capture(what, advice):
    """Raise GraphCaptureError if a capture is in progress: `what` cannot be recorded."""
    if is_capturing():
        raise GraphCaptureError(f"{what} inside a captured step: {advice}")


def _signature(value):
    """What must stay the same between calls for a replay to be valid."""
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _signature(v)) for k, v in sorted(value.items())))
    local = getattr(value, "_local", None)
    if local is not None:      # a DTensor
        return ("DTensor", value.shape, str(value.dtype), value.placements, value.mesh)
    if isinstance(value, backend.xp.ndarray):
        return ("array", value.shape, str(value.dtype))
    return ("value", value)


def _where(error):
    """Where the failing call came from: the innermost frame of the caller's own code (outside
    cupytp and CuPy), and the innermost cupytp frame under it: 'file:line in function (...)'."""
    frames = traceback.extract_tb(error.__traceback__)

    def ours(f):
        return f.filename.startswith(_PACKAGE)

    def cupy(f):
        return "cupy" in Path(f.filename).parts or "cupy_backends" in Path(f.filename).parts
    caller = [f for f in frames if not ours(f) and not cupy(f)]
    inner = [f for f in frames if ours(f) and not f.filename.endswith("graph.py")]
    text = [f"{f.filename}:{f.lineno} in {f.name} ({(f.line or '').strip()})"
            for f in (caller[-1:] + inner[-1:])]
    return " via ".join(text) or "an unknown place"


class CudaGraph:
    """`fn` captured into one CUDA graph: see `cuda_graph`."""

    def __init__(self, fn, warmup=1):
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.warmup = warmup
        self.calls = 0
        self.graph = None
        self.capture = None
        self.signature = None
        self.static_args = None
        self.static_out = None
        self.pool = None
        self._stream = None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if not backend.on_gpu:
            return self.fn(*args, **kwargs)
        if self.calls <= self.warmup:
            return self._warm_up(args, kwargs)
        signature = _signature((args, kwargs))
        if self.graph is None:
            self._capture(args, kwargs, signature)
        elif signature != self.signature:
            raise GraphCaptureError(
                f"{self.fn.__name__} was captured for inputs {self.signature}, this call gives "
                f"{signature}: a graph replays fixed shapes; make another cuda_graph for these")
        self._copy_inputs(self.static_args, (args, kwargs))
        self.replay()
        return self.static_out

    def replay(self):
        """Launch the graph once on the current stream (after `before_replay` of its states)."""
        self.capture.before_replay()
        stream = backend.xp.cuda.get_current_stream()
        self.graph.launch(stream)
        for group in self.capture.groups:
            group.track_replay(stream, f"CUDA graph replay of {self.fn.__name__}")

    def _copy_inputs(self, static, given):
        """Copy every array of `given` into the matching static buffer (device to device)."""
        if isinstance(static, (tuple, list)):
            for s, g in zip(static, given):
                self._copy_inputs(s, g)
        elif isinstance(static, dict):
            for key in static:
                self._copy_inputs(static[key], given[key])
        elif getattr(static, "_local", None) is not None:
            if static is not given:
                static._local[...] = given._local
        elif isinstance(static, backend.xp.ndarray) and static is not given:
            static[...] = given

    def _static_copy(self, value):
        if isinstance(value, (tuple, list)):
            return type(value)(self._static_copy(v) for v in value)
        if isinstance(value, dict):
            return {k: self._static_copy(v) for k, v in value.items()}
        if getattr(value, "_local", None) is not None:
            copy = value.detach()
            copy._local = backend.xp.empty_like(value._local)
            copy.requires_grad = value.requires_grad
            return copy
        if isinstance(value, backend.xp.ndarray):
            return backend.xp.empty_like(value)
        return value

    def _side(self):
        """Enter the side stream (made with the graph's private pool at the first call; it first
        waits for the caller's stream) and return the caller's stream. Warm-up and capture both
        run there, so the capture reuses the blocks the warm-up freed instead of holding a
        second step's worth of memory beside the default pool."""
        from cupytp import memory
        xp = backend.xp
        if self._stream is None:
            self._stream = xp.cuda.Stream(non_blocking=True)
            self.pool = memory.new_private_pool()
        caller = xp.cuda.get_current_stream()
        self._stream.wait_event(caller.record())
        return caller

    def _warm_up(self, args, kwargs):
        from cupytp import memory
        caller = self._side()
        with self._stream, memory.use_pool(self.pool):
            out = self.fn(*args, **kwargs)
        caller.wait_event(self._stream.record())
        return out

    def _capture(self, args, kwargs, signature):
        from cupytp import memory
        xp = backend.xp
        memory.empty_cache()    # what an earlier eager step left cached in the default pool
        caller = self._side()
        capture = _Capture()
        with self._stream, memory.use_pool(self.pool):
            static_args, static_kwargs = self._static_copy((args, kwargs))
            self._stream.synchronize()
            _state.capture = capture
            self._stream.begin_capture()
            try:
                out = self.fn(*static_args, **static_kwargs)
            except BaseException as error:
                self._abandon(capture)
                if isinstance(error, xp.cuda.runtime.CUDARuntimeError) or (
                        isinstance(error, RuntimeError) and "captur" in str(error)):
                    raise GraphCaptureError(
                        f"{self.fn.__name__} cannot be captured: a host synchronization or a "
                        f"host-to-device copy at {_where(error)} ({error}); keep values on the "
                        "device inside the step (read the loss after the step), or run it "
                        "without cuda_graph") from None
                raise
            graph = self._stream.end_capture()
            _state.capture = None
            capture.end()
        caller.wait_event(self._stream.record())
        graph.upload(caller)
        self.graph, self.capture, self.signature = graph, capture, signature
        self.static_args, self.static_out = (static_args, static_kwargs), out

    def _abandon(self, capture):
        _state.capture = None
        try:
            self._stream.end_capture()
        except Exception:  # noqa: BLE001 - an invalidated capture fails here too; report the first
            pass
        capture.end()


def cuda_graph(fn=None, *, warmup=1):
    """Capture `fn` (a training step) into one CUDA graph and replay it on later calls.

    The first `warmup` calls run eagerly (they create gradients, optimizer states, cuBLAS handles
    and compiled kernels at their lasting addresses), on the graph's side stream and from its
    private memory pool, whose freed blocks the capture then reuses; the next call captures `fn` on the inputs'
    static copies and replays it; every later call copies its inputs (arrays or DTensors of the
    same shapes, dtypes and layouts) into the static buffers and replays. The return value is the
    captured call's output, overwritten in place by each replay: read or copy it before the next
    call. Inside `fn`: no host synchronization (`.item()`, `float()`, NumPy conversion), no
    learning-rate schedule step (call it outside), no Python control flow on device values.
    On the NumPy backend `fn` runs eagerly every time.

        step = cupytp.cuda_graph(train_step)
        for batch in loader:
            loss = step(*batch)
            scheduler.step()
    """
    if fn is None:
        return functools.partial(cuda_graph, warmup=warmup)
    return CudaGraph(fn, warmup)
