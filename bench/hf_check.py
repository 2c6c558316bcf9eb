"""Cross-check with Hugging Face transformers (where installed): a GPT-2 saved by cupytp loads
in transformers' GPT2LMHeadModel and gives the same logits, and a transformers-saved checkpoint
loads in cupytp (tensor-parallel over the launched ranks) with the same logits.

mpiexec -n 2 python bench/hf_check.py --out DIR
"""
import argparse
import os

import numpy

import cupytp
from cupytp import backend
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.tensor import Replicated, from_local


def our_logits(model, ids):
    mesh = model.mesh
    x = from_local(backend.asarray(ids), mesh, (Replicated(),) * mesh.ndim, shape=ids.shape)
    logits, _ = model(x)
    return backend.asnumpy(logits.full_tensor())[..., :model.config.vocab_size]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = p.parse_args()
    info = cupytp.init()
    mesh = cupytp.DeviceMesh((info.world_size,), ("tp",))
    config = GPT2Config(vocab_size=1000, block_size=64, n_layer=2, n_head=4, n_embd=64)
    cupytp.manual_seed(0)
    ours = GPT2(config, mesh)
    ids = numpy.random.default_rng(0).integers(0, config.vocab_size, size=(2, 32))
    path = os.path.join(args.out, "hf_check")
    ours.save_pretrained(path)
    cupytp.distributed.barrier()
    mine = our_logits(ours, ids)
    if info.rank == 0:
        import torch
        from transformers import GPT2LMHeadModel
        hf = GPT2LMHeadModel.from_pretrained(path).eval()
        with torch.no_grad():
            theirs = hf(torch.tensor(ids)).logits.numpy()
        error = numpy.abs(theirs - mine).max() / numpy.abs(theirs).max()
        print(f"cupytp -> transformers: max relative logit difference {error:.2e}")
        hf.save_pretrained(path + "_hf", safe_serialization=True)
    cupytp.distributed.barrier()
    back = GPT2.from_pretrained(path + "_hf", mesh)
    error = numpy.abs(our_logits(back, ids) - mine).max() / numpy.abs(mine).max()
    if info.rank == 0:
        print(f"transformers -> cupytp (tp={info.world_size}): max relative logit difference "
              f"{error:.2e}")


if __name__ == "__main__":
    main()
