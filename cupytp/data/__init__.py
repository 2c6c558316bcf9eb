"""Data for training: tokenizers, `.bin` token files (llm.c's and nanoGPT's), the batch loader
and corpus preparation."""
from cupytp.data.loader import TokenLoader
from cupytp.data.prepare import (
    default_cache_dir, default_corpus_path, prepare_corpus, read_token_dir)
from cupytp.data.token_file import DataError, read_tokens, write_tokens
from cupytp.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    get_tokenizer,
)

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "CharTokenizer",
    "DataError",
    "TiktokenTokenizer",
    "TokenLoader",
    "Tokenizer",
    "default_cache_dir",
    "default_corpus_path",
    "get_tokenizer",
    "prepare_corpus",
    "read_token_dir",
    "read_tokens",
    "write_tokens",
]
