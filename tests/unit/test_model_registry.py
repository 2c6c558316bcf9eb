"""The model registry: every name gives its family's config, class and tokenizer; tiny models of
both families build from it and compute a loss; unknown names are one error listing the known."""
import math

import numpy
import pytest

import cupytp
from cupytp.models import GPT2, MODEL_NAMES, Llama, model_spec
from cupytp.tensor import Replicated, local_mesh
from dense_reference import full, lay_out


def test_every_name_has_a_spec():
    assert {"gpt2-124M", "llama-tiny", "llama-125M", "llama-1B", "llama-1.5B",
            "llama-8B"} <= set(MODEL_NAMES)
    for name in MODEL_NAMES:
        spec = model_spec(name)
        assert spec.name == name and spec.model_class is {"gpt2": GPT2,
                                                           "llama": Llama}[spec.family]
    assert model_spec("124M").name == "gpt2-124M"            # GPT-2's bare preset names
    assert [model_spec(n).tokenizer for n in ("gpt2-tiny", "gpt2-124M", "llama-tiny",
                                              "llama-8B")] == ["byte", "tiktoken", "byte", "hf"]
    assert model_spec("llama-1B", num_hidden_layers=2).config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="unknown model 'llama-70B': choose one of gpt2-tiny"):
        model_spec("llama-70B")


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_tiny_models_build_and_start_at_log_vocab(name):
    cupytp.init()
    cupytp.manual_seed(0)
    spec = model_spec(name)
    model = spec.build()
    ids = numpy.random.default_rng(1).integers(0, spec.config.vocab_size, (2, 17))
    _, loss = model(lay_out(ids[:, :-1], local_mesh(), (Replicated(),)),
                    lay_out(ids[:, 1:], local_mesh(), (Replicated(),)))
    assert abs(float(full(loss)) - math.log(spec.config.vocab_size)) < 0.15
