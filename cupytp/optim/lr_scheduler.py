"""Learning-rate schedules as pure functions of the step (counting from 0), and LRScheduler,
which writes a schedule's value into every group's "lr".

Warmup follows llm.c and nanoGPT: the lr rises linearly to max_lr over `warmup_steps` steps,
starting at max_lr / warmup_steps (step 0 already moves), and is max_lr at step warmup_steps - 1.
The decay then runs from max_lr at step warmup_steps to min_lr at step total_steps, and stays at
min_lr after.

    scheduler = LRScheduler(optimizer, lambda step: cosine_with_warmup(step, 6e-4, 700, 19073))
    for step in range(total):  # ... backward, optimizer.step()
        scheduler.step()
"""
import math

from cupytp import graph
from cupytp.optim.optimizer import check_non_negative


def _check(step, max_lr, warmup_steps, total_steps, min_lr):
    check_non_negative(step=step, max_lr=max_lr, warmup_steps=warmup_steps, min_lr=min_lr)
    if total_steps < warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")
    if min_lr > max_lr:
        raise ValueError(f"min_lr ({min_lr}) must be <= max_lr ({max_lr})")


def _warmup(step, max_lr, warmup_steps):
    return max_lr * (step + 1) / warmup_steps


def _decay_progress(step, warmup_steps, total_steps):
    """How far the decay phase is at `step`: 0 at warmup_steps, 1 at total_steps and after."""
    return min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))


def cosine_with_warmup(step, max_lr, warmup_steps, total_steps, min_lr=0.0):
    """Linear warmup, then a half cosine from max_lr down to min_lr at total_steps."""
    _check(step, max_lr, warmup_steps, total_steps, min_lr)
    if step < warmup_steps:
        return _warmup(step, max_lr, warmup_steps)
    progress = _decay_progress(step, warmup_steps, total_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))


def linear(step, max_lr, warmup_steps, total_steps, min_lr=0.0):
    """Linear warmup, then a straight line from max_lr down to min_lr at total_steps."""
    _check(step, max_lr, warmup_steps, total_steps, min_lr)
    if step < warmup_steps:
        return _warmup(step, max_lr, warmup_steps)
    progress = _decay_progress(step, warmup_steps, total_steps)
    return max_lr - (max_lr - min_lr) * progress


def constant(step, lr, warmup_steps=0):
    """Linear warmup, then `lr` for good."""
    check_non_negative(step=step, lr=lr, warmup_steps=warmup_steps)
    if step < warmup_steps:
        return _warmup(step, lr, warmup_steps)
    return lr


class LRScheduler:
    """Sets every group's "lr" of `optimizer` to `schedule(step)`: at construction for step 0,
    then for the next step at each `step()` (call it after `optimizer.step()`)."""

    def __init__(self, optimizer, schedule):
        self.optimizer = optimizer
        self.schedule = schedule
        self.last_step = 0
        self._apply()

    def step(self):
        graph.forbid_in_capture("a learning-rate schedule step",
                                "call scheduler.step() outside the captured function (a replay "
                                "reads each group's current lr)")
        self.last_step += 1
        self._apply()

    def _apply(self):
        lr = self.schedule(self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self):
        return {"last_step": self.last_step}

    def load_state_dict(self, state_dict):
        self.last_step = state_dict["last_step"]
        self._apply()
