"""Optimizers on the device: fused SGD and AdamW over DTensors (each rank updates its own shards,
states laid out like their parameters), global-norm gradient clipping across the mesh, and
learning-rate schedules, dynamic loss scaling for fp16."""
from cupytp.optim.adamw import AdamW, decay_groups
from cupytp.optim.clip import clip_grad_norm_
from cupytp.optim.grad_scaler import GradScaler
from cupytp.optim.lr_scheduler import LRScheduler, constant, cosine_with_warmup, linear
from cupytp.optim.optimizer import Optimizer
from cupytp.optim.sgd import SGD

__all__ = [
    "AdamW", "decay_groups", "clip_grad_norm_", "GradScaler", "LRScheduler", "constant", "cosine_with_warmup",
    "linear", "Optimizer", "SGD",
]
