"""Checkpoints on one rank: a round trip restores model, optimizer and extra so that training
continues bit for bit; `latest`, replacing a step, keep_last; a save killed at any point keeps
the previous checkpoint loadable (also a rank killed under mpiexec, whose TP=2 checkpoint then
loads on 1 and 4 ranks); each bad checkpoint or save is one clear error that changes nothing;
examples/train.py resumes bit for bit, after Ctrl-C too, and on another mesh (another --pp,
--tp, --dp)."""
import csv
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys

import ml_dtypes
import numpy
import pytest

import cupytp
from cupytp import backend, checkpoint, nn
from cupytp.checkpoint import CheckpointError
from cupytp.models.gpt2 import GPT2, preset
from cupytp.tensor import Replicated, default_generator, local_mesh
from small_gpt2 import (CONFIG, assert_same, check_continues, gpt2, reference, snapshot,
                           train)
from launch import REPO, mpiexec, under_mpiexec
from dense_reference import full, lay_out, rng_array
from test_train_example import run

pytestmark = pytest.mark.skipif(under_mpiexec(), reason="one rank; launches its own jobs")


@pytest.fixture(scope="module", autouse=True)
def runtime():
    return cupytp.init()


def trained(seed, steps=1):
    model, optimizer = gpt2(local_mesh(), seed)
    train(model, optimizer, steps)
    return model, optimizer


def hyperparameters(optimizer):
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def listing(directory):
    return sorted(os.listdir(directory))


def skip_unless_ranks(count):
    """On GPUs a job of `count` ranks needs `count` GPUs."""
    if backend.on_gpu and backend.xp.cuda.runtime.getDeviceCount() < count:
        pytest.skip(f"needs {count} GPUs")


# ---- round trips --------------------------------------------------------------------------------

def test_round_trip_continues_bit_for_bit(tmp_path):
    model, optimizer = trained(seed=1, steps=2)
    groups = hyperparameters(optimizer)
    extra = {"rng": [1337, 2 ** 63 + 5], "data": {"windows": 12}}
    path = checkpoint.save(tmp_path, 2, model, optimizer, extra=extra)
    assert path == str(tmp_path / "step-00000002")
    assert listing(path) == ["index.json", "rank-00000.safetensors"]
    assert (tmp_path / "latest").read_text() == "step-00000002\n"
    fresh, fresh_optimizer = gpt2(local_mesh(), seed=7)
    assert checkpoint.load(tmp_path, fresh, fresh_optimizer) == {**extra, "step": 2}
    assert hyperparameters(fresh_optimizer) == groups            # betas a tuple again
    check_continues(reference(model, optimizer), tmp_path, local_mesh(), step=2, rtol=0.0)


def test_rng_state_in_extra_continues_dropout_alike(tmp_path):
    model, optimizer = gpt2(local_mesh(), seed=1, dropout=0.5)
    train(model, optimizer, 1)
    extra = {"rng": list(default_generator.get_state())}
    checkpoint.save(tmp_path, 1, model, optimizer, extra=extra)
    expected = train(model, optimizer, 2)
    fresh, fresh_optimizer = gpt2(local_mesh(), seed=2, dropout=0.5)
    assert checkpoint.load(tmp_path, fresh, fresh_optimizer)["rng"] == extra["rng"]
    assert train(fresh, fresh_optimizer, 2) != expected            # other dropout masks
    default_generator.set_state(checkpoint.load(tmp_path, fresh, fresh_optimizer)["rng"])
    assert train(fresh, fresh_optimizer, 2) == expected


class Tensors(nn.Module):
    def __init__(self, arrays):
        super().__init__()
        for name, array in arrays.items():
            floating = array.dtype.kind == "f" or array.dtype == ml_dtypes.bfloat16
            tensor = lay_out(array, local_mesh(), (Replicated(),), requires_grad=floating)
            if floating:
                setattr(self, name, tensor)
            else:
                self.register_buffer(name, tensor)


def test_every_dtype_and_shape_round_trips_exactly(tmp_path):
    arrays = {"bf16": rng_array((2, 3), 1).astype(ml_dtypes.bfloat16),
              "fp16": rng_array((4,), 2).astype(numpy.float16), "scalar": numpy.array(2.5),
              "empty": numpy.zeros((0, 4), numpy.float32), "ids": numpy.arange(6),
              "mask": numpy.arange(5) > 2}
    checkpoint.save(tmp_path, 0, Tensors(arrays))
    model = Tensors({name: numpy.zeros_like(a) for name, a in arrays.items()})
    checkpoint.load(tmp_path, model)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == arrays[name].dtype, name
        numpy.testing.assert_array_equal(full(tensor), arrays[name], err_msg=name)


def test_latest_replacing_a_step_and_keep_last(tmp_path):
    model, optimizer = trained(seed=1)
    firsts = {}
    for step in (1, 2):
        checkpoint.save(tmp_path, step, model, optimizer)
        firsts[step] = snapshot(model, optimizer)
        train(model, optimizer, 1)
    probe, probe_optimizer = gpt2(local_mesh(), seed=5)
    assert checkpoint.load(tmp_path, probe, probe_optimizer)["step"] == 2
    assert_same(snapshot(probe, probe_optimizer), firsts[2])
    assert checkpoint.load(tmp_path / "step-00000001", probe, probe_optimizer)["step"] == 1
    assert_same(snapshot(probe, probe_optimizer), firsts[1])

    (tmp_path / ".tmp-step-00000007-left-by-a-crash").mkdir()
    checkpoint.save(tmp_path, 2, model, optimizer)                # replaces step 2
    assert listing(tmp_path) == ["latest", "step-00000001", "step-00000002"]
    checkpoint.load(tmp_path, probe, probe_optimizer)
    assert_same(snapshot(probe, probe_optimizer), snapshot(model, optimizer))

    checkpoint.save(tmp_path, 3, model, optimizer, keep_last=2)
    assert listing(tmp_path) == ["latest", "step-00000002", "step-00000003"]
    checkpoint.save(tmp_path, 1, model, optimizer, keep_last=1)   # the new one always stays
    assert listing(tmp_path) == ["latest", "step-00000001", "step-00000003"]
    assert (tmp_path / "latest").read_text() == "step-00000001\n"


# ---- a save that dies ---------------------------------------------------------------------------

def job(*args):
    return [str(REPO / "tests" / "scripts" / "checkpoint_job.py")] + [str(a) for a in args]


def stored_reference(path):
    with numpy.load(path) as stored:
        return dict(stored)


@pytest.mark.parametrize("point", ["shard", "index", "renamed"])
def test_a_save_killed_at_any_point_keeps_the_previous_checkpoint(tmp_path, point):
    root, expected = tmp_path / "ckpt", tmp_path / "reference.npz"
    result = subprocess.run([sys.executable] + job("save-then-die", root, expected, f"0:{point}"),
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr[-3000:]
    assert (root / "latest").read_text() == "step-00000002\n"
    left = [name for name in listing(root) if name.startswith(".tmp-step-00000004-")]
    assert len(left) == (point != "renamed")
    assert (root / "step-00000004").exists() == (point == "renamed")
    check_continues(stored_reference(expected), root, local_mesh(), step=2, rtol=0.0)
    model, optimizer = trained(seed=2)
    checkpoint.save(root, 5, model, optimizer)                    # cleans what the crash left
    assert [n for n in listing(root) if n.startswith(".")] == []


def test_a_rank_killed_mid_save_then_loads_on_1_and_4_ranks(tmp_path):
    skip_unless_ranks(4)
    root, expected = tmp_path / "ckpt", tmp_path / "reference.npz"
    killed = mpiexec(2, job("save-then-die", root, expected, "1:shard"), timeout=300)
    assert killed.returncode != 0 and "was not killed" not in killed.stdout, killed.stderr
    assert (root / "latest").read_text() == "step-00000002\n"
    assert not (root / "step-00000004").exists()
    check_continues(stored_reference(expected), root, local_mesh(), step=2)     # TP=2 -> 1
    loaded = mpiexec(4, job("continue", root, expected), timeout=300)          # -> 4, 2 x 2
    assert loaded.returncode == 0, loaded.stdout[-3000:] + loaded.stderr[-3000:]
    assert loaded.stdout.count("continued on 3 meshes") == 4


# ---- bad checkpoints and bad saves --------------------------------------------------------------

def flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def drop_shards(step_dir, key):
    with open(step_dir / "index.json") as f:
        index = json.load(f)
    index["tensors"][key]["shards"].clear()
    with open(step_dir / "index.json", "w") as f:
        json.dump(index, f)


def other_gpt2(**changes):
    return GPT2(dataclasses.replace(CONFIG, **changes))


SHARD = "rank-00000.safetensors"
BAD = {   # damage done to a good checkpoint, what to load it into, the error
    "missing shard file": (lambda d: os.remove(d / SHARD), None, f"{SHARD} is missing"),
    "truncated shard": (lambda d: os.truncate(d / SHARD, 1000), None,
                        f"{SHARD} has 1000 bytes, the index says"),
    "corrupt shard": (lambda d: flip_last_byte(d / SHARD), None, f"{SHARD} is corrupt"),
    "shard missing from the index": (
        lambda d: drop_shards(d, "model/transformer.wpe.weight"), None,
        r"transformer.wpe.weight: the shards in .* cover 0 of the 64 elements"),
    "other model shape": (None, lambda: other_gpt2(n_embd=16),
                          r"model/transformer.wte.weight: .* holds shape \(64, 8\), this model "
                          r"has \(64, 16\)"),
    "other model": (None, lambda: other_gpt2(n_layer=1),
                    r"holds another model: it holds \[model/transformer.h.1.*which this "
                    r"model lacks"),
    "not a checkpoint": (lambda d: shutil.rmtree(d.parent), None, "is not a directory"),
    "empty directory": (lambda d: shutil.rmtree(d) or os.remove(d.parent / "latest"), None,
                        "is not a checkpoint: it holds no index.json"),
    "garbage index": (lambda d: (d / "index.json").write_text("{"), None,
                      "index.json cannot be read as a checkpoint index"),
    "another format": (lambda d: (d / "index.json").write_text("{}"), None,
                       "is not a cupytp checkpoint index"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_checkpoint_is_one_clear_error_and_loads_nothing(tmp_path, case):
    damage, make_target, message = BAD[case]
    model, optimizer = trained(seed=1)
    root = tmp_path / "ckpt"
    checkpoint.save(root, 1, model, optimizer)
    if damage is not None:
        damage(root / "step-00000001")
    target, target_optimizer = trained(seed=3) if make_target is None else (make_target(), None)
    before = snapshot(target, target_optimizer)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(root, target, target_optimizer)
    assert_same(snapshot(target, target_optimizer), before)


def test_optimizer_state_missing_from_the_checkpoint(tmp_path):
    model, _ = trained(seed=1)
    checkpoint.save(tmp_path, 1, model)
    target, optimizer = trained(seed=3)
    before = snapshot(target, optimizer)
    with pytest.raises(CheckpointError, match="holds no optimizer state .* optimizer=None"):
        checkpoint.load(tmp_path, target, optimizer)
    assert_same(snapshot(target, optimizer), before)
    assert checkpoint.load(tmp_path, target)["step"] == 1


@pytest.mark.parametrize("kwargs,message", [
    ({"step": -1}, "step must be an integer >= 0"),
    ({"keep_last": 0}, "keep_last must be None or an integer >= 1"),
    ({"extra": {"step": 3}}, "extra must not hold 'step'"),
    ({"extra": {"seed": object()}}, "extra cannot be saved: object values are not JSON"),
])
def test_a_bad_save_is_one_clear_error_and_writes_nothing(tmp_path, kwargs, message):
    model, optimizer = trained(seed=1)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.save(tmp_path, **{"step": 1, "model": model, "optimizer": optimizer, **kwargs})
    assert listing(tmp_path) == []


def test_saving_into_a_file_is_an_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="FileExistsError|NotADirectoryError"):
        checkpoint.save(tmp_path / "file", 1, *trained(seed=1))


# ---- examples/train.py -------------------------------------------------------------------------

SMALL = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--sample-tokens", "0",
         "--eval-batches", "1", "--eval-interval", "1000", "--log-interval", "1"]


def losses_by_step(out):
    """{step: training loss} of a run's log.csv (rows of validation only left out)."""
    with open(os.path.join(out, "log.csv")) as f:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(f) if row["loss"]}


def assert_same_losses(got, expected):
    """Bit for bit on the CPU; on GPUs atomics may reorder sums (rtol 1e-4)."""
    assert sorted(got) == sorted(expected)
    for step, loss in expected.items():
        assert got[step] == (pytest.approx(loss, rel=1e-4) if backend.on_gpu else loss), step


def test_training_resumes_bit_for_bit_at_tp2(tmp_path):
    skip_unless_ranks(2)
    common = SMALL + ["--tp", "2", "--steps", "6"]
    whole, saves = tmp_path / "whole", tmp_path / "saves"
    result = run(common + ["--out", str(whole), "--checkpoint-dir", str(saves),
                           "--checkpoint-interval", "3"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert listing(saves) == ["latest", "step-00000003", "step-00000006"]
    died = tmp_path / "died"                  # what a run killed during step 4 leaves
    shutil.copytree(saves / "step-00000003", died / "step-00000003")
    (died / "latest").write_text("step-00000003\n")
    resumed = tmp_path / "resumed"
    result = run(common + ["--out", str(resumed), "--checkpoint-dir", str(died), "--resume"],
                 ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {step: loss for step, loss in losses_by_step(whole).items() if step >= 3}
    assert_same_losses(losses_by_step(resumed), expected)
    assert (died / "latest").read_text() == "step-00000006\n"


def test_ctrl_c_saves_and_the_resumed_run_matches_an_uninterrupted_one(tmp_path):
    reference, out, saves = tmp_path / "reference", tmp_path / "run", tmp_path / "saves"
    steps = ["--steps", "12"]
    result = run(SMALL + steps + ["--out", str(reference)])
    assert result.returncode == 0, result.stderr[-3000:]
    command = ["examples/train.py"] + SMALL + steps + ["--out", str(out),
                                                            "--checkpoint-dir", str(saves)]
    process = subprocess.Popen([sys.executable] + command, cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=dict(os.environ, PYTHONPATH=str(REPO)))
    for line in process.stdout:               # the header: training starts now
        if "GPT-2 tiny" in line:
            break
    process.send_signal(signal.SIGINT)
    output, errors = process.communicate(timeout=300)
    assert process.returncode != 0 and "saved checkpoint" in output, errors[-3000:]
    latest = (saves / "latest").read_text().strip()
    stopped = int(latest.split("-")[1])
    assert 1 <= stopped < 12, "the run ended before Ctrl-C reached it"
    assert sorted(losses_by_step(out)) == list(range(stopped))
    # one numbering: the steps done, the checkpoint's step, the step the resumed run starts at
    assert errors.strip() == f"interrupted at step {stopped}; checkpoint {saves / latest}; " \
                             f"logs in {out}"
    result = run(SMALL + steps + ["--out", str(out), "--checkpoint-dir", str(saves), "--resume"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(losses_by_step(out), losses_by_step(reference))
    assert [line for line in result.stdout.splitlines() if "resumed" in line] == \
        [f"resumed from {saves / latest} at step {stopped}"]
    first = [line for line in result.stdout.splitlines() if line.startswith("first loss")]
    assert first[0].split()[2] == f"{losses_by_step(reference)[0]:.4f}"   # the run's, not the
    with open(out / "log.jsonl") as f:                                   # segment's
        assert [json.loads(line)["step"] for line in f] == list(range(13))


def test_resuming_a_step_directory_saves_beside_it(tmp_path):
    """--checkpoint-dir ROOT/step-N --resume (the form a "not a checkpoint" error suggests)
    continues from that step and writes the new checkpoints into ROOT, beside it."""
    saves = tmp_path / "saves"
    common = SMALL + ["--checkpoint-interval", "2"]
    result = run(common + ["--steps", "4", "--out", str(tmp_path / "a"), "--checkpoint-dir",
                           str(saves)])
    assert result.returncode == 0, result.stderr[-3000:]
    step2 = saves / "step-00000002"
    before = listing(step2)
    result = run(common + ["--steps", "6", "--out", str(tmp_path / "b"), "--checkpoint-dir",
                           str(step2), "--resume"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {step2} at step 2" in result.stdout
    assert listing(saves) == ["latest", "step-00000002", "step-00000004", "step-00000006"]
    assert listing(step2) == before
    assert (saves / "latest").read_text() == "step-00000006\n"


def test_a_new_run_refuses_a_checkpoint_dir_that_holds_checkpoints(tmp_path):
    saves = tmp_path / "saves"
    result = run(SMALL + ["--steps", "2", "--out", str(tmp_path / "a"), "--checkpoint-dir",
                          str(saves)])
    assert result.returncode == 0, result.stderr[-3000:]
    result = run(SMALL + ["--steps", "3", "--out", str(tmp_path / "b"), "--checkpoint-dir",
                          str(saves)])
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [f"train: error: --checkpoint-dir {saves} already holds checkpoints "
                      f"(the latest: {saves / 'step-00000002'}): add --resume to continue them, "
                      "or choose another --checkpoint-dir"]
    assert listing(saves) == ["latest", "step-00000002"]


def test_resuming_on_another_dp_keeps_the_global_batch(tmp_path):
    """--batch-size is per data-parallel rank: left out, a run resumed on dp=2 takes half the
    checkpoint's batch per rank and follows the uninterrupted dp=1 run; given so that the
    global batch changes, one line says so. Another --tp resumes too."""
    skip_unless_ranks(2)
    common = SMALL + ["--steps", "6"]
    whole, saves = tmp_path / "whole", tmp_path / "saves"
    result = run(common + ["--batch-size", "4", "--out", str(whole), "--checkpoint-dir",
                           str(saves), "--checkpoint-interval", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    died = tmp_path / "died"
    shutil.copytree(saves / "step-00000003", died / "step-00000003")
    resumed = tmp_path / "resumed"
    result = run(common + ["--out", str(resumed), "--checkpoint-dir", str(died), "--resume"],
                 ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh dp=2 tp=1" in result.stdout and "note:" not in result.stdout
    expected = {step: loss for step, loss in losses_by_step(whole).items() if step >= 3}
    got = losses_by_step(resumed)
    assert sorted(got) == sorted(expected)
    for step, loss in expected.items():        # dp=2 sums the batch's halves in another order
        assert got[step] == pytest.approx(loss, rel=1e-5), step
    shutil.rmtree(died / "step-00000006")
    (died / "latest").write_text("step-00000003\n")
    result = run(common + ["--batch-size", "6", "--out", str(resumed), "--checkpoint-dir",
                           str(died), "--resume"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "the global batch is now 12 sequences (--batch-size 6 per " \
        "data-parallel rank × dp 2); the checkpoint trained with 4" in notes[0]
    result = run(common + ["--steps", "8", "--tp", "2", "--out", str(resumed),
                           "--checkpoint-dir", str(died), "--resume"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]     # a checkpoint loads at any --tp
    assert "mesh dp=1 tp=2" in result.stdout and f"resumed from {died / 'step-00000006'} at " \
        "step 6" in result.stdout
    assert sorted(step for step in losses_by_step(resumed) if step >= 6) == [6, 7]


def test_a_pipeline_checkpoint_resumes_without_the_pipeline(tmp_path):
    """Checkpoints do not depend on the pipeline: a run of two GPipe stages over 2 micro-batches,
    resumed from its step 3 without a pipeline (on --tp 2), logs its losses (fp32, no dropout:
    to the rounding of sums taken in another order). The Hugging Face files it saved at the end,
    its stages gathered into the whole model, hold the values of its last sharded checkpoint."""
    skip_unless_ranks(2)
    common = SMALL + ["--steps", "6", "--batch-size", "4", "--dtype", "fp32", "--dropout", "0"]
    piped, saves, exported = tmp_path / "piped", tmp_path / "saves", tmp_path / "hf"
    result = run(common + ["--pp", "2", "--pp-schedule", "gpipe", "--out", str(piped),
                           "--checkpoint-dir", str(saves), "--checkpoint-interval", "3",
                           "--checkpoint", str(exported)], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh dp=1 pp=2 tp=1, pipeline gpipe over 2 micro-batches" in result.stdout
    died = tmp_path / "died"
    shutil.copytree(saves / "step-00000003", died / "step-00000003")
    resumed = tmp_path / "resumed"
    result = run(common + ["--tp", "2", "--out", str(resumed), "--checkpoint-dir", str(died),
                           "--resume"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh dp=1 tp=2, " in result.stdout and f"resumed from {died / 'step-00000003'} " \
        "at step 3" in result.stdout
    expected = {step: loss for step, loss in losses_by_step(piped).items() if step >= 3}
    got = losses_by_step(resumed)
    assert sorted(got) == sorted(expected)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=2e-3 if backend.on_gpu else 1e-5), step
    from safetensors.numpy import load_file
    model = GPT2(dataclasses.replace(preset("tiny"), vocab_size=257))
    checkpoint.load(saves / "step-00000006", model=model)
    files = load_file(str(exported / "model.safetensors"))
    for name, value in model.hf_state_dict().items():
        if name != "lm_head.weight":                   # tied: stored once
            numpy.testing.assert_array_equal(files[name], value, err_msg=name)


@pytest.mark.parametrize("args,message", [
    (["--resume"], "--resume, --checkpoint-interval and --keep-last need --checkpoint-dir"),
    (["--resume", "--checkpoint-dir", "EMPTY"], "is not a checkpoint"),
])
def test_bad_checkpoint_flags_are_one_line(tmp_path, args, message):
    args = [str(tmp_path) if a == "EMPTY" else a for a in args]
    result = run(args + SMALL + ["--steps", "2", "--out", str(tmp_path / "out")])
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
