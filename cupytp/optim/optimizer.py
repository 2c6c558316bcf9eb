"""Optimizer: parameter groups, per-parameter state laid out like each parameter, and one fused
multi-tensor kernel call per (group, dtypes) in `step()`.

Parameters are DTensors; every rank updates only its own local arrays, in place (`p._local`), so
the model sees the new values and no update needs communication: a gradient is laid out like its
parameter (data parallelism reduced it; a Partial one is an error that names the fix), and each
state (momenta) is laid out like its parameter too, so a sharded parameter's state stays sharded.

Per-step scalars (learning rate, bias corrections) reach the kernels through device memory: each
step writes them into a small float64 vector per group (one launch), and inside a captured CUDA
graph the optimizer takes part as a `cupytp.graph.GraphState`, writing them before every replay
instead, so a replayed step uses the current "lr" of each group and advances its step count.
"""
import dataclasses

from cupytp import backend, graph
from cupytp.launchers.values import MAX_VALUES, write_values
from cupytp.nn.module import assign
from cupytp.ops import amp
from cupytp.tensor import DTensor
from cupytp.tensor.placement import describe
from cupytp.tensor.redistribute import grad_placements


def contiguous_grad(p):
    """This rank's part of `p.grad`, made C-contiguous in place (a copy only when it is not), so
    kernels may read and scale it; the gradient must be laid out like `p`."""
    grad = p.grad
    if grad.shape != p.shape or grad.placements != grad_placements(p.placements):
        partial = [p.mesh.dim_names[d] for d, q in enumerate(grad.placements) if q.is_partial()]
        if partial and grad.shape == p.shape:
            raise ValueError(
                f"the gradient of a parameter of shape {p.shape} {describe(p.placements)} is "
                f"Partial over mesh dimension(s) {partial} (each rank's sum, not reduced): "
                "synchronize gradients with cupytp.parallel.replicate(model, mesh) or "
                "fully_shard, or redistribute the gradient to Replicated")
        raise ValueError(f"gradient of shape {grad.shape} {describe(grad.placements)} is not laid "
                         f"out like its parameter {p.shape} {describe(p.placements)}")
    if not backend.c_contiguous(grad._local):
        grad._local = backend.xp.ascontiguousarray(grad._local)
    return grad._local


@dataclasses.dataclass
class Bucket:
    """Parallel lists of local arrays for one kernel call: params (updated in place), their grads
    and, per state name, their states; for an optimizer that `writes_casts`, autocast's kept
    casts of the params (None where there is none, all of one dtype) to write the new values
    into, with their keys (`amp.kept_cast`)."""
    params: list = dataclasses.field(default_factory=list)
    grads: list = dataclasses.field(default_factory=list)
    states: dict = dataclasses.field(default_factory=dict)
    casts: list = dataclasses.field(default_factory=list)
    cast_keys: list = dataclasses.field(default_factory=list)
    cast_dtype: object = None

    def add_cast(self, kept):
        """Add a param's kept cast (`amp.kept_cast`'s (key, array), or None); one of another
        dtype than the bucket's first stays out (autocast refreshes it)."""
        if kept is None or (self.cast_dtype is not None and kept[1].dtype != self.cast_dtype):
            self.casts.append(None)
            return
        self.cast_dtype = kept[1].dtype
        self.casts.append(kept[1])
        self.cast_keys.append(kept[0])


class Optimizer(graph.GraphState):
    """Base of the optimizers: `params_or_groups` is an iterable of DTensors or of dicts
    ({"params": [...], hyperparameter overrides}); `defaults` holds every hyperparameter.

    A subclass supplies `check_group` (validate a group's hyperparameters), `state_names` (the
    per-parameter states a group keeps), `scalars` (advance a group's counters, give the kernel
    scalars of this step) and `update` (one kernel call per bucket); one whose kernels write
    autocast's kept casts of the parameters (`Bucket.casts`) sets `writes_casts`.
    """
    writes_casts = False

    def __init__(self, params_or_groups, defaults):
        if isinstance(params_or_groups, DTensor):
            raise TypeError("an optimizer takes an iterable of DTensors or of dicts, got one "
                            "DTensor")
        groups = list(params_or_groups)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.defaults = dict(defaults)
        self.param_groups = []
        self.state = {}     # parameter (by identity) -> {name: DTensor laid out like it}
        self._device_scalars = {}   # group index -> float64 vector of the step's scalars
        self._skipped = {}          # group index -> float64 0-d device count of skipped steps
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, group):
        """Add a group: its own hyperparameters override the defaults."""
        params = group["params"]
        params = [params] if isinstance(params, DTensor) else list(params)
        for p in params:
            if not isinstance(p, DTensor):
                raise TypeError(f"optimizer parameters must be DTensors, got "
                                f"{type(p).__name__}")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in params}) != len(params) or seen & {id(p) for p in params}:
            raise ValueError("a parameter appears more than once in the optimizer's groups")
        group = {**self.defaults, **group, "params": params}
        self.check_group(group)
        self.param_groups.append(group)

    # ---- what a subclass provides ---------------------------------------------------------------
    def check_group(self, group):
        """Raise ValueError for a bad hyperparameter of `group`."""
        raise NotImplementedError

    def state_names(self, group):
        """Names of the states each parameter of `group` keeps, each laid out like it."""
        raise NotImplementedError

    def scalars(self, group):
        """Advance `group`'s per-step counters and return this step's kernel scalars (floats)."""
        raise NotImplementedError

    def update(self, group, buckets, scalars, found_inf, skipped):
        """Update `group` from `buckets`: {(param dtype, grad dtype, new state): Bucket}, where
        `new state` means the states were just created (zeros): the parameters' first update.
        `scalars`: what `scalars(group)` gave, as floats (NumPy) or a float64 device vector.
        `found_inf`: None, or a float32 device scalar that, when non-zero, makes the kernels
        change nothing; `skipped`: the group's float64 count of the steps so skipped."""
        raise NotImplementedError

    # ---- stepping -------------------------------------------------------------------------------
    def step(self, found_inf=None):
        """Update every parameter that has a gradient, in place on each rank's local arrays
        (autocast's casts of the old values are dropped, or rewritten with the new ones by an
        optimizer that `writes_casts`). `found_inf` (a float32 device scalar,
        from `GradScaler`): when it holds a non-zero value as the kernels run, this step changes
        no parameter or state and counts as not taken (decided on the device: no host sync)."""
        amp.parameters_changed()
        record = graph.join(self)
        written = []
        for index, group in enumerate(self.param_groups):
            buckets = self._buckets(group)
            if not buckets:
                continue
            for bucket in buckets.values():
                written += bucket.cast_keys
            device = self._device_scalars.get(index)
            if device is None:
                device = self._device_scalars[index] = backend.xp.empty(MAX_VALUES,
                                                                        backend.xp.float64)
            if record is None:
                write_values(device, self.scalars(group))
            else:
                record.setdefault("groups", []).append(index)
            skipped = self._skipped_steps(index)
            self.update(group, buckets, device, found_inf, skipped)
            if found_inf is not None:
                skipped += found_inf.reshape(())
        amp.casts_written(written)     # a skipped step leaves params and casts as they were

    def _skipped_steps(self, index):
        """Group `index`'s device count (float64, 0-d) of the steps that found_inf skipped."""
        skipped = self._skipped.get(index)
        if skipped is None:
            skipped = self._skipped[index] = backend.xp.zeros((), backend.xp.float64)
        return skipped

    def steps_skipped(self):
        """{group index: steps skipped for non-finite gradients} (reads the device)."""
        return {index: int(skipped) for index, skipped in self._skipped.items()}

    # ---- CUDA-graph state (cupytp.graph.GraphState) ---------------------------------------------
    def capture_begin(self, record):
        pass

    def capture_end(self, record):
        pass

    def before_replay(self, record):
        for index in record.get("groups", ()):
            write_values(self._device_scalars[index], self.scalars(self.param_groups[index]))

    def _buckets(self, group):
        """The group's parameters with gradients, split by (param dtype, grad dtype, new state):
        one kernel call each (the kernels take one dtype per list). Each list holds what the
        kernels' list check asks (`check_optimizer_lists`, which `update` need not run again):
        C-contiguous arrays of one dtype, gradients and states laid out like their parameters."""
        names = self.state_names(group)
        required = frozenset(names)
        buckets = {}
        states = self.state
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = contiguous_grad(p)
            state = states.get(p)
            if state is None:
                state = states[p] = {}
            new = not state.keys() >= required
            if new:
                graph.forbid_in_capture("an optimizer's first step (it creates its states)",
                                        "run the step eagerly at least once first (cuda_graph's "
                                        "warmup)")
                for name in names:
                    if name not in state:
                        state[name] = _zeros_like(p)
            local = p._local
            if not backend.c_contiguous(local):
                raise ValueError(f"parameter of shape {p.shape} has a local array that is not "
                                 "C-contiguous: the optimizer updates it in place; assign "
                                 "its values into a contiguous array")
            key = (local.dtype, grad.dtype, new)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = Bucket(states={name: [] for name in names})
            bucket.params.append(local)
            bucket.grads.append(grad)
            if self.writes_casts:
                bucket.add_cast(amp.kept_cast(p))
            for name in names:
                bucket.states[name].append(state[name]._local)
        return buckets

    def zero_grad(self, set_to_none=True):
        """Drop every gradient (or, with set_to_none=False, fill it with zeros in place). Dropped
        at the end of a captured step, the gradients' memory serves the next replay's forward
        pass (the graph writes them again in its backward, at the same addresses)."""
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad._local[...] = 0

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self):
        """{"state": {index: {name: DTensor}}, "param_groups": [{hyperparameters, "params":
        [index, ...]}]}, indices counting parameters across groups in order.

        States are the live DTensors (not copies), laid out like their parameters: each rank holds
        only its shards. Save them before the next step changes them.
        """
        state = {}
        groups = []
        index = 0
        skipped = self.steps_skipped()
        for number, group in enumerate(self.param_groups):
            saved = {key: value for key, value in group.items() if key != "params"}
            if "step" in saved:         # the steps taken: those skipped do not count
                saved["step"] -= skipped.get(number, 0)
            saved["params"] = []
            for p in group["params"]:
                if self.state.get(p):
                    state[index] = dict(self.state[p])
                saved["params"].append(index)
                index += 1
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Take the hyperparameters and copies of the states of `state_dict` (as `state_dict()`
        gives); nothing changes if it does not fit. A state may be a DTensor of any placements
        (redistributed to its parameter's) or a full array; each rank keeps its own block."""
        saved_groups = state_dict["param_groups"]
        sizes = [len(group["params"]) for group in self.param_groups]
        saved_sizes = [len(group["params"]) for group in saved_groups]
        if sizes != saved_sizes:
            raise ValueError(f"state dict has groups of {saved_sizes} parameters, this optimizer "
                             f"has {sizes}")
        unknown = [index for index in state_dict["state"] if not 0 <= index < sum(sizes)]
        if unknown:
            raise ValueError(f"state dict has states for parameters {unknown}, this optimizer "
                             f"has {sum(sizes)} parameters")
        groups = []
        for group, saved in zip(self.param_groups, saved_groups):
            missing = sorted(set(self.defaults) - set(saved))
            if missing:
                raise ValueError(f"state dict's group lacks hyperparameters {missing}")
            groups.append({**saved, "params": group["params"]})
            self.check_group(groups[-1])
        states = {}
        index = 0
        for group in groups:
            names = self.state_names(group)    # in order: every rank iterates states alike
            for p in group["params"]:
                saved = state_dict["state"].get(index)
                if saved is not None:
                    if set(saved) != set(names):
                        raise ValueError(f"state of parameter {index} has {sorted(saved)}, this "
                                         f"optimizer keeps {sorted(names)}")
                    states[p] = {name: _zeros_like(p) for name in names}
                    for name, value in saved.items():
                        assign(states[p][name], value, f"state {name!r} of parameter {index}")
                index += 1
        self.param_groups = groups
        self.state = states
        self._skipped = {}


def _zeros_like(p):
    """Zeros laid out like parameter `p` (each rank holds its own block)."""
    return DTensor._make(backend.xp.zeros(p.local_shape, dtype=p.dtype), p.layout)


def check_non_negative(**values):
    """Raise ValueError naming the first value that is negative."""
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
