"""Sharded checkpoints: every rank writes only its own shards, any mesh reads them back, and a
save is atomic (a crash never breaks the previous checkpoint).

    from cupytp import checkpoint
    checkpoint.save("ckpt", step, model=model, optimizer=optimizer, extra={"data": ...})
    extra = checkpoint.load("ckpt", model=model, optimizer=optimizer)   # extra["step"] == step

On disk (`storage` has the details): `ckpt/step-00000012/` holds `index.json` (each tensor's
global shape, dtype, mesh, placements and shards; each shard file's sha256; the optimizer's
hyperparameters; `extra`) and one `rank-NNNNN.safetensors` per rank that wrote blocks;
`ckpt/latest` names the newest complete checkpoint. Every rank must see the same directory (on
several nodes: a shared filesystem).
"""
from cupytp.checkpoint.sharded import load, read_extra, save
from cupytp.checkpoint.storage import CheckpointError

__all__ = ["load", "read_extra", "save", "CheckpointError"]
