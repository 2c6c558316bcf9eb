"""Token files in llm.c's and nanoGPT's `.bin` layouts, and the error every data module raises.

llm.c (what `write_tokens` writes): a header of 256 little-endian int32 (header[0] = 20240520
magic, header[1] = 1 version, header[2] = number of tokens), then the tokens as little-endian
uint16. nanoGPT (its prepare.py's `train.bin` / `val.bin`): the uint16 tokens alone, no header.
`read_tokens` tells them apart by the magic: as a uint16 pair it would be tokens 56392 and 308,
and 56392 is past GPT-2's vocabulary (50257), so no nanoGPT file of a vocabulary that size
starts with it.
"""
import contextlib
import os
import tempfile

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKEN_ID = np.iinfo(np.uint16).max          # 65535: ids are stored as uint16
MAX_TOKENS = np.iinfo(np.int32).max             # the count lives in one int32 header slot


class DataError(ValueError):
    """A corpus, token file or tokenizer file that cannot be used, and why."""


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Yield a temp file beside `path`; on a clean exit it replaces `path` in one step.

    A crash or an exception leaves any file already at `path` untouched, and readers that
    memory-mapped the old file keep reading the old bytes.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                    suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as tmp_file:
            yield tmp_file
            tmp_file.flush()
            os.fsync(tmp_file.fileno())
        os.chmod(tmp_path, 0o644)            # mkstemp creates 0600; a data file is for everyone
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
        raise


def write_tokens(path, tokens):
    """Write a 1-D sequence of integer token ids (each < 65536) to `path`, atomically."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise DataError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size == 0:
        raise DataError(f"no tokens to write to {path}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"token ids must be integers, got dtype {tokens.dtype}")
    if tokens.size > MAX_TOKENS:
        raise DataError(f"{tokens.size} tokens do not fit one file (at most {MAX_TOKENS})")
    smallest, largest = int(tokens.min()), int(tokens.max())
    if smallest < 0 or largest > MAX_TOKEN_ID:
        bad = smallest if smallest < 0 else largest
        raise DataError(f"token id {bad} does not fit in uint16: the .bin format needs ids in "
                        f"0..{MAX_TOKEN_ID} (a vocabulary of at most {MAX_TOKEN_ID + 1})")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = MAGIC
    header[1] = VERSION
    header[2] = tokens.size
    with atomic_write(path) as out:
        out.write(header.tobytes())
        out.write(tokens.astype("<u2").tobytes())


def read_tokens(path):
    """Memory-map the tokens of a `.bin` file, llm.c's (with its header) or nanoGPT's (headerless
    uint16): a read-only uint16 np.memmap of shape (N,)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"token file {path} does not exist")
    if not os.path.isfile(path):
        raise DataError(f"token file {path} is not a regular file")
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"token file {path} is empty")
    if size < 4 or int(np.fromfile(path, dtype="<i4", count=1)[0]) != MAGIC:
        return _read_headerless(path, size)
    if size < HEADER_BYTES:
        raise DataError(f"token file {path} is {size} bytes, shorter than the "
                        f"{HEADER_BYTES}-byte header its magic number announces")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    version, count = (int(value) for value in header[1:3])
    if version != VERSION:
        raise DataError(f"token file {path} has version {version}; only version {VERSION} "
                        f"(uint16 tokens) is supported")
    if count <= 0:
        raise DataError(f"token file {path} holds no tokens (header count {count})")
    expected_size = HEADER_BYTES + 2 * count
    if size != expected_size:
        raise DataError(f"token file {path} is {size} bytes but its header counts {count} "
                        f"tokens ({expected_size} bytes): the file is truncated or corrupt")
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))


def _read_headerless(path, size):
    """nanoGPT's layout: the whole file is uint16 tokens."""
    if size % 2:
        raise DataError(f"token file {path} is {size} bytes: neither llm.c's layout (it lacks the "
                        f"magic number {MAGIC}) nor nanoGPT's headerless uint16 tokens (an odd "
                        "number of bytes)")
    return np.memmap(path, dtype="<u2", mode="r", shape=(size // 2,))
