"""The NumPy reference Llama (tests/llama_reference.py) against transformers' LlamaForCausalLM
and Qwen2ForCausalLM (float64; skipped where PyTorch or transformers is missing): logits, loss
and every gradient within 1e-12; and the rotary frequencies (rope_theta, Llama 3's scaling)
against transformers' own, computed in float32 there."""
import numpy
import pytest

from cupytp.nn.rotary import rope_frequencies
from hf_llama import float64_model, logits_loss_grads
from llama_reference import loss_and_grads
from small_llama import CONFIGS, random_weights


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_is_transformers(name):
    config = CONFIGS[name]
    weights = random_weights(config, 5)
    ids = numpy.random.default_rng(6).integers(0, config.vocab_size, (3, 10))
    targets = numpy.random.default_rng(7).integers(0, config.vocab_size, (3, 10))
    logits, loss, grads = loss_and_grads(weights, config, ids, targets)
    hf_logits, hf_loss, hf_grads = logits_loss_grads(float64_model(config, weights), ids,
                                                     targets)
    numpy.testing.assert_allclose(logits, hf_logits, rtol=1e-12, atol=1e-13)
    assert abs(loss - hf_loss) < 1e-12
    assert set(hf_grads) == {k for k in weights}
    for key, value in hf_grads.items():
        numpy.testing.assert_allclose(grads[key], value, rtol=1e-10,
                                      atol=1e-12 * numpy.abs(value).max(), err_msg=key)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rope_frequencies_are_transformers(name):
    """Our float64 frequencies round to transformers' float32 ones (its rope_theta and llama3
    rules)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = CONFIGS[name]
    hf = float64_model(config, random_weights(config, 0))
    rotary = type(hf.model.rotary_emb)(hf.config)          # transformers' own frequencies
    ours = rope_frequencies(config.head_size, config.rope_theta, config.rope_scaling)
    numpy.testing.assert_allclose(rotary.inv_freq.double().numpy(), ours, rtol=3e-7)
    assert transformers.__version__
