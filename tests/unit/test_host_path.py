"""The cheap host path of an op: interned placements, cached sharding rules, redistributions that
move nothing on one-rank mesh dimensions, autocast's per-region cast of parameters; and the
layering that keeps redistribute in one home (no import cycle between the packages)."""
import ast
import copy
import pickle
import weakref

import numpy
import pytest

import cupytp
from cupytp import backend, ops
from cupytp.autograd import engine
from cupytp.launchers import is_device_array
from cupytp.ops import amp
from cupytp.optim import SGD
from cupytp.tensor import Partial, Replicated, Shard
from launch import REPO


@pytest.fixture(scope="module", autouse=True)
def runtime():
    cupytp.init()


def dt(array, placements=None, grad=True):
    mesh = cupytp.DeviceMesh((1,), ("tp",))
    return cupytp.from_local(backend.asarray(numpy.asarray(array)), mesh, placements,
                             requires_grad=grad)


def test_placements_are_interned_values():
    assert Shard(1) is Shard(numpy.int64(1)) is Shard(dim=1)
    assert Partial() is Partial("sum") and Partial(op="max") is Partial("max")
    assert Replicated() is Replicated() and Shard(0) != Shard(1) and Shard(0) != Replicated()
    for p in (Shard(2), Replicated(), Partial("max")):
        assert pickle.loads(pickle.dumps(p)) is p and copy.deepcopy(p) is p
    assert repr(Shard(1)) == "Shard(dim=1)" and str(Partial("max")) == "P(max)"
    with pytest.raises(TypeError, match="integer tensor dimension"):
        Shard(1.5)
    with pytest.raises(ValueError, match="not one of"):
        Partial("avg")
    with pytest.raises(AttributeError):
        Shard(0).dim = 1


def test_a_failing_rule_fails_every_time():
    a = dt(numpy.ones((4, 4)), (Shard(0),))
    b = dt(numpy.ones((4, 4)), (Shard(1),))
    for _ in range(2):
        with pytest.raises(ops.ShardingError, match="different dimensions"):
            a + b


def test_one_rank_mesh_redistribution_moves_nothing():
    """Along a mesh dimension of one rank every change of placement keeps the data; the node is
    still recorded, and the gradient comes back laid out like the input."""
    x = dt(numpy.arange(12.0).reshape(3, 4), (Shard(1),))
    y = x.redistribute((Replicated(),))
    assert y.to_local() is x.to_local() and y.placements == (Replicated(),)
    assert y._node.name == "redistribute"
    (y * 2.0).sum().backward()
    assert x.grad.placements == (Shard(1),)
    numpy.testing.assert_array_equal(backend.asnumpy(x.grad.to_local()), numpy.full((3, 4), 2.0))


def test_one_rank_mesh_converts_any_layout():
    """An op that needs an input Replicated takes it as it is along a one-rank mesh dimension
    (a sharded LayerNorm weight here), where on more ranks it would ask for a gather; the
    gradient comes back laid out like the input."""
    rng = numpy.random.default_rng(1)
    x, w, b = rng.standard_normal((3, 8)), rng.standard_normal(8), rng.standard_normal(8)
    results = []
    for placements in ((Shard(0),), (Replicated(),)):
        weight = dt(w, placements)
        out = ops.layer_norm(dt(x, grad=False), weight, dt(b))
        (out * out).sum().backward()
        assert weight.grad.placements == placements
        results.append([backend.asnumpy(t.full_tensor()) for t in (out, weight.grad)])
    for sharded, replicated in zip(*results):
        numpy.testing.assert_array_equal(sharded, replicated)


def casts_of(root, leaf):
    """The astype nodes in `root`'s graph whose input is `leaf`."""
    found, stack, seen = [], [root._node], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, engine.Node) or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name == "astype" and node.inputs[0] is leaf:
            found.append(node)
        stack.extend(node.inputs)
    return found


def test_autocast_casts_a_parameter_once_per_region():
    """A weight used twice in contractions under autocast is cast once, without a cast node:
    both products record the fp32 weight itself and give its gradient in fp32, summed over both
    uses (small integers: every bf16 step is exact)."""
    rng = numpy.random.default_rng(0)
    x1, x2 = (rng.integers(-2, 3, size=(3, 4)).astype(numpy.float32) for _ in range(2))
    w = dt(rng.integers(-2, 3, size=(4, 5)).astype(numpy.float32))
    a, b = dt(x1, grad=False), dt(x2, grad=False)
    with ops.autocast("bf16"):
        y = a @ w + b @ w
        assert amp.master_cast(w) is amp.master_cast(w)
    assert y.dtype == backend.bfloat16 and casts_of(y, w) == []
    y.astype("fp32").sum().backward()
    assert w.grad.dtype == numpy.float32
    numpy.testing.assert_array_equal(backend.asnumpy(w.grad.to_local()),
                                     (x1 + x2).T @ numpy.ones((3, 5), numpy.float32))


def test_autocast_cache_lives_one_region_and_one_optimizer_step():
    w = dt(numpy.ones((4, 4), numpy.float32))
    x = dt(numpy.ones((4, 4), numpy.float32), grad=False)
    with ops.autocast("bf16"):
        first, first_master = amp.autocast_operand(w), amp.master_cast(w)
        assert amp.autocast_operand(w) is first and amp.master_cast(w) is first_master
        assert amp.autocast_operand(x) is not amp.autocast_operand(x)     # not a parameter
        assert amp.master_cast(x) is None
        (x @ w).astype("fp32").sum().backward()
        SGD([w], lr=0.5).step()                                          # new values
        second, second_master = amp.autocast_operand(w), amp.master_cast(w)
        assert second is not first and second_master is not first_master
        for cast in (second, second_master):
            numpy.testing.assert_array_equal(
                backend.asnumpy(cast.to_local()).astype(numpy.float32), backend.asnumpy(w.to_local()))
        (second * 2.0).astype("fp32").sum().backward()                   # frees second's node
        assert amp.autocast_operand(w) is not second
    with ops.autocast("bf16"):
        assert amp.autocast_operand(w) is not second
        assert amp.master_cast(w) is not second_master


def test_a_parameters_cast_keeps_its_memory_between_regions():
    """The bf16 cast of an fp32 parameter is the same array in the next region, rewritten from
    the parameter's new values; a cast that an unfinished graph still reads is not rewritten
    (that graph's gradient uses the values it saw); clear_cache frees the kept casts."""
    w = dt(numpy.full((4, 4), 1.5, numpy.float32))
    x = dt(numpy.ones((2, 4), numpy.float32))
    with ops.autocast("bf16"):
        (x @ w).astype("fp32").sum().backward()
        first = weakref.ref(amp.master_cast(w))     # holding it would keep it from reuse
    SGD([w], lr=0.5).step()                                     # w = 1.5 - 0.5 * 2 = 0.5
    with ops.autocast("bf16"):
        assert amp.master_cast(w) is first()
        cast = amp.master_cast(w).to_local()
        numpy.testing.assert_array_equal(backend.asnumpy(cast).astype(numpy.float32),
                                         backend.asnumpy(w.to_local()))
        del cast
        y = x @ w                                     # its backward reads w's cast later
    w.to_local()[...] = 7.0                           # in place, as an optimizer does
    with ops.autocast("bf16"):
        assert float(amp.master_cast(w).to_local()[0, 0]) == 7.0
    x.grad = None
    y.astype("fp32").sum().backward()
    numpy.testing.assert_array_equal(backend.asnumpy(x.grad.to_local()), 4 * 0.5)   # old w
    v = dt(numpy.ones((4, 4), numpy.float32))
    with ops.autocast("bf16"):
        amp.master_cast(v)
    kept = len(amp._state.kept)
    del v
    assert len(amp._state.kept) == kept - 1           # a parameter's cast goes with it
    amp.clear_cache()
    assert not amp._state.kept


def package_imports():
    """{package: {packages it imports}} over every import in cupytp (function-level ones too),
    with the place of one import for each edge."""
    edges = {}
    for path in sorted((REPO / "cupytp").rglob("*.py")):
        parts = path.relative_to(REPO / "cupytp").with_suffix("").parts
        if parts == ("__init__",):
            continue
        source = parts[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] if node.module != "cupytp" else \
                    [f"cupytp.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "cupytp" and len(parts) > 1:
                    target = parts[1]
                    if target != source:
                        edges.setdefault(source, {}).setdefault(
                            target, f"{path.relative_to(REPO)}:{node.lineno}")
    return edges


def test_packages_import_without_cycles():
    """The packages form layers: no chain of imports leads from a package back to itself (the
    tensor layer, in particular, never reaches up to the ops)."""
    edges = package_imports()
    assert "ops" not in edges.get("tensor", {})
    assert "parallel" not in edges.get("nn", {}), edges["nn"]["parallel"]
    done, path = set(), []

    def visit(package):
        if package in path:
            cycle = path[path.index(package):] + [package]
            where = [edges[a][b] for a, b in zip(cycle, cycle[1:])]
            raise AssertionError(f"import cycle {' -> '.join(cycle)} ({', '.join(where)})")
        if package in done:
            return
        path.append(package)
        for target in edges.get(package, {}):
            visit(target)
        path.pop()
        done.add(package)

    for package in sorted(edges):
        visit(package)


@pytest.mark.parametrize("keep", ["1", "0"])
def test_casts_kept_between_regions_stay_within_their_budget(monkeypatch, keep):
    """Every parameter's cast is kept between regions by default; with CUPYTP_KEEP_CASTS=0,
    past KEEP_BYTES a parameter's cast is made anew in each region."""
    amp.clear_cache()
    monkeypatch.setenv("CUPYTP_KEEP_CASTS", keep)
    monkeypatch.setattr(amp, "KEEP_BYTES", 3 * 16 * 2)           # three (4, 4) bf16 casts
    params = [dt(numpy.full((4, 4), i, numpy.float32)) for i in range(5)]
    with ops.autocast("bf16"):
        for p in params:
            amp.master_cast(p)
        if keep == "1":
            assert len(amp._state.kept) == 5 and amp._state.kept.nbytes == 160
            amp.clear_cache()
            return
        assert len(amp._state.kept) == 3 and amp._state.kept.nbytes == 96
        params[0]._local = params[0]._local.copy()              # its cast is made again
        amp.master_cast(params[0])
    assert len(amp._state.kept) == 3 and amp._state.kept.nbytes == 96
    assert amp._state.kept[(id(params[0]), backend.bfloat16)][1] is params[0].to_local()
    amp.clear_cache()
    assert amp._state.kept.nbytes == 0


def test_adamw_writes_the_kept_casts_in_its_update(monkeypatch):
    """AdamW rounds each kept cast from its parameter's new value in its update pass: the next
    region takes the casts as they are (the refresh casts none of them), and training equals
    training whose casts the refresh makes. A cast that an unfinished graph still reads is not
    written (that graph's gradient uses the values it saw)."""
    from cupytp.optim import AdamW
    refreshed = []
    cast_ = amp.cast_
    monkeypatch.setattr(amp, "cast_", lambda s, t: (refreshed.append(len(s)), cast_(s, t)))

    def train(writes):
        monkeypatch.setattr(AdamW, "writes_casts", writes)
        amp.clear_cache()
        refreshed.clear()
        rng = numpy.random.default_rng(1)
        w = dt(rng.standard_normal((4, 8)).astype(numpy.float32))
        x = dt(rng.standard_normal((3, 4)).astype(numpy.float32), grad=False)
        optimizer, losses = AdamW([w], lr=0.1), []
        for _ in range(4):
            with ops.autocast("bf16"):
                y = (x @ w).astype("fp32")
                loss = (y * y).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(backend.asnumpy(loss.to_local())))
            cast = backend.asnumpy(amp._state.kept[(id(w), backend.bfloat16)][2].to_local())
            values = backend.asnumpy(w.full_tensor())  # read, not handed out as a parameter
            current = (cast == values.astype(backend.bfloat16)).all()
            del cast                            # a holder of the cast would keep it unwritten
            assert current == writes            # written by the step, or left to the refresh
        return losses, backend.asnumpy(w.full_tensor()), list(refreshed)

    fused, written, casts_fused = train(True)
    plain, refreshed_w, casts_plain = train(False)
    assert fused == plain
    numpy.testing.assert_array_equal(written, refreshed_w)
    assert casts_fused == [0, 0, 0, 0] and casts_plain == [0, 1, 1, 1]

    monkeypatch.setattr(AdamW, "writes_casts", True)
    w = dt(numpy.full((4, 4), 1.5, numpy.float32))
    x = dt(numpy.ones((2, 4), numpy.float32))
    optimizer = AdamW([w], lr=0.5, weight_decay=0.0)
    with ops.autocast("bf16"):
        (x @ w).astype("fp32").sum().backward()
    optimizer.step()                                   # writes the cast: w = 1.5 - 0.5 = 1.0
    with ops.autocast("bf16"):
        y = x @ w                                      # its backward reads w's cast later
    optimizer.step()                                   # w = 0.5; the cast y reads is kept
    x.grad = None
    y.astype("fp32").sum().backward()
    numpy.testing.assert_array_equal(backend.asnumpy(x.grad.to_local()), 4 * 1.0)
    with ops.autocast("bf16"):
        assert float(amp.master_cast(w).to_local()[0, 0]) == 0.5
    amp.clear_cache()


def test_adamw_writes_the_casts_of_a_captured_step_of_several_regions(monkeypatch):
    """A captured step of two autocast regions (micro-batches) takes the casts AdamW wrote in the
    step before without a cast pass, so AdamW must write them again inside the capture: the
    graph keeps each cast alive once however many regions read it."""
    from cupytp import graph
    from cupytp.optim import AdamW
    amp.clear_cache()
    w = dt(numpy.full((4, 4), 1.5, numpy.float32))
    x = dt(numpy.ones((2, 4), numpy.float32), grad=False)
    optimizer = AdamW([w], lr=0.5, weight_decay=0.0)

    def step():
        for _ in range(2):
            with ops.autocast("bf16"):
                (x @ w).astype("fp32").sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    step()
    step()                                   # eager: the cast is kept and written
    assert amp._state.written
    capture = graph._Capture()
    monkeypatch.setattr(graph._state, "capture", capture, raising=False)
    step()                                   # as a capture records it
    assert amp._state.written, "the captured step left the casts its forward skipped unwritten"
    capture.end()
    record = next(record for state, record in capture.states if state is amp._TAKEN)
    assert record["pairs"] == ([], [])      # nothing to cast before a replay
    # a captured optimizer that does not write a cast the forward took: cast before each replay
    capture = graph._Capture()
    monkeypatch.setattr(graph._state, "capture", capture)
    monkeypatch.setattr(amp, "kept_cast", lambda p: None)
    step()
    monkeypatch.setattr(graph._state, "capture", None)
    capture.end()
    capture.before_replay()
    cast = amp._state.kept[(id(w), backend.bfloat16)][2].to_local()
    numpy.testing.assert_array_equal(backend.asnumpy(cast).astype(numpy.float32),
                                     backend.asnumpy(w.full_tensor()).astype(backend.bfloat16)
                                     .astype(numpy.float32))
    amp.clear_cache()


def test_a_parameter_written_in_place_after_adamw_is_cast_again():
    """A parameter handed out by to_local() after AdamW wrote its cast may have been written in
    place: the next region casts it again from its values."""
    from cupytp.optim import AdamW
    amp.clear_cache()
    w = dt(numpy.full((4, 4), 1.5, numpy.float32))
    x = dt(numpy.ones((2, 4), numpy.float32), grad=False)
    optimizer = AdamW([w], lr=0.5, weight_decay=0.0)
    with ops.autocast("bf16"):
        (x @ w).astype("fp32").sum().backward()
    optimizer.step()
    assert amp._state.written
    w.to_local()[...] = 7.0
    with ops.autocast("bf16"):
        assert float(amp.master_cast(w).to_local()[0, 0]) == 7.0
    amp.clear_cache()


@pytest.mark.parametrize("mesh_shape", [(1,), (1, 1)])
def test_a_fresh_gradient_is_handed_over_where_its_layout_differs_only_on_one_rank_dims(
        mesh_shape):
    """A leaf's first gradient contribution, a whole view of a buffer nothing else holds (a
    product's reshaped result), becomes `.grad` without a copy, also where it is Partial along
    a one-rank data-parallel dimension on which the leaf is Replicated (no data moves)."""
    names = ("dp", "tp")[-len(mesh_shape):]
    mesh = cupytp.DeviceMesh(mesh_shape, names)
    leaf_placements = (Replicated(), Shard(0))[-len(mesh_shape):]
    grad_placements = (Partial(), Shard(0))[-len(mesh_shape):]
    w = cupytp.from_local(backend.asarray(numpy.ones((4, 6))), mesh, leaf_placements,
                          requires_grad=True)
    made = []

    def address(a):
        return a.data.ptr if is_device_array(a) else a.__array_interface__["data"][0]

    def contribution():
        local = backend.xp.arange(24.0).reshape(4, 6)
        made.append(address(local))
        return cupytp.from_local(local, mesh, grad_placements, run_check=False)
    w.accumulate_grad(contribution())
    grad = w.grad._local
    assert address(grad) == made[0]
    assert w.grad.placements == leaf_placements
    numpy.testing.assert_array_equal(backend.asnumpy(grad), numpy.arange(24.0).reshape(4, 6))
