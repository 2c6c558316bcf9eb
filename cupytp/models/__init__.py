"""Models built from cupytp.nn: GPT-2 and the Llama family, and a registry of them by name."""
from cupytp.models.gpt2 import GPT2, GPT2Config, PRESETS, preset
from cupytp.models.llama import Llama, LlamaConfig
from cupytp.models.registry import MODEL_NAMES, ModelSpec, model_spec

__all__ = ["GPT2", "GPT2Config", "PRESETS", "preset", "Llama", "LlamaConfig", "MODEL_NAMES",
           "ModelSpec", "model_spec"]
