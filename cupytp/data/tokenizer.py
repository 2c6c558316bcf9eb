"""Tokenizers that need no download: bytes, a byte-level BPE trained here, nanoGPT's character
vocabularies (its `meta.pkl`), and tiktoken's GPT-2; and a Hugging Face tokenizer.json (Llama
3's, Qwen2's, ...) through the `tokenizers` package.

Every tokenizer has `encode(str) -> list[int]`, `decode(list[int]) -> str`, `vocab_size`, `eot_id`
and `name`. `encode` treats its whole input as text: it never emits the end-of-text id, which the
caller inserts between documents. Strings carry raw bytes through "surrogateescape": the byte
and BPE tokenizers encode every such string, and `decode(ids, errors="surrogateescape")` gives
it back.
"""
import hashlib
import heapq
import io
import json
import os
import pickle
import re
from collections import Counter, defaultdict
from typing import Protocol

from cupytp.data.token_file import DataError, atomic_write

EOT_TEXT = "<|endoftext|>"
BYTE_VOCAB = 256

# GPT-2's pre-tokenizer split, in the standard `re` dialect: contractions; runs of letters, of
# digits, of other symbols (each optionally after one space); runs of whitespace. Merges never cross
# these chunks, so " the" can become one token but "e t" never does.
CHUNK_PATTERN = (
    r"'(?:[sdmt]|ll|ve|re)"
    r"| ?[^\W\d_]+"
    r"| ?\d+"
    r"| ?(?:[^\s\w]|_)+"
    r"|\s+(?!\S)"
    r"|\s+"
)
BPE_FILE_FORMAT = "cupytp-bpe"
BPE_FILE_VERSION = 1
_CHUNK_CACHE_SIZE = 1 << 16


class Tokenizer(Protocol):
    """What every tokenizer here offers."""

    name: str
    vocab_size: int
    eot_id: int | None          # None: the vocabulary has no end-of-text token

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], errors: str = "replace") -> str: ...


def _text_bytes(text):
    return text.encode("utf-8", errors="surrogateescape")


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255) and an end-of-text id 256: vocab_size 257."""

    name = "byte"
    vocab_size = BYTE_VOCAB + 1
    eot_id = BYTE_VOCAB

    def encode(self, text):
        return list(_text_bytes(text))

    def decode(self, ids, errors="replace"):
        pieces = []
        for token_id in ids:
            if token_id == self.eot_id:
                pieces.append(EOT_TEXT.encode())
            elif 0 <= token_id < BYTE_VOCAB:
                pieces.append(bytes((token_id,)))
            else:
                raise ValueError(f"token id {token_id} is outside the byte vocabulary "
                                 f"(size {self.vocab_size})")
        return b"".join(pieces).decode("utf-8", errors=errors)


def _merge_pair(ids, pair, new_id):
    """`ids` with each non-overlapping occurrence of `pair`, left to right, made `new_id`."""
    merged = []
    i = 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            merged.append(new_id)
            i += 2
        else:
            merged.append(ids[i])
            i += 1
    return merged


def _learn_merges(chunk_counts, num_merges):
    """Up to `num_merges` merges, most frequent pair first, learned from {chunk bytes: count}.

    Pair counts are kept up to date incrementally: a merge only revisits the chunks that hold the
    merged pair, and a heap with lazily discarded stale entries finds the next best pair. Ties go
    to the smallest pair, so training is deterministic. Stops early when no pair occurs twice.
    """
    words = [list(chunk) for chunk in chunk_counts]
    counts = list(chunk_counts.values())
    pair_counts = Counter()
    words_with_pair = defaultdict(set)
    for index, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += counts[index]
            words_with_pair[pair].add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    merges = []
    while len(merges) < num_merges and heap:
        negative_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative_count:
            continue                                    # stale: the count changed since the push
        if -negative_count < 2:
            break
        new_id = BYTE_VOCAB + len(merges)
        merges.append(pair)
        changed = set()
        for index in words_with_pair.pop(pair):
            word, count = words[index], counts[index]
            for old_pair in zip(word, word[1:]):
                pair_counts[old_pair] -= count
                changed.add(old_pair)
            word = _merge_pair(word, pair, new_id)
            for new_pair in zip(word, word[1:]):
                pair_counts[new_pair] += count
                words_with_pair[new_pair].add(index)
                changed.add(new_pair)
            words[index] = word
        del pair_counts[pair]
        changed.discard(pair)
        for changed_pair in changed:
            if pair_counts[changed_pair] > 0:
                heapq.heappush(heap, (-pair_counts[changed_pair], changed_pair))
    return merges


class BPETokenizer:
    """Byte-level BPE: ids 0..255 are bytes, 256.. are merges in training order, then end-of-text.

    `merges[i] = (a, b)` makes token 256 + i from tokens a and b; eot_id = vocab_size - 1.
    """

    def __init__(self, merges, pattern=CHUNK_PATTERN):
        self.merges = [tuple(pair) for pair in merges]
        self.pattern = pattern
        self._chunk_regex = re.compile(pattern)
        self._token_bytes = [bytes((byte,)) for byte in range(BYTE_VOCAB)]
        self._merge_ids = {}
        for pair in self.merges:
            new_id = len(self._token_bytes)
            if len(pair) != 2 or not all(0 <= token_id < new_id for token_id in pair):
                raise DataError(f"merge {new_id - BYTE_VOCAB} = {pair} must join two ids "
                                f"below {new_id}")
            self._merge_ids[pair] = new_id
            self._token_bytes.append(self._token_bytes[pair[0]] + self._token_bytes[pair[1]])
        self.eot_id = len(self._token_bytes)
        self._token_bytes.append(EOT_TEXT.encode())
        self.vocab_size = len(self._token_bytes)
        digest = hashlib.sha256(json.dumps([pattern, self.merges]).encode()).hexdigest()
        self.name = f"bpe{self.vocab_size}-{digest[:12]}"
        self._chunk_cache = {}

    @classmethod
    def train(cls, text, vocab_size, pattern=CHUNK_PATTERN):
        """Learn merges from `text` until the vocabulary (bytes + merges + eot) has `vocab_size`.

        The vocabulary comes out smaller when the text runs out of pairs that occur twice.
        """
        if vocab_size < BYTE_VOCAB + 1:
            raise ValueError(f"a byte-level BPE vocabulary needs at least {BYTE_VOCAB + 1} ids "
                             f"(256 bytes and end-of-text), got vocab_size={vocab_size}")
        chunk_counts = Counter(re.findall(pattern, text))
        byte_counts = Counter()
        for chunk, count in chunk_counts.items():
            byte_counts[_text_bytes(chunk)] += count
        return cls(_learn_merges(byte_counts, vocab_size - BYTE_VOCAB - 1), pattern)

    def encode(self, text):
        ids = []
        for chunk in self._chunk_regex.findall(text):
            ids.extend(self._encode_chunk(chunk))
        return ids

    def decode(self, ids, errors="replace"):
        pieces = []
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary "
                                 f"(size {self.vocab_size})")
            pieces.append(self._token_bytes[token_id])
        return b"".join(pieces).decode("utf-8", errors=errors)

    def _encode_chunk(self, chunk):
        ids = self._chunk_cache.get(chunk)
        if ids is None:
            ids = self._apply_merges(list(_text_bytes(chunk)))
            if len(self._chunk_cache) >= _CHUNK_CACHE_SIZE:
                self._chunk_cache.clear()
            self._chunk_cache[chunk] = ids
        return ids

    def _apply_merges(self, ids):
        """Merge the earliest-learned pair present until none applies: training's order."""
        while len(ids) >= 2:
            pair = min(zip(ids, ids[1:]), key=lambda p: self._merge_ids.get(p, self.vocab_size))
            new_id = self._merge_ids.get(pair)
            if new_id is None:
                break
            ids = _merge_pair(ids, pair, new_id)
        return ids

    def save(self, path):
        """Write the merges and the chunk pattern as JSON (atomically)."""
        state = {"format": BPE_FILE_FORMAT, "version": BPE_FILE_VERSION,
                 "pattern": self.pattern, "merges": [list(pair) for pair in self.merges]}
        with atomic_write(path, mode="w") as out:
            json.dump(state, out)

    @classmethod
    def load(cls, path):
        """The tokenizer saved at `path` by `save`."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as file:
                state = json.load(file)
        except FileNotFoundError:
            raise DataError(f"BPE tokenizer file {path} does not exist") from None
        except json.JSONDecodeError as err:
            raise DataError(f"BPE tokenizer file {path} is not valid JSON: {err}") from None
        if not isinstance(state, dict) or state.get("format") != BPE_FILE_FORMAT:
            raise DataError(f"{path} is not a {BPE_FILE_FORMAT} tokenizer file")
        if state.get("version") != BPE_FILE_VERSION:
            raise DataError(f"BPE tokenizer file {path} has version {state.get('version')}; "
                            f"only version {BPE_FILE_VERSION} is supported")
        if not isinstance(state.get("merges"), list) or not isinstance(state.get("pattern"), str):
            raise DataError(f"BPE tokenizer file {path} lacks its merges list or pattern")
        return cls(state["merges"], state["pattern"])


class CharTokenizer:
    """One token per character of a fixed vocabulary: nanoGPT's shakespeare_char `meta.pkl`
    ({"vocab_size": V, "itos": {id: char}, "stoi": {char: id}}). It has no end-of-text id
    (eot_id None)."""

    eot_id = None

    def __init__(self, itos):
        self.itos = {int(i): str(ch) for i, ch in itos.items()}
        if sorted(self.itos) != list(range(len(self.itos))):
            raise DataError("a character vocabulary needs ids 0..V-1, each once")
        self.stoi = {ch: i for i, ch in self.itos.items()}
        self.vocab_size = len(self.itos)
        text = "".join(self.itos[i] for i in range(self.vocab_size))
        self.name = f"char{self.vocab_size}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"

    @classmethod
    def from_meta(cls, path):
        """The vocabulary of a nanoGPT `meta.pkl`. Only plain values are unpickled (no code a
        pickle could name runs)."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as file:
                meta = _PlainUnpickler(io.BytesIO(file.read())).load()
        except FileNotFoundError:
            raise DataError(f"vocabulary file {path} does not exist") from None
        except (pickle.UnpicklingError, EOFError, ValueError) as err:
            raise DataError(f"{path} is not a nanoGPT meta.pkl of plain values: {err}") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("itos"), dict):
            raise DataError(f"{path} holds no 'itos' vocabulary (nanoGPT's meta.pkl has "
                            "vocab_size, itos and stoi)")
        tokenizer = cls(meta["itos"])
        if meta.get("vocab_size", tokenizer.vocab_size) != tokenizer.vocab_size:
            raise DataError(f"{path} says vocab_size {meta['vocab_size']} but its itos holds "
                            f"{tokenizer.vocab_size} characters")
        return tokenizer

    def encode(self, text):
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the {self.vocab_size}-character "
                             "vocabulary") from None

    def decode(self, ids, errors="replace"):
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary "
                                 f"(size {self.vocab_size})")
        return "".join(self.itos[token_id] for token_id in ids)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numbers; any class or function is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}")


class TiktokenTokenizer:
    """A tiktoken encoding, GPT-2's by default: vocab_size 50257, eot_id 50256.

    Needs the tiktoken package and the encoding's BPE file, which tiktoken downloads on first
    use and caches (TIKTOKEN_CACHE_DIR); without either, one DataError says which is missing.
    """

    def __init__(self, encoding_name="gpt2"):
        try:
            import tiktoken
        except ImportError:
            raise DataError("the tiktoken tokenizer needs the tiktoken package: pip install "
                            "tiktoken") from None
        try:
            self._encoding = tiktoken.get_encoding(encoding_name)
        except Exception as err:   # offline: requests' or urllib's own error types
            raise DataError(f"tiktoken could not load the {encoding_name!r} encoding's BPE file "
                            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                            "): it is downloaded on first use; connect once, or copy a cache "
                            "and point TIKTOKEN_CACHE_DIR at it") from None
        self.name = f"tiktoken-{encoding_name}"
        self.vocab_size = self._encoding.n_vocab
        self.eot_id = self._encoding.eot_token

    def encode(self, text):
        return self._encoding.encode_ordinary(text)

    def decode(self, ids, errors="replace"):
        return self._encoding.decode(ids, errors=errors)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (a file, or a checkpoint directory holding one) through
    the `tokenizers` package (an optional extra: pip install tokenizers).

    `encode` adds no special tokens; `eot_id` is the end-of-text token's id: `eot_token`'s when
    given, else the first of END_OF_TEXT the tokenizer knows. `decode` gives tokenizers' text
    (bytes that are no UTF-8 come out as U+FFFD whatever `errors` says). `vocab_size` counts the
    added tokens; a model's vocabulary may be larger (padded), not smaller.
    """

    END_OF_TEXT = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|im_end|>", "<eos>")

    def __init__(self, path, eot_token=None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("a Hugging Face tokenizer.json needs the tokenizers package: pip "
                            "install tokenizers") from None
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        try:
            with open(path, "rb") as file:
                digest = hashlib.sha256(file.read()).hexdigest()
            self._tokenizer = Tokenizer.from_file(path)
        except FileNotFoundError:
            raise DataError(f"tokenizer file {path} does not exist") from None
        except Exception as err:    # tokenizers raises its own exception type
            raise DataError(f"{path} is not a Hugging Face tokenizer.json: {err}") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        names = (eot_token,) if eot_token else self.END_OF_TEXT
        ids = [self._tokenizer.token_to_id(token) for token in names]
        if all(i is None for i in ids):
            raise DataError(f"{path} has no end-of-text token among {', '.join(names)}: name "
                            "it with eot_token=")
        self.eot_id = next(i for i in ids if i is not None)
        self.name = f"hf{self.vocab_size}-{digest[:12]}"

    def encode(self, text):
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids, errors="replace"):
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


TOKENIZER_NAMES = ("byte", "bpe", "tiktoken", "hf")
DEFAULT_BPE_VOCAB = 512


def get_tokenizer(name, corpus_text=None, vocab_size=None, path=None):
    """The tokenizer called `name`: "byte", "bpe" (trained on `corpus_text`), "tiktoken" or
    "hf" (the tokenizer.json at `path`).

    `vocab_size` sets the BPE vocabulary (default 512); for the fixed vocabularies it is only
    checked (for "hf": the tokenizer's ids must fit it).
    """
    if name == "bpe":
        if corpus_text is None:
            raise ValueError("the 'bpe' tokenizer is trained here: pass corpus_text")
        return BPETokenizer.train(corpus_text, vocab_size or DEFAULT_BPE_VOCAB)
    if name == "byte":
        tokenizer = ByteTokenizer()
    elif name == "tiktoken":
        tokenizer = TiktokenTokenizer("gpt2")
    elif name == "hf":
        if path is None:
            raise ValueError("the 'hf' tokenizer reads a tokenizer.json: pass path")
        tokenizer = HFTokenizer(path)
        if vocab_size is not None and tokenizer.vocab_size > vocab_size:
            raise ValueError(f"the tokenizer at {path} has {tokenizer.vocab_size} ids, more "
                             f"than the vocab_size of {vocab_size}")
        return tokenizer
    else:
        raise ValueError(f"unknown tokenizer {name!r}: choose one of {', '.join(TOKENIZER_NAMES)}")
    if vocab_size is not None and vocab_size != tokenizer.vocab_size:
        raise ValueError(f"the {name!r} tokenizer has a fixed vocab_size of "
                         f"{tokenizer.vocab_size}, not {vocab_size}")
    return tokenizer
