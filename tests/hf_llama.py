"""Hugging Face `transformers` models (LlamaForCausalLM, Qwen2ForCausalLM) in float64, for the
tests that hold cupytp's Llama and the NumPy reference to them where PyTorch is installed.

Two of transformers' computations run in float32 whatever the model's dtype: the rotary tables
(float32 angles, cosines and sines) and RMSNorm (an upcast to float32). `float64_model` replaces
both with the same formulas in float64, so that comparisons can be held to 1e-9; the frequencies
it uses are transformers' own formula written out in float64 (`rope_frequencies`, checked
against transformers' float32 ones separately), everything else is transformers' code.
"""
import types

import numpy
import pytest

from cupytp.models.llama import hf_config
from cupytp.nn.rotary import rope_frequencies


def float64_model(config, weights):
    """The transformers model of a LlamaConfig with `weights` ({key: float64 array}) loaded."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in hf_config(config, numpy.float64).items()
              if k not in ("architectures", "torch_dtype")}
    kind = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[
        config.model_type]
    hf_cfg = kind(**fields)
    hf_cfg._attn_implementation = "sdpa"
    model_class = {"llama": transformers.LlamaForCausalLM,
                   "qwen2": transformers.Qwen2ForCausalLM}[config.model_type]
    model = model_class(hf_cfg).double()
    state = {k: torch.from_numpy(numpy.ascontiguousarray(v)) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return float64_arithmetic(model, config)


def float64_arithmetic(model, config):
    """`model` (a transformers model) with its rotary tables and RMSNorms computed in float64."""
    torch = pytest.importorskip("torch")
    inv_freq = torch.from_numpy(rope_frequencies(config.head_size, config.rope_theta,
                                                 config.rope_scaling))

    def rotary(x, position_ids):
        angles = position_ids[..., None].double() * inv_freq
        emb = torch.cat([angles, angles], -1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                              self.variance_epsilon))
    model.model.rotary_emb.forward = rotary
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(rms_norm, module)
    return model


def logits_loss_grads(model, ids, targets):
    """(logits, mean cross-entropy of every position against `targets` (no shift), {key:
    gradient}) of a transformers model, as NumPy float64."""
    torch = pytest.importorskip("torch")
    model.zero_grad()
    logits = model(torch.from_numpy(ids)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(targets).reshape(-1))
    loss.backward()
    grads = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    return logits.detach().numpy(), loss.item(), grads
