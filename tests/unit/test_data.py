"""cupytp.data: token files, tokenizers, the batch loader and corpus preparation (CPU only)."""
import os
import random
import re
import sys
import types
from collections import Counter

import numpy as np
import pytest

from cupytp.data import (
    BPETokenizer,
    ByteTokenizer,
    DataError,
    TiktokenTokenizer,
    TokenLoader,
    default_corpus_path,
    get_tokenizer,
    prepare_corpus,
    read_tokens,
    write_tokens,
)
from cupytp.data import token_file
from cupytp.data.tokenizer import CHUNK_PATTERN


@pytest.fixture(scope="module")
def shakespeare():
    with open(default_corpus_path(), encoding="utf-8") as file:
        return file.read()


@pytest.fixture(scope="module")
def bpe(shakespeare):
    return BPETokenizer.train(shakespeare, 512)


def random_unicode(rng, length):
    """Text mixing ASCII, accents, combining marks, CJK, emoji, digits, controls and spaces."""
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xC0, 0x24F), (0x300, 0x36F), (0x391, 0x3C9),
              (0x4E00, 0x4FFF), (0x1F600, 0x1F64F), (0x660, 0x669), (0x2000, 0x200B)]
    chars = []
    for _ in range(length):
        low, high = rng.choice(ranges)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


# ---- token files -------------------------------------------------------------------------------

def test_token_file_round_trip(tmp_path):
    path = tmp_path / "tokens.bin"
    tokens = np.array([0, 1, 256, 50256, 65535, 7], dtype=np.int64)
    write_tokens(path, tokens)
    read = read_tokens(path)
    assert read.dtype == np.uint16 and read.shape == (6,)
    np.testing.assert_array_equal(read, tokens)
    with pytest.raises(ValueError):
        read[0] = 3                                   # read-only memmap
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [20240520, 1, 6]
    assert os.path.getsize(path) == 1024 + 2 * 6


def test_write_tokens_accepts_a_list_and_overwrites(tmp_path):
    path = tmp_path / "tokens.bin"
    write_tokens(path, [5, 6, 7, 8])
    write_tokens(path, [9])
    assert read_tokens(path).tolist() == [9]
    assert os.listdir(tmp_path) == ["tokens.bin"]   # no temp files left behind


@pytest.mark.parametrize("tokens, message", [
    ([1, 65536], "token id 65536 does not fit in uint16"),
    ([-1, 3], "token id -1 does not fit in uint16"),
    ([], "no tokens to write"),
    ([[1, 2], [3, 4]], "tokens must be 1-D"),
    ([1.5, 2.0], "must be integers"),
])
def test_write_tokens_rejects_bad_tokens(tmp_path, tokens, message):
    with pytest.raises(DataError, match=message):
        write_tokens(tmp_path / "tokens.bin", tokens)
    assert os.listdir(tmp_path) == []


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "tokens.bin"
    write_tokens(path, [1, 2, 3])

    def failing_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(token_file.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_tokens(path, [4, 5, 6, 7])
    monkeypatch.undo()
    assert read_tokens(path).tolist() == [1, 2, 3]
    assert os.listdir(tmp_path) == ["tokens.bin"]


def write_raw(path, header_values, num_token_bytes):
    header = np.zeros(256, dtype="<i4")
    header[:len(header_values)] = header_values
    path.write_bytes(header.tobytes() + bytes(num_token_bytes))
    return path


def test_read_tokens_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_tokens(tmp_path / "missing.bin")
    with pytest.raises(DataError, match="is not a regular file"):
        read_tokens(tmp_path)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        read_tokens(empty)
    short = tmp_path / "short.bin"
    short.write_bytes(np.array([20240520, 1, 2], "<i4").tobytes())
    with pytest.raises(DataError, match="shorter than the 1024-byte header"):
        read_tokens(short)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(bytes(7))
    with pytest.raises(DataError, match="neither llm.c's layout.*nor nanoGPT's.*odd number"):
        read_tokens(odd)
    with pytest.raises(DataError, match="version 2"):
        read_tokens(write_raw(tmp_path / "version.bin", [20240520, 2, 2], 4))
    with pytest.raises(DataError, match="holds no tokens"):
        read_tokens(write_raw(tmp_path / "zero.bin", [20240520, 1, 0], 0))
    with pytest.raises(DataError, match="counts 10 tokens.*truncated or corrupt"):
        read_tokens(write_raw(tmp_path / "truncated.bin", [20240520, 1, 10], 8))
    with pytest.raises(DataError, match="counts 2 tokens"):
        read_tokens(write_raw(tmp_path / "long.bin", [20240520, 1, 2], 6))


# ---- tokenizers --------------------------------------------------------------------------------

def test_byte_tokenizer():
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.eot_id, tokenizer.name) == (257, 256, "byte")
    text = "héllo, wörld 🙂"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([104, 105, 256]) == "hi<|endoftext|>"
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tokenizer.decode([257])


def test_bpe_round_trip_and_compression_on_shakespeare(bpe, shakespeare):
    assert (bpe.vocab_size, bpe.eot_id) == (512, 511)
    ids = bpe.encode(shakespeare)
    assert max(ids) < bpe.eot_id
    assert bpe.decode(ids) == shakespeare
    assert len(ids) < 0.6 * len(shakespeare.encode("utf-8"))
    assert bpe.decode([bpe.eot_id]) == "<|endoftext|>"


def test_bpe_round_trip_on_arbitrary_unicode_and_bytes(bpe):
    rng = random.Random(0)
    for _ in range(50):
        text = random_unicode(rng, rng.randint(0, 80))
        assert bpe.decode(bpe.encode(text)) == text
    for _ in range(50):
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 80)))
        text = raw.decode("utf-8", errors="surrogateescape")
        ids = bpe.encode(text)
        assert bpe.decode(ids, errors="surrogateescape") == text
        assert bpe.decode(ids, errors="surrogateescape").encode("utf-8", "surrogateescape") == raw


def test_bpe_decode_rejects_unknown_ids(bpe):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bpe.decode([512])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bpe.decode([-1])


def reference_merges(text, num_merges):
    """Naive BPE training: recount every pair after each merge; ties go to the smallest pair."""
    words = Counter(tuple(chunk.encode("utf-8")) for chunk in re.findall(CHUNK_PATTERN, text))
    merges = []
    for new_id in range(256, 256 + num_merges):
        pair_counts = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pair_counts[pair] += count
        if not pair_counts or max(pair_counts.values()) < 2:
            break
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merges.append(best)
        merged_words = Counter()
        for word, count in words.items():
            merged_words[tuple(reference_merge(list(word), best, new_id))] += count
        words = merged_words
    return merges


def reference_merge(ids, pair, new_id):
    """Replace `pair` left to right; a fresh new_id never equals pair[0], so no overlaps."""
    out = []
    for token_id in ids:
        if out and out[-1] == pair[0] and token_id == pair[1]:
            out[-1] = new_id
        else:
            out.append(token_id)
    return out


def test_bpe_training_matches_a_naive_reference(shakespeare):
    text = shakespeare[:20_000]
    tokenizer = BPETokenizer.train(text, 256 + 60 + 1)
    assert tokenizer.merges == reference_merges(text, 60)


def test_bpe_encode_applies_merges_in_training_order(bpe, shakespeare):
    text = shakespeare[-5000:] + " naïve café 🙂🙂 ___ 12345"
    expected = []
    for chunk in re.findall(CHUNK_PATTERN, text):
        ids = list(chunk.encode("utf-8"))
        for new_id, pair in enumerate(bpe.merges, start=256):
            ids = reference_merge(ids, pair, new_id)
        expected.extend(ids)
    assert bpe.encode(text) == expected


def test_bpe_stops_when_no_pair_repeats():
    tokenizer = BPETokenizer.train("abab", 1000)
    assert tokenizer.merges == [(97, 98)]
    assert tokenizer.vocab_size == 258
    assert tokenizer.encode("abab") == [256, 256]
    with pytest.raises(ValueError, match="at least 257"):
        BPETokenizer.train("abab", 200)


def test_bpe_save_load(bpe, tmp_path):
    path = tmp_path / "bpe.json"
    bpe.save(path)
    loaded = BPETokenizer.load(path)
    assert loaded.name == bpe.name and loaded.vocab_size == bpe.vocab_size
    text = "To be, or not to be: that is the question."
    assert loaded.encode(text) == bpe.encode(text)
    assert BPETokenizer.train("to be or not to be", 300).name != bpe.name


def test_bpe_load_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        BPETokenizer.load(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        BPETokenizer.load(broken)
    other = tmp_path / "other.json"
    other.write_text('{"merges": []}')
    with pytest.raises(DataError, match="not a cupytp-bpe tokenizer file"):
        BPETokenizer.load(other)
    incomplete = tmp_path / "incomplete.json"
    incomplete.write_text('{"format": "cupytp-bpe", "version": 1, "merges": [[1, 2]]}')
    with pytest.raises(DataError, match="lacks its merges list or pattern"):
        BPETokenizer.load(incomplete)
    with pytest.raises(DataError, match="must join two ids below 256"):
        BPETokenizer([(256, 1)])


def test_get_tokenizer(shakespeare):
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    tokenizer = get_tokenizer("bpe", corpus_text=shakespeare[:10_000], vocab_size=300)
    assert isinstance(tokenizer, BPETokenizer) and tokenizer.vocab_size == 300
    with pytest.raises(ValueError, match="pass corpus_text"):
        get_tokenizer("bpe")
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt3'.*byte, bpe, tiktoken"):
        get_tokenizer("gpt3")
    with pytest.raises(ValueError, match="fixed vocab_size of 257, not 512"):
        get_tokenizer("byte", vocab_size=512)


def test_tiktoken_missing_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(DataError, match="pip install tiktoken"):
        TiktokenTokenizer("gpt2")
    with pytest.raises(DataError, match="pip install tiktoken"):
        get_tokenizer("tiktoken")


def test_tiktoken_offline_is_one_line(monkeypatch):
    """Offline, tiktoken cannot download its BPE file: one line says so, not its traceback."""
    def offline(name):
        raise ConnectionError("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net')"
                              "\nMax retries exceeded")
    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=offline))
    with pytest.raises(DataError, match="'gpt2' encoding's BPE file.*ConnectionError.*"
                                        "TIKTOKEN_CACHE_DIR") as caught:
        get_tokenizer("tiktoken")
    assert "\n" not in str(caught.value) and caught.value.__cause__ is None


def test_tiktoken_wrapper_uses_ordinary_encoding(monkeypatch):
    class FakeEncoding:
        n_vocab = 50257
        eot_token = 50256

        def encode_ordinary(self, text):
            return [ord(char) for char in text]

        def decode(self, ids, errors="replace"):
            return "".join(chr(token_id) for token_id in ids)

    fake = types.SimpleNamespace(get_encoding=lambda name: FakeEncoding())
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    tokenizer = get_tokenizer("tiktoken")
    assert (tokenizer.vocab_size, tokenizer.eot_id, tokenizer.name) == (50257, 50256,
                                                                        "tiktoken-gpt2")
    assert tokenizer.decode(tokenizer.encode("abc")) == "abc"


# ---- loader ------------------------------------------------------------------------------------

def window_starts(x):
    """With tokens = arange(N), each row's first value is its window's start offset."""
    return x[:, 0].tolist()


def test_loader_shapes_and_shift():
    tokens = np.arange(1000)
    loader = TokenLoader(tokens, batch_size=4, seq_len=16, seed=1)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == np.int64
    assert x.flags.c_contiguous and y.flags.c_contiguous
    np.testing.assert_array_equal(y, x + 1)
    assert all(start % 16 == 0 for start in window_starts(x))


def test_loader_reads_a_token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    tokens = np.random.default_rng(0).integers(0, 65536, size=500)
    write_tokens(path, tokens)
    x, y = TokenLoader(path, batch_size=3, seq_len=10, shuffle=False).next_batch()
    np.testing.assert_array_equal(x, tokens[:30].reshape(3, 10))
    np.testing.assert_array_equal(y, tokens[1:31].reshape(3, 10))


def test_loader_needs_seq_len_plus_one_tokens(tmp_path):
    path = tmp_path / "tiny.bin"
    write_tokens(path, [1, 2, 3, 4, 5])
    with pytest.raises(DataError, match=re.escape(
            f"sequence length 8 needs at least 9 tokens; the file {path} has 5")):
        TokenLoader(path, batch_size=1, seq_len=8)
    loader = TokenLoader(path, batch_size=2, seq_len=4)          # exactly T+1: one window
    x, y = loader.next_batch()
    assert x.tolist() == [[1, 2, 3, 4]] * 2 and y.tolist() == [[2, 3, 4, 5]] * 2


def test_loader_argument_errors():
    with pytest.raises(ValueError, match="dp_rank 2 is not in 0..1"):
        TokenLoader(np.arange(100), batch_size=1, seq_len=4, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="must be positive"):
        TokenLoader(np.arange(100), batch_size=0, seq_len=4)


def test_loader_is_deterministic():
    tokens = np.arange(5000)
    first = TokenLoader(tokens, batch_size=4, seq_len=8, seed=3)
    second = TokenLoader(tokens, batch_size=4, seq_len=8, seed=3)
    other_seed = TokenLoader(tokens, batch_size=4, seq_len=8, seed=4)
    for _ in range(5):
        x1, y1 = first.next_batch()
        x2, y2 = second.next_batch()
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(first.batch_at(0)[0], other_seed.batch_at(0)[0])


def test_dp_ranks_partition_the_single_rank_batches():
    tokens = np.arange(50 * 8 + 1)                        # 50 windows: steps cross epochs
    single = TokenLoader(tokens, batch_size=6, seq_len=8, seed=7)
    ranks = [TokenLoader(tokens, batch_size=2, seq_len=8, dp_rank=rank, dp_size=3, seed=7)
             for rank in range(3)]
    tp_twin = TokenLoader(tokens, batch_size=2, seq_len=8, dp_rank=1, dp_size=3, seed=7)
    for _ in range(20):
        x_single, y_single = single.next_batch()
        per_rank = [loader.next_batch() for loader in ranks]
        np.testing.assert_array_equal(np.concatenate([x for x, _ in per_rank]), x_single)
        np.testing.assert_array_equal(np.concatenate([y for _, y in per_rank]), y_single)
        assert len({tuple(window_starts(x)) for x, _ in per_rank}) == 3
        np.testing.assert_array_equal(tp_twin.next_batch()[0], per_rank[1][0])


def test_each_epoch_visits_every_window_once_in_a_new_order():
    tokens = np.arange(40 * 4 + 1)                        # 40 windows of 4 (+1) tokens
    loader = TokenLoader(tokens, batch_size=5, seq_len=4, seed=0)
    epochs = []
    for _ in range(3):
        starts = [start for _ in range(8) for start in window_starts(loader.next_batch()[0])]
        assert sorted(starts) == list(range(0, 160, 4))
        epochs.append(starts)
    assert epochs[0] != epochs[1] != epochs[2]
    in_order = TokenLoader(tokens, batch_size=5, seq_len=4, shuffle=False)
    assert window_starts(in_order.batch_at(1)[0]) == [20, 24, 28, 32, 36]
    assert window_starts(in_order.batch_at(8)[0]) == [0, 4, 8, 12, 16]


def test_val_batches_are_fixed_and_step_resumes():
    loader = TokenLoader(np.arange(2000), batch_size=4, seq_len=8, seed=5)
    before = [x for x, _ in loader.val_batches(3)]
    trained = [loader.next_batch()[0] for _ in range(7)]
    after = [x for x, _ in loader.val_batches(3)]
    for x_before, x_after, x_trained in zip(before, after, trained):
        np.testing.assert_array_equal(x_before, x_after)
        np.testing.assert_array_equal(x_before, x_trained)
    resumed = TokenLoader(np.arange(2000), batch_size=4, seq_len=8, seed=5)
    resumed.step = 7
    np.testing.assert_array_equal(resumed.next_batch()[0], loader.next_batch()[0])


def test_loader_state_resumes_the_stream_on_another_dp_size():
    tokens = np.arange(30 * 8 + 1)                        # 30 windows: resumes across epochs
    single = TokenLoader(tokens, batch_size=4, seq_len=8, seed=2)
    for _ in range(9):
        single.next_batch()
    state = single.state_dict()
    assert state["windows"] == 36
    halves = [TokenLoader(tokens, batch_size=2, seq_len=8, dp_rank=r, dp_size=2, seed=2)
              for r in range(2)]
    for half in halves:
        half.load_state_dict(state)
    expected = single.next_batch()[0]
    np.testing.assert_array_equal(np.concatenate([h.next_batch()[0] for h in halves]), expected)
    with pytest.raises(ValueError, match=r"seed \(2 saved, 3 now\)"):
        TokenLoader(tokens, batch_size=4, seq_len=8, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="not a whole number of global batches of 8"):
        TokenLoader(tokens, batch_size=8, seq_len=8, seed=2).load_state_dict(state)


# ---- corpus preparation ------------------------------------------------------------------------

class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting how often it encodes."""

    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


def test_default_corpus_is_shakespeare(shakespeare):
    assert os.path.isfile(default_corpus_path())
    assert shakespeare.startswith("First Citizen:")
    assert len(shakespeare) > 1_000_000


def test_prepare_splits_and_reuses(tmp_path):
    text_path = tmp_path / "corpus.txt"
    text = "All the world's a stage, and all the men and women merely players. " * 20
    text_path.write_text(text, encoding="utf-8")
    tokenizer = CountingTokenizer()
    train_bin, val_bin = prepare_corpus(text_path, tmp_path / "out", tokenizer)
    train, val = read_tokens(train_bin), read_tokens(val_bin)
    assert len(train) == int(len(text) * 0.9) and len(train) + len(val) == len(text)
    assert tokenizer.decode(np.concatenate([train, val]).tolist()) == text
    assert os.path.basename(train_bin) == "corpus-byte-train.bin"

    assert prepare_corpus(text_path, tmp_path / "out", tokenizer) == (train_bin, val_bin)
    assert tokenizer.calls == 1                                   # reused, not re-tokenized

    prepare_corpus(text_path, tmp_path / "out", tokenizer, val_fraction=0.5)
    assert tokenizer.calls == 2 and len(read_tokens(val_bin)) == len(text) // 2

    text_path.write_text(text + "Exit.", encoding="utf-8")       # the text changed
    prepare_corpus(text_path, tmp_path / "out", tokenizer, val_fraction=0.5)
    assert tokenizer.calls == 3
    assert len(read_tokens(train_bin)) + len(read_tokens(val_bin)) == len(text) + 5


def test_prepare_redoes_damaged_files(tmp_path):
    text_path = tmp_path / "corpus.txt"
    text_path.write_text("Now is the winter of our discontent. " * 10, encoding="utf-8")
    tokenizer = CountingTokenizer()
    train_bin, _ = prepare_corpus(text_path, tmp_path, tokenizer)
    with open(train_bin, "r+b") as file:
        file.truncate(1030)
    prepare_corpus(text_path, tmp_path, tokenizer)
    assert tokenizer.calls == 2
    assert len(read_tokens(train_bin)) == int(370 * 0.9)


def test_prepare_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare_corpus(tmp_path / "missing.txt", tmp_path, ByteTokenizer())
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="is empty"):
        prepare_corpus(empty, tmp_path, ByteTokenizer())
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        prepare_corpus(latin1, tmp_path, ByteTokenizer())
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x")
    with pytest.raises(DataError, match="too few to split"):
        prepare_corpus(tiny, tmp_path, ByteTokenizer())
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_corpus(tiny, tmp_path, ByteTokenizer(), val_fraction=1.0)


def test_shakespeare_to_batches_with_bpe(bpe, tmp_path):
    train_bin, val_bin = prepare_corpus(default_corpus_path(), tmp_path, bpe)
    loader = TokenLoader(train_bin, batch_size=8, seq_len=64, seed=0)
    x, y = loader.next_batch()
    assert x.shape == (8, 64) and int(x.max()) < bpe.vocab_size
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    val_x, _ = next(TokenLoader(val_bin, batch_size=2, seq_len=64, shuffle=False).val_batches(1))
    assert bpe.decode(val_x[0].tolist()) in bpe.decode(read_tokens(val_bin).tolist())


# ---- nanoGPT's files, random windows --------------------------------------------------------------


def nanogpt_char_dir(directory, text):
    """What nanoGPT's data/shakespeare_char/prepare.py writes: headerless uint16 train.bin and
    val.bin (90% / 10%) and meta.pkl with the character vocabulary."""
    import pickle
    chars = sorted(set(text))
    stoi, itos = {ch: i for i, ch in enumerate(chars)}, dict(enumerate(chars))
    ids = np.array([stoi[ch] for ch in text], dtype=np.uint16)
    split = int(len(ids) * 0.9)
    directory.mkdir(parents=True, exist_ok=True)
    ids[:split].tofile(directory / "train.bin")
    ids[split:].tofile(directory / "val.bin")
    with open(directory / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return ids, split, chars


def test_nanogpt_bin_files_and_meta_pkl_read(tmp_path, shakespeare):
    from cupytp.data import CharTokenizer, read_token_dir
    text = shakespeare[:20000]
    ids, split, chars = nanogpt_char_dir(tmp_path, text)
    train, val, tokenizer = read_token_dir(tmp_path)
    np.testing.assert_array_equal(train, ids[:split])
    np.testing.assert_array_equal(val, ids[split:])
    assert isinstance(tokenizer, CharTokenizer) and tokenizer.vocab_size == len(chars)
    assert tokenizer.decode(train[:500].tolist()) == text[:500]
    assert tokenizer.encode(text[:50]) == ids[:50].tolist()
    with pytest.raises(ValueError, match="'€' is not in the"):
        tokenizer.encode("€")
    (tmp_path / "meta.pkl").unlink()               # llm.c-style shards keep working beside them
    write_tokens(tmp_path / "train_002.bin", [1, 2, 3])   # after train.bin
    train, _, tokenizer = read_token_dir(tmp_path)
    assert tokenizer is None and train[-3:].tolist() == [1, 2, 3]
    assert len(train) == split + 3


def test_meta_pkl_runs_no_code(tmp_path):
    import pickle
    from cupytp.data import CharTokenizer
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"itos": {0: "a"}, "hook": os.system}, f)
    with pytest.raises(DataError, match="not a nanoGPT meta.pkl of plain values: it names"):
        CharTokenizer.from_meta(tmp_path / "meta.pkl")
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 3, "itos": {0: "a", 1: "b"}}, f)
    with pytest.raises(DataError, match="says vocab_size 3 but its itos holds 2"):
        CharTokenizer.from_meta(tmp_path / "meta.pkl")


def test_random_windows_follow_nanogpts_get_batch():
    """sampling="random": each step's B·dp windows start at offsets drawn uniformly from
    0..N-T-1 (nanoGPT's torch.randint(len(data) - block_size, (batch_size,))); x = data[i:i+T],
    y = data[i+1:i+1+T]; dp rank r gets the r-th block of them."""
    tokens = np.arange(1000, dtype=np.uint16) * 7 % 997
    B, T, dp, seed = 3, 16, 2, 5
    loaders = [TokenLoader(tokens, B, T, r, dp, seed, sampling="random") for r in range(dp)]
    for step in range(4):
        offsets = np.random.default_rng((seed, step)).integers(0, tokens.size - T, B * dp)
        x_ref = np.stack([tokens[i:i + T] for i in offsets]).astype(np.int64)
        y_ref = np.stack([tokens[i + 1:i + 1 + T] for i in offsets]).astype(np.int64)
        x = np.concatenate([loader.next_batch()[0] for loader in loaders[:1]] +
                           [loader.batch_at(step)[0] for loader in loaders[1:]])
        np.testing.assert_array_equal(x, x_ref)
        np.testing.assert_array_equal(np.concatenate([l.batch_at(step)[1] for l in loaders]),
                                      y_ref)
    short = np.arange(T + 1, dtype=np.uint16)         # one window fits: offset 0 alone
    x, y = TokenLoader(short, 2, T, sampling="random").next_batch()
    np.testing.assert_array_equal(x, [short[:T]] * 2)
    np.testing.assert_array_equal(y, [short[1:]] * 2)


def test_random_sampling_resumes_and_is_part_of_the_stream():
    tokens = np.arange(500, dtype=np.uint16)
    loader = TokenLoader(tokens, 2, 8, sampling="random", seed=1)
    for _ in range(3):
        loader.next_batch()
    resumed = TokenLoader(tokens, 4, 8, sampling="random", seed=1)     # a global batch of 4
    with pytest.raises(ValueError, match="not a whole number of global batches of 4"):
        resumed.load_state_dict(loader.state_dict())
    again = TokenLoader(tokens, 1, 8, 1, 2, sampling="random", seed=1)
    again.load_state_dict(loader.state_dict())
    np.testing.assert_array_equal(again.next_batch()[0], loader.next_batch()[0][1:])
    with pytest.raises(ValueError, match=r"sampling \(random saved, epoch now\)"):
        TokenLoader(tokens, 2, 8, seed=1).load_state_dict(loader.state_dict())


def test_a_token_outside_the_vocabulary_is_named():
    loader = TokenLoader(np.array([1, 2, 3, 4, 300, 6], np.uint16), 1, 2, shuffle=False,
                         vocab_size=257)
    loader.next_batch()
    with pytest.raises(DataError, match="token id 300 in the token array is outside the "
                                        "vocabulary of 257"):
        loader.next_batch()
