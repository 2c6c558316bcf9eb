"""Data for training: tokenizers, `.bin` token files, the batch loader and corpus preparation."""
from cupytp.data.loader import TokenLoader
from cupytp.data.prepare import default_corpus_path, prepare_corpus
from cupytp.data.token_file import DataError, read_tokens, write_tokens
from cupytp.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    get_tokenizer,
)

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "DataError",
    "TiktokenTokenizer",
    "TokenLoader",
    "Tokenizer",
    "default_corpus_path",
    "get_tokenizer",
    "prepare_corpus",
    "read_tokens",
    "write_tokens",
]
