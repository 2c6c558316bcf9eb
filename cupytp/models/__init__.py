"""Models built from cupytp.nn."""
from cupytp.models.gpt2 import GPT2, GPT2Config, PRESETS, preset

__all__ = ["GPT2", "GPT2Config", "PRESETS", "preset"]
