"""Dynamic loss scaling for float16 training, decided on the device (no host synchronisation, so
a step with it can be captured into a CUDA graph).

fp16 gradients underflow where bf16's do not: the loss is multiplied by a large scale before
backward and the gradients divided by it before the update. A step whose gradients hold an inf or
a NaN anywhere on the mesh (the scale was too large) updates nothing and halves the scale; after
`growth_interval` good steps in a row the scale doubles. The scale, the growth tracker and the
found-inf flag live in device memory; the optimizer kernels read the flag and skip themselves,
and AdamW's bias corrections count only the steps taken (torch.amp.GradScaler's algorithm).

    scaler = GradScaler()
    with ops.autocast("fp16"):
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)            # optional: before clipping the true gradients
    clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
"""
import numpy

from cupytp import backend
from cupytp.launchers.loss_scale import update_loss_scale
from cupytp.launchers.multi_tensor import unscale_check_
from cupytp.optim.optimizer import contiguous_grad
from cupytp.tensor import Partial, Replicated, from_local


class GradScaler:
    """Scale the loss, unscale the gradients, skip non-finite steps, adapt the scale.

    `init_scale`, `growth_factor` (> 1), `backoff_factor` (in (0, 1)) and `growth_interval`
    (>= 1 steps) as in torch.amp.GradScaler; `enabled=False` makes every method pass through.
    Each rank holds the same scale: the non-finite check is all-reduced (max) over the meshes of
    the optimizer's parameters, and over `pp_mesh` (a pipeline's, `Pipeline.pp_mesh`: its
    stages hold different parameters), so every rank skips the same steps.
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, pp_mesh=None):
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if int(growth_interval) != growth_interval or growth_interval < 1:
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval}")
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.enabled = bool(enabled)
        self.pp_mesh = pp_mesh
        xp = backend.xp
        self._scale = xp.full((1,), init_scale, dtype=numpy.float32)
        self._tracker = xp.zeros((1,), dtype=numpy.int32)
        self._found_inf = xp.zeros((1,), dtype=numpy.float32)
        self._inv_scale = xp.ones((1,), dtype=numpy.float32)
        self._unscaled = set()      # ids of the optimizers unscaled since the last update()

    def is_enabled(self):
        return self.enabled

    def scale(self, loss):
        """`loss` times the current scale, in float32 at least (a DTensor whose backward scales
        every gradient)."""
        if not self.enabled:
            return loss
        if loss.dtype.itemsize < 4:         # the scaled loss would overflow a 16-bit float
            loss = loss.astype(numpy.float32)
        scale = from_local(self._scale.reshape(()), loss.mesh, (Replicated(),) * loss.mesh.ndim,
                           shape=(), run_check=False)
        return loss * scale

    def unscale_(self, optimizer):
        """Divide the gradients of `optimizer`'s parameters by the scale, in place, and note
        (on the device) whether any is not finite on any rank. Once per optimizer and step."""
        if not self.enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() was already called on this optimizer since the last "
                               "update()")
        self._unscaled.add(id(optimizer))
        self._found_inf[...] = 0
        self._inv_scale[...] = 1.0 / self._scale
        by_mesh = {}            # mesh -> {grad dtype: [local grads]}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_mesh.setdefault(p.mesh, {}).setdefault(p.grad.dtype, []).append(
                        contiguous_grad(p))
        for by_dtype in by_mesh.values():
            for grads in by_dtype.values():
                unscale_check_(grads, self._inv_scale, self._found_inf)
        meshes = list(by_mesh) + ([self.pp_mesh] if self.pp_mesh is not None else [])
        for mesh in meshes:         # any rank's non-finite gradient skips the step everywhere
            if mesh.size() > 1:
                flag = from_local(self._found_inf, mesh, (Partial("max"),) * mesh.ndim,
                                  shape=(1,), run_check=False)
                self._found_inf[...] = flag.redistribute((Replicated(),) * mesh.ndim).to_local()

    def step(self, optimizer):
        """Unscale (unless `unscale_` already did), then `optimizer.step()`, which changes
        nothing when a gradient was not finite."""
        if not self.enabled:
            optimizer.step()
            return
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        optimizer.step(found_inf=self._found_inf)

    def update(self):
        """Back off after a non-finite step, grow after `growth_interval` good ones (on the
        device)."""
        if not self.enabled:
            return
        if self._unscaled:
            update_loss_scale(self._scale, self._tracker, self._found_inf, self.growth_factor,
                              self.backoff_factor, self.growth_interval)
        self._unscaled.clear()

    def get_scale(self):
        """The current scale as a float (reads the device: not inside a captured step)."""
        return float(self._scale[0]) if self.enabled else 1.0

    def state_dict(self):
        return {"scale": self.get_scale(), "growth_tracker": int(self._tracker[0]),
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval} if self.enabled else {}

    def load_state_dict(self, state):
        if not self.enabled:
            return
        self._scale[...] = state["scale"]
        self._tracker[...] = state["growth_tracker"]
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
