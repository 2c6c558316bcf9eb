"""HFTokenizer: a Hugging Face tokenizer.json (made here with the tokenizers package: a
byte-level BPE with Llama 3's end-of-text token) through get_tokenizer("hf"): encode and decode
round trip, the end-of-text id, errors named."""
import builtins
import json

import pytest

from cupytp.data.token_file import DataError
from cupytp.data.tokenizer import HFTokenizer, get_tokenizer

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 20


@pytest.fixture
def tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator([TEXT], trainer)
    path = tmp_path / "tokenizer.json"
    model.save(str(path))
    return path


def test_hf_tokenizer_round_trips(tokenizer_file):
    tokenizer = get_tokenizer("hf", path=tokenizer_file.parent, vocab_size=512)
    assert isinstance(tokenizer, HFTokenizer)
    ids = tokenizer.encode("Before we proceed, hear me.\n")
    assert len(ids) < len("Before we proceed, hear me.\n") and max(ids) < tokenizer.vocab_size
    assert tokenizer.decode(ids) == "Before we proceed, hear me.\n"
    assert tokenizer.eot_id == 1 and tokenizer.eot_id not in tokenizer.encode(TEXT)
    assert tokenizer.decode([tokenizer.eot_id]) == "<|end_of_text|>"
    assert tokenizer.name == HFTokenizer(tokenizer_file).name
    assert tokenizer.name.startswith(f"hf{tokenizer.vocab_size}-")
    assert HFTokenizer(tokenizer_file, eot_token="<|begin_of_text|>").eot_id == 0


def test_hf_tokenizer_errors(tokenizer_file, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="pass path"):
        get_tokenizer("hf")
    with pytest.raises(ValueError, match="more than the vocab_size of 100"):
        get_tokenizer("hf", path=tokenizer_file, vocab_size=100)
    with pytest.raises(DataError, match="does not exist"):
        HFTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(DataError, match="is not a Hugging Face tokenizer.json"):
        HFTokenizer(bad)
    with pytest.raises(DataError, match="no end-of-text token among <none>"):
        HFTokenizer(tokenizer_file, eot_token="<none>")
    real_import = builtins.__import__

    def no_tokenizers(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    with pytest.raises(DataError, match="pip install tokenizers"):
        HFTokenizer(tokenizer_file)
