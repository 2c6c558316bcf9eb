"""A 2-stage pipeline whose second step goes wrong (`python pipeline_failure.py MODE` on 2
ranks): "raise", stage 1's forward raises at micro-batch 1; "skip", rank 0 skips its send of
micro-batch 1's activation; "shape" (under CUPYTP_DEBUG=1), rank 1 receives a transfer of
another shape than rank 0 sends. Every rank must end with a named error, not hang."""
import copy
import sys

import numpy

import cupytp
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.parallel import pipeline

mode = sys.argv[1]
info = cupytp.init()
mesh = cupytp.DeviceMesh((2,), ("pp",))
if mode == "shape":
    group = mesh.get_process_group("pp")
    if info.rank == 0:
        group.batch_isend_irecv([(numpy.ones((2, 3)), 1)]).wait()
    else:
        group.batch_isend_irecv(recvs=[((2, 4), "fp64", 0)]).wait()
    sys.exit(0)

cupytp.manual_seed(1)
pipe = pipeline(GPT2(GPT2Config(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=8)),
                mesh, schedule="1f1b", microbatches=3)
ids = numpy.random.default_rng(0).integers(0, 37, size=(6, 9))
pipe.step(ids[:, :-1], ids[:, 1:])
if mode == "raise" and info.rank == 1:
    stage, calls = pipe.stages[0], []

    def failing(x):
        calls.append(x)
        if len(calls) == 2:
            raise RuntimeError("a layer blew up")
        return type(stage).forward(stage, x)
    object.__setattr__(stage, "forward", failing)
if mode == "skip" and info.rank == 0:
    schedule = copy.copy(pipe.schedule)
    schedule.actions = (tuple(a for a in schedule.actions[0] if str(a) != "0SEND_F1"),
                        schedule.actions[1])
    object.__setattr__(pipe, "schedule", schedule)
pipe.step(ids[:, :-1], ids[:, 1:])
print(f"rank {info.rank} finished without an error", flush=True)
