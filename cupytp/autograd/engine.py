"""A tape of recorded ops and the reverse walk over it.

Each op that runs while gradients are enabled, on an input that requires them, records a Node on
its output: the inputs and a `backward(grad) -> grads per input` closure. `backward(root)` orders
the nodes reachable from `root` (iteratively, no recursion), walks them in reverse, and hands
every gradient to its input: summed into the pending gradient of a non-leaf, given to a leaf's
`accumulate_grad(grad, complete)`, where `complete` says that it is the leaf's last gradient
of the walk (a parameter used by several ops, tied weights, gets several; a data-parallel
engine reduces a gradient once it is complete; a split backward's two walks each count their
own). Broadcast dimensions are summed away here, once, for every op. A node holds its inputs'
nodes, not the input tensors, so the tape keeps only what backward closures saved.
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

Split backward: `backward(root, grad, inputs=[x])` computes now only the gradients on the way
from root to the leaves `inputs` (a pipeline stage's input, whose gradient the previous stage
waits for) and returns a `DeferredBackward` whose `run()` computes every other gradient later
(the weights', which fill the pipeline's idle time). An op recorded with `splits=True` takes the
inputs whose gradients to compute, `backward(grad, needs)`, so a weight's product runs only in
the second part; any other op on the way computes all its gradients in the first.
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
    __slots__ = ("inputs", "backward", "name", "shape", "scope", "sums_first", "splits",
                 "__weakref__")

    def __init__(self, inputs, backward, name, shape, scope=None, sums_first=False,
                 splits=False):
        self.inputs = inputs
        self.backward = backward
        self.name = name
        self.shape = shape
        self.scope = scope
        self.sums_first = sums_first
        self.splits = splits


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


def record(output, inputs, backward, name, sums_first=False, splits=False):
    """Attach a Node to `output` when gradients are on and some input requires one.

    `sums_first=True`: `backward(grad, pending)` also gets the gradient of the first input that
    other ops have already given (None if none yet, or if that input is a leaf) and returns the
    first input's gradient with it summed in (one pass instead of a separate addition: a
    LayerNorm on the residual stream).
    `splits=True`: `backward(grad, needs)` may be called with `needs`, one bool per input, and
    then computes only the gradients of the inputs marked True (None for the others): a split
    backward asks for the input's gradient first and the weight's later."""
    if not _state.enabled:
        return output
    needed = tuple([None if t is None or not t.requires_grad else
                    (t if t._node is None else t._node) for t in inputs])
    if needed.count(None) < len(needed):
        output.requires_grad = True
        output._node = Node(needed, backward, name, output.shape,
                            None if _scope_source is None else _scope_source(), sums_first,
                            splits)
    return output


def _topological_order(roots, done=None):
    """The nodes reachable from the nodes `roots`, each after every node computed from it
    (iterative DFS). `done`: {id(node): per input, True where its gradient was computed
    already}: those inputs are not followed."""
    order, visited = [], set()
    stack = [(root, False) for root in reversed(roots)]
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
        skipped = () if done is None else done.get(id(node), ())
        for i, parent in enumerate(node.inputs):
            if type(parent) is Node and id(parent) not in visited and \
                    not (skipped and skipped[i]):
                stack.append((parent, False))
    return order[::-1]


def queue_callback(callback, once=False):
    """Run `callback()` once the backward pass in progress has handed out its last gradient
    (before backward() returns). Called from a node's backward. `once`: unless this pass has
    queued it already."""
    if not in_backward():
        raise RuntimeError("queue_callback outside a backward pass")
    if not (once and callback in _state.callbacks):
        _state.callbacks.append(callback)


def backward(root, grad, inputs=None):
    """Propagate `grad` (d loss / d root) to every leaf that requires a gradient.

    With `inputs` (leaves): only the gradients on the way from root to them are computed now,
    into their `.grad`; the returned DeferredBackward's `run()` computes the others later (see
    the module docstring)."""
    if not root.requires_grad:
        raise RuntimeError("backward() on a tensor that does not require a gradient: no input "
                           "of the ops that made it has requires_grad=True")
    if inputs is not None:
        return _backward_split(root, grad, inputs)
    if root._node is None:
        root.accumulate_grad(grad, True)
        return None
    _run_pass(_topological_order([root._node]), {id(root._node): grad})
    return None


def _run_pass(order, pending, needs=None, kept=None):
    """A whole backward pass over `order` (see _walk), then the callbacks its nodes queued."""
    _state.callbacks = []
    with no_grad():
        try:
            _walk(order, pending, needs, kept)
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
        _walk(_topological_order([root._node]), {id(root._node): grad})
    finally:
        _state.node = outer


def _walk(order, pending, needs=None, kept=None):
    """The reverse walk over `order`: each node's gradients handed to its inputs (`_state.node`
    is the node being worked on). A walked node drops its closure and inputs, freeing what it
    saved, unless it is in `kept` (its other gradients come later: the gradient it got is
    stored there). `needs`: {id(node): per input, compute its gradient now?} for nodes recorded
    with splits=True; other nodes compute them all."""
    uses = _leaf_uses(order, needs)
    for node in order:
        out_grad = pending.pop(id(node), None)
        backward, inputs = node.backward, node.inputs
        if kept is not None and id(node) in kept:
            kept[id(node)] = out_grad
        else:
            node.backward, node.inputs = None, ()
        mask = None if needs is None else needs.get(id(node))
        if out_grad is None:
            for i, parent in enumerate(inputs):
                if parent is not None and type(parent) is not Node and \
                        (mask is None or mask[i]):
                    left = uses[id(parent)] = uses[id(parent)] - 1
                    if not left:
                        parent.accumulate_grad(None, True)
            continue
        _state.node = node
        if node.sums_first:
            first = inputs[0]
            given = pending.pop(id(first), None) if type(first) is Node else None
            grads = list(backward(out_grad, given))
        elif mask is not None:
            grads = list(backward(out_grad, mask))
        else:
            grads = list(backward(out_grad))
        if len(grads) != len(inputs):
            raise RuntimeError(f"backward of {node.name} returned {len(grads)} gradients "
                               f"for {len(inputs)} inputs")
        for i, parent in enumerate(inputs):
            g, grads[i] = grads[i], None    # only `g` holds it: a leaf may keep it uncopied
            if parent is None or (mask is not None and not mask[i]):
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


def _leaf_uses(order, needs):
    """{id(leaf): how many gradients the walk over `order` hands it}: one per input of a node
    that is that leaf (with `needs`, where the node computes that input's gradient now)."""
    uses = {}
    for node in order:
        mask = None if needs is None else needs.get(id(node))
        for i, parent in enumerate(node.inputs):
            if parent is not None and type(parent) is not Node and (mask is None or mask[i]):
                uses[id(parent)] = uses.get(id(parent), 0) + 1
    return uses


# ---- split backward -----------------------------------------------------------------------------
class DeferredBackward:
    """The part of a split backward pass left for later: `run()` computes it (once), handing
    every remaining gradient to its leaf as backward() would."""

    def __init__(self, work=None):
        self._work, self._ran = work, False

    def run(self):
        if self._ran:
            raise RuntimeError("this deferred backward has run already")
        work, self._work, self._ran = self._work, None, True
        if work is not None:
            work()


def _backward_split(root, grad, inputs):
    """backward() in two parts: now what reaches `inputs`, the rest in a DeferredBackward."""
    targets = set()
    for tensor in inputs:
        if tensor._node is not None:
            raise ValueError("backward(inputs=...) takes leaf tensors (a stage's input made a "
                             "leaf with requires_grad=True), not tensors computed by ops")
        targets.add(id(tensor))
    if root._node is None:
        if id(root) in targets:
            root.accumulate_grad(grad)
            return DeferredBackward()
        return DeferredBackward(lambda: root.accumulate_grad(grad))
    order = _topological_order([root._node])
    reaching = _reaching(order, targets)
    needs, kept = {}, {}
    for node in order:
        if node.splits and id(node) in reaching:
            mask = tuple(_leads(p, reaching, targets) for p in node.inputs)
            if not all(m or p is None for p, m in zip(node.inputs, mask)):
                needs[id(node)], kept[id(node)] = mask, None
    pending = {id(root._node): grad}
    _run_pass([n for n in order if id(n) in reaching], pending, needs, kept)
    # later: the rest of each split node, and the nodes whose gradients were handed out now
    by_id = {id(n): n for n in order}
    later = {key: tuple(p is not None and not m for p, m in zip(by_id[key].inputs, mask))
             for key, mask in needs.items() if kept[key] is not None}
    pending.update((key, kept[key]) for key in later)
    order = _topological_order([by_id[key] for key in pending], needs)
    return DeferredBackward(lambda: _run_pass(order, pending, later))


def _leads(parent, reaching, targets):
    """True when the input `parent` of a node is a target leaf or a node reaching one."""
    return id(parent) in (reaching if type(parent) is Node else targets) \
        if parent is not None else False


def _reaching(order, targets):
    """The ids of the nodes of `order` from which a target leaf can be reached."""
    reaching = set()
    for node in reversed(order):                    # inputs before the nodes made from them
        if any(_leads(p, reaching, targets) for p in node.inputs):
            reaching.add(id(node))
    return reaching
