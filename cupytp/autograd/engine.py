"""A tape of recorded ops and the reverse walk over it.

Each op that runs while gradients are enabled, on an input that requires them, records a Node on
its output: the inputs and a `backward(grad) -> grads per input` closure. `backward(root)` orders
the nodes reachable from `root` (iteratively, no recursion), walks them in reverse, and hands
every gradient to its input: summed into the pending gradient of a non-leaf, given to a leaf's
`accumulate_grad(grad, complete)`, where `complete` says that it is the leaf's last gradient
of the walk (a parameter used by several ops, tied weights, gets several; a data-parallel
engine reduces a gradient once it is complete). Broadcast dimensions are summed away here,
once, for every op. A node holds its inputs' nodes, not the input tensors, so the tape keeps
only what backward closures saved.
The walked nodes are freed, so a second backward through the same graph is an error.

The engine is generic over the tensor type; what it needs from a tensor is `requires_grad`,
`_node`, `shape`, `accumulate_grad(grad or None, complete)`, and from a gradient
`sum_to_shape(shape)` and `+`.

For observers (cupytp.debug.CommTracer): `in_backward()` says whether a backward pass is
running, and while a scope source is set (`set_scope_source`), each node keeps what it returned
when the op ran (the modules being called), which `backward_scope()` gives back while that
node's gradients are computed.

A node's backward may `queue_callback(fn)`: `fn()` runs when the pass ends, before `backward()`
returns (data parallelism finishes its gradient reductions there).
"""
import threading
from contextlib import contextmanager


class _State(threading.local):
    enabled = True          # gradient mode
    node = None             # the node whose gradients backward() is computing


_state = _State()


def is_grad_enabled():
    return _state.enabled


@contextmanager
def _grad_mode(enabled):
    previous = is_grad_enabled()
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def no_grad():
    """Context manager: ops inside record nothing."""
    return _grad_mode(False)


def enable_grad():
    return _grad_mode(True)


class Node:
    """One recorded op: `inputs` (per input of the op: the input's own Node when it was computed
    by a recorded op, the tensor itself when it is a leaf, None where no gradient is needed),
    `backward`, the output's `shape`, and the `scope` it ran in (None unless a scope source is
    set). The tape keeps nodes, not the values of intermediate tensors: an activation that no
    backward closure saved is freed as soon as the forward pass drops it."""
    __slots__ = ("inputs", "backward", "name", "shape", "scope", "sums_first", "__weakref__")

    def __init__(self, inputs, backward, name, shape, scope=None, sums_first=False):
        self.inputs = inputs
        self.backward = backward
        self.name = name
        self.shape = shape
        self.scope = scope
        self.sums_first = sums_first


def is_walked(tensor):
    """True when `tensor` was computed by a recorded op that a backward pass has already walked
    (its saved values freed): it cannot be differentiated through again."""
    node = tensor._node
    return node is not None and node.backward is None


_scope_source = None


def set_scope_source(source):
    """Keep `source()` on every node recorded from now on (None: stop); returns the previous."""
    global _scope_source
    previous, _scope_source = _scope_source, source
    return previous


def in_backward():
    """True while backward() runs on this thread."""
    return _state.node is not None


def backward_scope():
    """The scope of the node whose gradients backward() is computing (None if none)."""
    node = _state.node
    return None if node is None else node.scope


def records(inputs):
    """True when `record` would attach a node for these inputs (gradients on and some input
    requires one): what only the backward reads need not be computed or kept otherwise."""
    return _state.enabled and any(t is not None and t.requires_grad for t in inputs)


def record(output, inputs, backward, name, sums_first=False):
    """Attach a Node to `output` when gradients are on and some input requires one.

    `sums_first=True`: `backward(grad, pending)` also gets the gradient of the first input that
    other ops have already given (None if none yet, or if that input is a leaf) and returns the
    first input's gradient with it summed in (one pass instead of a separate addition: a
    LayerNorm on the residual stream)."""
    if not _state.enabled:
        return output
    needed = tuple([None if t is None or not t.requires_grad else
                    (t if t._node is None else t._node) for t in inputs])
    if needed.count(None) < len(needed):
        output.requires_grad = True
        output._node = Node(needed, backward, name, output.shape,
                            None if _scope_source is None else _scope_source(), sums_first)
    return output


def _topological_order(root):
    """(The nodes reachable from node `root`, each after every node computed from it (iterative
    DFS); {id(leaf): how many of their inputs are that leaf})."""
    order, visited, uses = [], set(), {}
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        if node.backward is None:
            raise RuntimeError("backward through a graph that an earlier backward already freed:"
                               " run the forward pass again")
        visited.add(id(node))
        stack.append((node, True))
        for parent in node.inputs:
            if type(parent) is Node:
                if id(parent) not in visited:
                    stack.append((parent, False))
            elif parent is not None:
                uses[id(parent)] = uses.get(id(parent), 0) + 1
    return order[::-1], uses


def queue_callback(callback):
    """Run `callback()` once the backward pass in progress has handed out its last gradient
    (before backward() returns). Called from a node's backward."""
    if not in_backward():
        raise RuntimeError("queue_callback outside a backward pass")
    _state.callbacks.append(callback)


def backward(root, grad):
    """Propagate `grad` (d loss / d root) to every leaf that requires a gradient."""
    if not root.requires_grad:
        raise RuntimeError("backward() on a tensor that does not require a gradient: no input "
                           "of the ops that made it has requires_grad=True")
    if root._node is None:
        root.accumulate_grad(grad, True)
        return
    pending = {id(root._node): grad}
    _state.callbacks = []
    with no_grad():
        try:
            _walk(root._node, pending)
        finally:
            _state.node = None
        while _state.callbacks:
            _state.callbacks.pop(0)()


def backward_within(root, grad):
    """backward() from inside a node's backward (a recomputed piece of the graph): the same walk
    from `root`, leaving the pass in progress (its callbacks, its current node) as it was."""
    if root._node is None:
        if root.requires_grad:
            root.accumulate_grad(grad, True)
        return
    outer = _state.node
    try:
        _walk(root._node, {id(root._node): grad})
    finally:
        _state.node = outer


def _walk(root, pending):
    """The reverse walk: each node's gradients handed to its inputs (`_state.node` is the node
    being worked on). A walked node drops its closure and inputs, freeing what it saved. A leaf
    hears from every node that uses it, with its gradient (None where that node gives none),
    `complete` with the last."""
    order, uses = _topological_order(root)
    for node in order:
        out_grad = pending.pop(id(node), None)
        backward, inputs = node.backward, node.inputs
        node.backward, node.inputs = None, ()
        if out_grad is None:
            for parent in inputs:
                if parent is not None and type(parent) is not Node:
                    left = uses[id(parent)] = uses[id(parent)] - 1
                    if not left:
                        parent.accumulate_grad(None, True)
            continue
        _state.node = node
        if node.sums_first:
            first = inputs[0]
            given = pending.pop(id(first), None) if type(first) is Node else None
            grads = list(backward(out_grad, given))
        else:
            grads = list(backward(out_grad))
        if len(grads) != len(inputs):
            raise RuntimeError(f"backward of {node.name} returned {len(grads)} gradients "
                               f"for {len(inputs)} inputs")
        for i, parent in enumerate(inputs):
            g, grads[i] = grads[i], None    # only `g` holds it: a leaf may keep it uncopied
            if parent is None:
                continue
            if g is not None and g.shape != parent.shape:
                g = g.sum_to_shape(parent.shape)
            if type(parent) is not Node:        # inline: `g` held here only (see above)
                left = uses[id(parent)] = uses[id(parent)] - 1
                if g is not None or not left:
                    parent.accumulate_grad(g, not left)
            elif g is None:
                continue
            elif id(parent) in pending:
                pending[id(parent)] = pending[id(parent)] + g
            else:
                pending[id(parent)] = g

