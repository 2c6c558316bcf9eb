"""Train and validation tokens: a text corpus tokenized once per text and tokenizer (the token
files kept in a cache directory), or a directory of `.bin` token files (llm.c's shards, or
nanoGPT's train.bin / val.bin with its meta.pkl)."""
import glob
import hashlib
import json
import os
import re

import numpy as np

from cupytp.data.token_file import DataError, atomic_write, read_tokens, write_tokens
from cupytp.data.tokenizer import CharTokenizer

PREPARE_FORMAT = 1


def default_corpus_path():
    """The corpus shipped with the package: tiny Shakespeare (about 1 MB of text)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tinyshakespeare.txt")


def default_cache_dir():
    """Where `prepare_corpus` keeps token files by default: $XDG_CACHE_HOME/cupytp/tokens, else
    ~/.cache/cupytp/tokens."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "cupytp", "tokens")


def read_token_dir(directory):
    """(train tokens, val tokens, tokenizer or None) of a directory of `.bin` files: every
    *train*.bin, then every *val*.bin, in name order (llm.c's shards, or nanoGPT's train.bin and
    val.bin); the tokenizer is the character vocabulary of a nanoGPT meta.pkl beside them."""
    files = {split: sorted(glob.glob(os.path.join(directory, f"*{split}*.bin")))
             for split in ("train", "val")}
    if not files["train"] or not files["val"]:
        raise DataError(f"{directory} holds no *train*.bin and *val*.bin token files")
    train, val = (np.concatenate([read_tokens(f) for f in files[split]]) if len(files[split]) > 1
                  else read_tokens(files[split][0]) for split in ("train", "val"))
    meta = os.path.join(directory, "meta.pkl")
    return train, val, CharTokenizer.from_meta(meta) if os.path.isfile(meta) else None


def prepare_corpus(text_path, out_dir, tokenizer, val_fraction=0.1):
    """Tokenize `text_path` into (train_bin, val_bin) paths under `out_dir`.

    The first 1 - val_fraction of the tokens train, the rest validate. Files are named after the
    text and the tokenizer, and a sidecar JSON records the text's hash and the tokenizer's name:
    when both still match, the existing files are returned without tokenizing again.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    text_bytes = _read_corpus(text_path)
    stem = os.path.splitext(os.path.basename(text_path))[0]
    tokenizer_slug = re.sub(r"[^\w.-]", "_", tokenizer.name)
    prefix = os.path.join(out_dir, f"{stem}-{tokenizer_slug}")
    train_bin, val_bin, sidecar = f"{prefix}-train.bin", f"{prefix}-val.bin", f"{prefix}.json"
    key = {"format": PREPARE_FORMAT, "text_sha256": hashlib.sha256(text_bytes).hexdigest(),
           "tokenizer": tokenizer.name, "val_fraction": val_fraction}
    if _is_prepared(sidecar, key, train_bin, val_bin):
        return train_bin, val_bin

    text = _decode_corpus(text_path, text_bytes)
    tokens = np.asarray(tokenizer.encode(text))
    split_at = int(len(tokens) * (1 - val_fraction))
    if split_at == 0 or split_at == len(tokens):
        raise DataError(f"{text_path} gives {len(tokens)} tokens: too few to split into train "
                        f"and validation with val_fraction={val_fraction}")
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(sidecar):
        os.remove(sidecar)              # no sidecar may vouch for half-rewritten token files
    write_tokens(train_bin, tokens[:split_at])
    write_tokens(val_bin, tokens[split_at:])
    record = {**key, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
              "train_tokens": split_at, "val_tokens": len(tokens) - split_at}
    with atomic_write(sidecar, mode="w") as out:
        json.dump(record, out, indent=1)
    return train_bin, val_bin


def _read_corpus(text_path):
    try:
        with open(text_path, "rb") as file:
            text_bytes = file.read()
    except FileNotFoundError:
        raise DataError(f"text corpus {text_path} does not exist") from None
    except IsADirectoryError:
        raise DataError(f"text corpus {text_path} is a directory, not a text file") from None
    if not text_bytes.strip():
        raise DataError(f"text corpus {text_path} is empty")
    return text_bytes


def _decode_corpus(text_path, text_bytes):
    try:
        return text_bytes.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"text corpus {text_path} is not UTF-8 text: {err}") from None


def _is_prepared(sidecar, key, train_bin, val_bin):
    """Whether `sidecar` matches `key` and both token files hold the counts it records."""
    try:
        with open(sidecar, encoding="utf-8") as file:
            record = json.load(file)
        if {name: record[name] for name in key} != key:
            return False
        train_ok = len(read_tokens(train_bin)) == record["train_tokens"]
        return train_ok and len(read_tokens(val_bin)) == record["val_tokens"]
    except (OSError, ValueError, KeyError, TypeError):
        return False        # missing, stale or damaged: prepare again (DataError is a ValueError)
