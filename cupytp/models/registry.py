"""Models by name, for training scripts (`--model llama-1B`): `model_spec(name)` gives the
family, the config, the model class and the tokenizer its vocabulary needs.

Names are "<family>-<preset>": gpt2-tiny, gpt2-124M, gpt2-350M, gpt2-774M, gpt2-1558M,
llama-tiny, llama-125M, llama-1B, llama-1.5B, llama-8B (`MODEL_NAMES`); a GPT-2 preset's bare
name ("tiny", "124M", ...) is GPT-2's. The tokenizer: "byte" for a 257-id vocabulary (the tiny
models), "tiktoken" for GPT-2's 50257, "hf" (a Hugging Face tokenizer.json with at most
vocab_size ids: Llama 3's for 128256) for the others.
"""
from dataclasses import dataclass, replace

from cupytp.models import gpt2, llama

FAMILIES = {"gpt2": (gpt2.PRESETS, gpt2.GPT2), "llama": (llama.PRESETS, llama.Llama)}
MODEL_NAMES = tuple(f"{family}-{preset}" for family, (presets, _) in FAMILIES.items()
                    for preset in presets)


@dataclass(frozen=True)
class ModelSpec:
    """A named model: `build(mesh=None, **options)` makes it (options: the class's, such as
    recompute=True); `tokenizer` names the data.tokenizer its vocabulary needs."""
    name: str
    family: str
    config: object
    model_class: type
    tokenizer: str

    def build(self, mesh=None, **options):
        return self.model_class(self.config, mesh, **options)


def model_spec(name, **overrides):
    """The ModelSpec called `name`, its config with `overrides` (field=value) applied."""
    family, _, preset = name.partition("-")
    if family not in FAMILIES and name in gpt2.PRESETS:
        family, preset = "gpt2", name
    if family not in FAMILIES or preset not in FAMILIES[family][0]:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")
    presets, model_class = FAMILIES[family]
    config = replace(presets[preset], **overrides)
    tokenizer = "byte" if config.vocab_size == 257 else \
        "tiktoken" if family == "gpt2" else "hf"
    return ModelSpec(f"{family}-{preset}", family, config, model_class, tokenizer)
