"""A checkpoint root on disk, and how a save is committed so that a crash never breaks it.

    ROOT/step-00000012/index.json               every tensor: shape, dtype, layout, its shards
    ROOT/step-00000012/rank-00003.safetensors   the blocks global rank 3 wrote
    ROOT/latest                                 "step-00000012": the newest complete save
    ROOT/.tmp-step-00000012-<random>/           a save in progress (or one that died)

A save writes everything into its temporary directory and fsyncs each file and the directory,
then renames it to `step-N` (the commit: under that name a directory is complete or absent),
fsyncs ROOT, and only then replaces `latest` (written under a temporary name, fsynced,
`os.replace`d). A crash at any point leaves `latest` naming a complete checkpoint. Saving a step
that exists replaces it: the old directory is renamed away first, so in the instant between the
two renames `latest` may name a missing directory; loading then takes the newest complete
`step-N`. One job saves into a root at a time.
"""
import hashlib
import json
import os
import re
import secrets
import shutil
import signal

from cupytp import env

INDEX = "index.json"
LATEST = "latest"
FORMAT = "cupytp-checkpoint"
VERSION = 2            # 2: optimizer states by parameter name; 1 (by index) still loads
READS = (1, 2)
FAULT_VARIABLE = "CUPYTP_CHECKPOINT_FAULT"
_STEP_DIR = re.compile(r"step-(\d+)$")
_LEFTOVER = re.compile(r"\.(tmp|old)-step-\d+-")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message names the file or tensor."""


def step_dir_name(step):
    return f"step-{step:08d}"


def shard_file_name(rank):
    return f"rank-{rank:05d}.safetensors"


def new_temp_dir(root, step):
    """A fresh ROOT/.tmp-step-N-<random> directory (ROOT is created if needed)."""
    os.makedirs(root, exist_ok=True)
    path = _unique(root, f".tmp-{step_dir_name(step)}")
    os.mkdir(path)
    return path


def file_record(path):
    """{"sha256", "bytes"} of the file at `path`, after fsyncing it to disk."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": size}


def write_json(path, value):
    """Write `value` as JSON to `path` and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def commit(root, temp, step):
    """Make the finished save in `temp` the checkpoint ROOT/step-N and point `latest` at it
    (rank 0 does this, after every rank's file is on disk)."""
    _fsync(temp)
    final = os.path.join(root, step_dir_name(step))
    old = None
    if os.path.exists(final):
        old = _unique(root, f".old-{step_dir_name(step)}")
        os.rename(final, old)
    os.rename(temp, final)
    _fsync(root)
    fault("renamed", 0)
    temp_latest = _unique(root, ".tmp-latest")
    with open(temp_latest, "x", encoding="utf-8") as f:
        f.write(step_dir_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp_latest, os.path.join(root, LATEST))
    _fsync(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def clean(root, keep_last, current):
    """Remove what failed saves left (temporary directories), and, with `keep_last`, every
    complete checkpoint but the `keep_last` highest steps and `current`. Run only after a
    save has committed."""
    for name in os.listdir(root):
        if _LEFTOVER.match(name) or name.startswith(".tmp-latest-"):
            _remove(os.path.join(root, name))
    if keep_last is None:
        return
    steps = sorted(complete_steps(root))
    for step in steps[:-keep_last]:
        if step != current:
            _remove(os.path.join(root, step_dir_name(step)))


def complete_steps(root):
    """The steps of ROOT's complete checkpoints (directories step-N holding an index)."""
    steps = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, INDEX)):
            steps.append(int(match.group(1)))
    return steps


def resolve(path):
    """The checkpoint directory `path` names: one holding an index itself, or a root whose
    `latest` names a complete one (else the root's newest complete step-N)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory: give a checkpoint root (the directory "
                              "save() wrote into) or one of its step-N directories")
    if os.path.isfile(os.path.join(path, INDEX)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            name = f.read().strip()
        if _STEP_DIR.match(name) and os.path.isfile(os.path.join(path, name, INDEX)):
            return os.path.join(path, name)
    steps = complete_steps(path)
    if not steps:
        raise CheckpointError(f"{path} is not a checkpoint: it holds no {INDEX}, no '{LATEST}' "
                              "naming a complete save, and no complete step-N directory")
    return os.path.join(path, step_dir_name(max(steps)))


def read_index(directory):
    """The index of the checkpoint in `directory`, checked to be one."""
    path = os.path.join(directory, INDEX)
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read as a checkpoint index: {err}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a cupytp checkpoint index (no format "
                              f"{FORMAT!r})")
    if index.get("version") not in READS:
        raise CheckpointError(f"{path} has format version {index.get('version')}; this cupytp "
                              f"reads versions {', '.join(map(str, READS))}")
    return index


def verify(directory, name, record):
    """Check that shard file `name` of `directory` has the size and sha256 the index gives."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"shard file {path} is missing (the index lists it)")
    size = os.path.getsize(path)
    if size != record["bytes"]:
        raise CheckpointError(f"shard file {path} has {size} bytes, the index says "
                              f"{record['bytes']}: the file is truncated or was replaced")
    if file_record(path)["sha256"] != record["sha256"]:
        raise CheckpointError(f"shard file {path} is corrupt: its sha256 does not match the "
                              "index")


def fault(point, rank):
    """Test hook: with CUPYTP_CHECKPOINT_FAULT="<rank>:<point>", global rank <rank> kills itself
    (SIGKILL) on reaching <point> of a save: "shard" (its shard file written and fsynced),
    "index" (rank 0: index written, not yet renamed) or "renamed" (rank 0: renamed, `latest`
    not yet updated)."""
    if env.get(FAULT_VARIABLE) == f"{rank}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync(path):
    """fsync a file or a directory (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unique(root, prefix):
    """ROOT/<prefix>-<random hex>: a name no other save uses."""
    return os.path.join(root, f"{prefix}-{secrets.token_hex(6)}")


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.remove(path)
