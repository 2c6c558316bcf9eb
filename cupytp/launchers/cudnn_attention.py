"""cuDNN's fused attention (the cuDNN frontend's SDPA graphs) on CuPy arrays, with the contract of
`flash_attention` (same arguments, o laid out (B, T, H, D), lse (B, H, T) float32) but no dropout
(cuDNN draws its own mask, which would differ from the framework's), T == S under a causal mask
(both align it top-left then; T != S without one: a ring's blocks of another rank), and of grouped
query heads only the plain grouping (query head h reads key/value head h // (H / Hk)), where the
frontend builds such graphs (checked once).

`CUPYTP_ATTENTION` chooses: `flash` (the RawKernel always), `cudnn` (cuDNN wherever it applies;
an error if the frontend, the `nvidia-cudnn-frontend` wheel, cannot be imported), `auto` (the
default: cuDNN where it applies and imports and the attention has at least CUDNN_MIN_SCORES
scores, B·H·T·S, where its kernels measured faster; the RawKernel otherwise, whose planned
launches cost the host a fraction of cuDNN's execute, the larger cost of a small attention) or
`matmul` (`ops.scaled_dot_product_attention` materializes the scores: for comparisons). One graph
per shape, strides, dtype, mask and scale, built on first use: outside a CUDA-graph capture,
whose eager warm-up call builds it. The NumPy twin of this math is flash_attention's.

A built graph runs through its backend plan on an array of raw addresses sorted by tensor uid:
what the frontend's own `execute` does in the end, reached without the per-call Python that
describes each operand again (three times the host cost of the call at small shapes). A frontend
without that entry point gets the public `execute`.
"""
import ctypes
import functools
import threading

from cupytp import env
from cupytp.backend import bfloat16, xp
from cupytp.launchers import is_device_array, lasting_buffer
from cupytp.launchers.flash_attention import DTYPES, HEAD_DIMS, check_grads, check_lse
from cupytp.launchers.flash_attention import like_output, output_strides

CUDNN_MIN_SCORES = 2 ** 20      # `auto`: smaller attention runs the RawKernel (docs/benchmarks.md)


def choice():
    """The value of CUPYTP_ATTENTION (auto when unset)."""
    return env.get("CUPYTP_ATTENTION")


def applies(q, k, dropout_p, groups=None, causal=True):
    """True when cuDNN runs this attention (see the module docstring); `groups`: the
    HeadGroups the query heads read k and v by (None: as many heads as q's); `causal`: whether
    a causal mask applies (then only T == S)."""
    wanted = choice()
    if wanted in ("flash", "matmul") or dropout_p > 0 or not is_device_array(q):
        return False
    if (causal and q.shape[2] != k.shape[2]) or not _plain(q, k, groups):
        return False
    if q.dtype not in DTYPES or q.shape[-1] not in HEAD_DIMS or not (q.size and k.size):
        return False
    if wanted == "auto" and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] < CUDNN_MIN_SCORES:
        return False
    if _frontend(wanted == "cudnn") is None:
        return False
    return q.shape[1] == k.shape[1] or _builds_grouped_graphs()


def _plain(q, k, groups):
    """True when query head h reads key/value head h // (H / Hk) (the grouping cuDNN knows)."""
    hq, hk = q.shape[1], k.shape[1]
    return hk > 0 and hq % hk == 0 and (groups is None or (groups.offset == 0 and
                                                             groups.group * hk == hq))


@functools.cache
def _builds_grouped_graphs():
    """True when this cuDNN builds attention graphs whose k and v have fewer heads than q,
    forward and backward (tried once, on a small shape)."""
    b, hq, hk, t, d = 1, 4, 2, 128, 64
    q = ((b, hq, t, d), (t * hq * d * 2, d * 2, hq * d * 2, 2))
    kv = ((b, hk, t, d), (t * hk * d * 2, d * 2, hk * d * 2, 2))
    try:
        _forward_graph(bfloat16, (q, kv, kv, q), True, 0.125)
        _backward_graph(bfloat16, (q, kv, kv, q, q, q, kv, kv), True, 0.125)
    except Exception:       # the frontend's own error types: not supported here
        return False
    return True


def describe():
    """One line naming what runs attention here, for logs."""
    wanted = choice()
    if wanted in ("flash", "matmul"):
        return f"attention: {wanted} (CUPYTP_ATTENTION={wanted})"
    frontend = _frontend(wanted == "cudnn")
    if frontend is None:
        return f"attention: flash RawKernel (CUPYTP_ATTENTION={wanted}; no cuDNN frontend)"
    cudnn = frontend[0]
    return (f"attention: cuDNN frontend {cudnn.__version__} (backend {cudnn.backend_version()}) "
            f"without dropout, flash RawKernel otherwise (CUPYTP_ATTENTION={wanted})")


@functools.cache
def _frontend(required):
    """(cudnn module, handle), or None when the frontend cannot be used and is not required."""
    try:
        import cudnn
        return cudnn, cudnn.create_handle()
    except (ImportError, OSError, RuntimeError) as err:
        if required:
            raise RuntimeError(f"CUPYTP_ATTENTION=cudnn, but the cuDNN frontend cannot be used "
                               f"({err}): install nvidia-cudnn-frontend or use "
                               "CUPYTP_ATTENTION=flash") from err
        return None


def attention_forward(q, k, v, causal, scale, dropout=None, groups=None):
    _check_supported(dropout, q, k, groups)
    b, h, t, d = q.shape
    o = like_output(q)
    stats = xp.empty((b, h, t, 1), dtype=xp.float32)
    _forward_graph(*_geometry(q, k, v, o), causal, float(scale)).run((q, k, v, o, stats))
    return o, stats.reshape(b, h, t)


def attention_backward(q, k, v, o, lse, do, causal, scale, dropout=None, grads=None,
                       groups=None):
    _check_supported(dropout, q, k, groups)
    b, h, t, d = q.shape
    dq, dk, dv = check_grads(grads, q, k, v)
    o, do = _laid_out(o), _laid_out(do)     # one layout for both, as the graph wants
    check_lse(lse, q)
    stats = xp.ascontiguousarray(lse).reshape(b, h, t, 1)
    _backward_graph(*_geometry(q, k, v, o, do, dq, dk, dv), causal, float(scale)).run(
        (q, k, v, o, do, stats, dq, dk, dv))
    return dq, dk, dv


def _check_supported(dropout, q, k, groups):
    if dropout is not None:
        raise ValueError("cuDNN attention runs without dropout here (its mask would not be the "
                         "framework's): use flash_attention for dropout")
    if not _plain(q, k, groups):
        raise ValueError(f"cuDNN attention groups query heads only plainly (h reads key/value "
                         f"head h // (H / Hk)), not {groups} over q {q.shape} and k {k.shape}: "
                         "use flash_attention")


def _laid_out(a):
    """`a` in like_output's layout (itself when it already is)."""
    if a.strides == output_strides(a):
        return a
    out = like_output(a)
    out[...] = a
    return out


def _geometry(*arrays):
    """(dtype, ((shape, byte strides), ...)): the hashable key of a graph."""
    return arrays[0].dtype, tuple([(a.shape, a.strides) for a in arrays])


def _in_elements(dtype, layouts):
    """The layouts of a `_geometry` key with strides in elements, as cuDNN takes them."""
    size = dtype.itemsize
    return tuple((shape, tuple(s // size for s in strides)) for shape, strides in layouts)


class _Runner:
    """A built graph and how to call it: `run(arrays)`, the arrays in the order of `uids`, on
    the current stream, with a workspace of `workspace_size` bytes per stream that lives as long
    as the graph (a CUDA graph that captured it may replay it)."""

    def __init__(self, graph, uids, workspace_size):
        self.graph, self.uids, self.workspace_size = graph, uids, workspace_size
        self.workspaces = {}            # stream pointer -> (workspace array, its address)
        self.raw = self._raw_entry()

    def _raw_entry(self):
        """(the backend's raw-address execute, plan index, the positions in `uids` of the
        sorted uids, a ctypes array for their addresses), or None where this frontend does not
        have it."""
        graph = self.graph
        try:
            order = list(graph._variant_pack_uids())
            plan = graph._materialize_backend_plan(graph._plan_index)
            execute = graph._lowered_graph._execute_with_raw_ptrs
            python_engine = graph.selected_engine is not None
        except AttributeError:
            return None
        if python_engine or sorted(order) != sorted(self.uids):
            return None
        index = -1 if plan.cpp_index is None else plan.cpp_index
        positions = tuple(self.uids.index(uid) for uid in order)
        return execute, index, tuple(enumerate(positions)), (ctypes.c_uint64 * len(order))()

    def run(self, arrays):
        cudnn, handle = _frontend(False)
        stream = xp.cuda.get_current_stream().ptr
        workspace = self.workspaces.get(stream)
        if workspace is None:
            array = lasting_buffer(self.workspace_size)
            workspace = self.workspaces[stream] = (array, array.data.ptr)
        with _lock:     # one stream on the handle at a time; the addresses are read in the call
            if _handle_stream[0] != stream:
                cudnn.set_stream(handle=handle, stream=stream)
                _handle_stream[0] = stream
            if self.raw is None:
                self.graph.execute(tuple([a.data.ptr for a in arrays]), workspace[1],
                                   handle=handle, tensor_uids=self.uids)
                return
            execute, index, positions, addresses = self.raw
            for slot, position in positions:
                addresses[slot] = arrays[position].data.ptr
            execute(ctypes.addressof(addresses), len(positions), workspace[1],
                    _backend_handle(), index)


_handle_stream = [None]         # the stream last set on the frontend's handle
_lock = threading.Lock()


@functools.cache
def _backend_handle():
    return _frontend(False)[1].backend_handle


def _new_graph(dtype):
    cudnn, handle = _frontend(False)
    io = cudnn.data_type.BFLOAT16 if dtype == bfloat16 else cudnn.data_type.HALF
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)

    def tensor(name, layout, data_type=io):
        shape, strides = layout
        return graph.tensor(name=name, dim=list(shape), stride=list(strides), data_type=data_type)
    return cudnn, graph, tensor, io


def _mask(cudnn, causal):
    return dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                diagonal_band_right_bound=0 if causal else None)


def _finish(cudnn, graph, outputs):
    for tensor, (shape, strides), data_type in outputs:
        tensor.set_output(True).set_dim(list(shape)).set_stride(list(strides))
        tensor.set_data_type(data_type)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph.get_workspace_size()


def _stats_layout(q_layout):
    (b, h, t, _), _ = q_layout
    return (b, h, t, 1), (h * t, t, 1, 1)


@functools.cache
def _forward_graph(dtype, layouts, causal, scale):
    layouts = _in_elements(dtype, layouts)
    cudnn, graph, tensor, io = _new_graph(dtype)
    q, k, v = (tensor(name, layout) for name, layout in zip("qkv", layouts))
    o, stats = graph.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=scale,
                          **_mask(cudnn, causal))
    workspace = _finish(cudnn, graph, [(o, layouts[3], io),
                                       (stats, _stats_layout(layouts[0]), cudnn.data_type.FLOAT)])
    return _Runner(graph, _uids(q, k, v, o, stats), workspace)


@functools.cache
def _backward_graph(dtype, layouts, causal, scale):
    layouts = _in_elements(dtype, layouts)
    cudnn, graph, tensor, io = _new_graph(dtype)
    q, k, v, o, do = (tensor(name, layout)
                      for name, layout in zip(("q", "k", "v", "o", "do"), layouts))
    stats = tensor("stats", _stats_layout(layouts[0]), cudnn.data_type.FLOAT)
    dq, dk, dv = graph.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do,
                                     stats=stats, attn_scale=scale, **_mask(cudnn, causal))
    workspace = _finish(cudnn, graph, [(grad, layout, io)
                                       for grad, layout in zip((dq, dk, dv), layouts[5:])])
    return _Runner(graph, _uids(q, k, v, o, do, stats, dq, dk, dv), workspace)


def _uids(*tensors):
    return tuple(tensor.get_uid() for tensor in tensors)
