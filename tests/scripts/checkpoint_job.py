"""Jobs of the checkpoint tests, run alone or under mpiexec.

    checkpoint_job.py save-then-die DIR REFERENCE RANK:POINT
        A GPT-2 at TP=world trains 2 steps and saves step 2 into DIR; rank 0 writes what it
        computes next to REFERENCE (.npz); then it saves step 4, and global rank RANK kills
        itself at POINT of that save (CUPYTP_CHECKPOINT_FAULT).
    checkpoint_job.py continue DIR REFERENCE
        Loads DIR on a dense model, at TP=world and, on an even world of 4 or more, on a
        (2, world/2) mesh: each must hold the saved values and continue as REFERENCE.
"""
import os
import sys

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cupytp  # noqa: E402
from cupytp import checkpoint  # noqa: E402
from cupytp.checkpoint.storage import FAULT_VARIABLE  # noqa: E402
from cupytp.tensor import local_mesh  # noqa: E402
from small_gpt2 import check_continues, gpt2, reference, train  # noqa: E402

command, directory, reference_path = sys.argv[1:4]
info = cupytp.init()
world = info.world_size
if command == "save-then-die":
    model, optimizer = gpt2(cupytp.DeviceMesh((world,), ("tp",)), seed=1)
    train(model, optimizer, 2)
    checkpoint.save(directory, 2, model, optimizer, extra={"job": "save-then-die"})
    expected = reference(model, optimizer)
    if info.rank == 0:
        numpy.savez(reference_path, **expected)
    os.environ[FAULT_VARIABLE] = sys.argv[4]
    checkpoint.save(directory, 4, model, optimizer)
    print("the save at step 4 was not killed", flush=True)
    sys.exit(1)
elif command == "continue":
    with numpy.load(reference_path) as stored:
        expected = dict(stored)
    meshes = [local_mesh(), cupytp.DeviceMesh((world,), ("tp",))]
    if world >= 4 and world % 2 == 0:
        meshes.append(cupytp.DeviceMesh((2, world // 2), ("dp", "tp")))
    for mesh in meshes:
        check_continues(expected, directory, mesh, step=2)
    print(f"rank {info.rank}: continued on {len(meshes)} meshes", flush=True)
else:
    sys.exit(f"unknown command {command!r}")
