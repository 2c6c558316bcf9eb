"""CommTracer: this rank's collectives, counted per module and per phase, with bytes and time.

    with cupytp.debug.CommTracer() as tracer:
        _, loss = model(x, y)
        loss.backward()
    print(tracer.table())

It observes the public collectives of every ProcessGroup of more than one rank. The module is
the path of the modules being called (`DMLP.c_proj`), learned from `nn.Module.__call__`; in the
backward pass it is the path that was being called when the op whose gradient runs was
recorded. The phase comes from the autograd engine: "forward" inside a module call, "backward"
inside `backward()`, "other" elsewhere (clipping, a loss outside the model). Bytes are this
rank's input to the collective. Time is measured with CUDA events on the current stream on GPU
(read when the table is made; none inside a CUDA-graph capture) and perf_counter on CPU; for
`async_op=True` it runs to `Work.wait()`.
"""
import json
import time
from dataclasses import asdict, dataclass

from cupytp import backend, graph
from cupytp.autograd import engine
from cupytp.distributed import process_group, runtime
from cupytp.nn import module
from cupytp.train_log import format_bytes


@dataclass
class Row:
    phase: str
    module: str
    op: str
    group: str
    calls: int
    bytes: int
    time_ms: float


class CommTracer:
    """A context manager; `rows()`, `table()` and `to_json()` report what it saw."""

    def __init__(self):
        self.events = []        # (phase, module, op, group, nbytes, start, end)
        self._labels = {}
        self._tracking = None
        self._source = None

    def __enter__(self):
        self._tracking = module.track_calls()
        self._tracking.__enter__()
        self._source = engine.set_scope_source(module.calling)
        process_group.add_observer(self)
        return self

    def __exit__(self, *exc):
        process_group.remove_observer(self)
        engine.set_scope_source(self._source)
        self._tracking.__exit__(*exc)
        return False

    # ---- observer ---------------------------------------------------------------------------
    def before(self, call):
        if engine.in_backward():
            phase, scope = "backward", engine.backward_scope()
        else:
            scope = module.calling()
            phase = "forward" if scope else "other"
        call.state[self] = (phase, self._label(scope), _clock())

    def after(self, call):
        phase, label, start = call.state.pop(self)
        self.events.append((phase, label, call.op, call.group.name, call.nbytes, start,
                            _clock()))

    def _label(self, scope):
        """`DMLP.c_proj`: the outermost module's class, then the attribute path."""
        if not scope:
            return "-"
        key = tuple(id(m) for m in scope)
        if key not in self._labels:
            names = [type(scope[0]).__name__]
            for parent, child in zip(scope, scope[1:]):
                names.append(next((name for name, m in parent.named_children() if m is child),
                                  type(child).__name__))
            self._labels[key] = ".".join(names)
        return self._labels[key]

    # ---- reports ----------------------------------------------------------------------------
    def rows(self):
        """One Row per (phase, module, op, group), in the order first seen."""
        rows = {}
        for phase, label, op, group, nbytes, start, end in self.events:
            row = rows.setdefault((phase, label, op, group),
                                  Row(phase, label, op, group, 0, 0, 0.0))
            row.calls += 1
            row.bytes += nbytes
            row.time_ms += _elapsed_ms(start, end)
        return list(rows.values())

    def table(self):
        """The rows as aligned text, with a total line."""
        rows = self.rows()
        header = ("phase", "module", "op", "group", "calls", "bytes", "time (ms)")
        lines = [header] + [(r.phase, r.module, r.op, r.group, str(r.calls),
                             format_bytes(r.bytes), f"{r.time_ms:.3f}") for r in rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        right = {4, 5, 6}
        text = ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                          for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
                for line in lines]
        total = (sum(r.calls for r in rows), sum(r.bytes for r in rows),
                 sum(r.time_ms for r in rows))
        title = (f"collectives on rank {_rank()}: {total[0]} calls, {format_bytes(total[1])}, "
                 f"{total[2]:.3f} ms")
        return "\n".join([title] + text)

    def to_json(self):
        """{"rank", "rows": [{phase, module, op, group, calls, bytes, time_ms}, ...]} as text."""
        return json.dumps({"rank": _rank(), "rows": [asdict(r) for r in self.rows()]})


def _clock():
    if not backend.on_gpu:
        return time.perf_counter()
    if graph.is_capturing():
        return None
    event = backend.xp.cuda.Event()
    event.record()
    return event


def _elapsed_ms(start, end):
    if start is None or end is None:
        return 0.0
    if not backend.on_gpu:
        return 1e3 * (end - start)
    end.synchronize()
    return backend.xp.cuda.get_elapsed_time(start, end)


def _rank():
    return runtime.get_rank() if runtime.is_initialized() else 0
