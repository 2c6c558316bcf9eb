"""A Llama-family decoder (Llama, Qwen2) written out in float64 NumPy, forward and backward by
hand, over Hugging Face's parameter names and shapes: the reference the models are held to where
PyTorch is missing (CI), itself held to `transformers` where it is installed
(tests/unit/test_llama_reference.py).

`loss_and_grads(weights, config, ids, targets)` → (logits (B, T, V), mean cross-entropy, {key:
gradient}) for a dict of full float64 arrays and a LlamaConfig; `inv_freq`: the rotary
frequencies (the model's are computed in float64, as here).
"""
import numpy

from cupytp.nn.rotary import rope_frequencies


def _rms(x, w, eps):
    r = 1.0 / numpy.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return x * r * w, (x * r, r)


def _rms_back(dy, w, saved):
    xhat, r = saved
    d = dy * w
    dx = r * (d - xhat * (d * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).reshape(-1, dy.shape[-1]).sum(0)


def _rotate(x, cos, sin, sign=1.0):
    """Hugging Face's apply_rotary_pos_emb on (B, T, H, D), sign -1: its inverse."""
    half = x.shape[-1] // 2
    rotated = numpy.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + sign * rotated * sin


def _linear_back(dy, x, w):
    """(dx, dW) of y = x @ w.T for w (out, in)."""
    return dy @ w, dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])


def loss_and_grads(weights, config, ids, targets):
    c = config
    b, t = ids.shape
    h, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_size
    group = h // hk
    angles = numpy.outer(numpy.arange(t, dtype=numpy.float64),
                         rope_frequencies(d, c.rope_theta, c.rope_scaling))
    cos = numpy.cos(numpy.concatenate([angles, angles], -1))[None, :, None, :]
    sin = numpy.sin(numpy.concatenate([angles, angles], -1))[None, :, None, :]
    causal = numpy.tril(numpy.ones((t, t), bool))
    w = weights
    bias = c.attention_bias
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]

    x = w["model.embed_tokens.weight"][ids]
    tape = []
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        hn, norm1 = _rms(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        proj = {}
        for name, heads in (("q", h), ("k", hk), ("v", hk)):
            y = hn @ w[p + f"self_attn.{name}_proj.weight"].T
            if bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y.reshape(b, t, heads, d)
        q, k = _rotate(proj["q"], cos, sin), _rotate(proj["k"], cos, sin)
        kx, vx = (numpy.repeat(a, group, axis=2) for a in (k, proj["v"]))  # (B, T, H, D)
        scores = numpy.einsum("bthd,bshd->bhts", q, kx) / numpy.sqrt(d)
        scores = numpy.where(causal, scores, -numpy.inf)
        probs = numpy.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = numpy.einsum("bhts,bshd->bthd", probs, vx).reshape(b, t, h * d)
        x1 = x + attn @ w[p + "self_attn.o_proj.weight"].T
        hn2, norm2 = _rms(x1, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = hn2 @ w[p + "mlp.gate_proj.weight"].T
        up = hn2 @ w[p + "mlp.up_proj.weight"].T
        sig = 1 / (1 + numpy.exp(-gate))
        m = gate * sig * up
        x2 = x1 + m @ w[p + "mlp.down_proj.weight"].T
        tape.append((p, hn, norm1, q, kx, vx, probs, attn, hn2, norm2, gate, up, sig, m))
        x = x2
    xf, normf = _rms(x, w["model.norm.weight"], c.rms_norm_eps)
    logits = xf @ head.T
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - numpy.log(numpy.exp(shifted).sum(-1, keepdims=True))
    n = b * t
    loss = -numpy.take_along_axis(logp, targets[..., None], -1).mean()

    grads = {key: numpy.zeros_like(value) for key, value in w.items()}
    dlogits = numpy.exp(logp)
    numpy.put_along_axis(dlogits, targets[..., None],
                         numpy.take_along_axis(dlogits, targets[..., None], -1) - 1, -1)
    dlogits /= n
    dxf, dhead = _linear_back(dlogits, xf, head)
    grads["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"] += dhead
    dx, grads["model.norm.weight"] = _rms_back(dxf, w["model.norm.weight"], normf)
    for p, hn, norm1, q, kx, vx, probs, attn, hn2, norm2, gate, up, sig, m in reversed(tape):
        dm, grads[p + "mlp.down_proj.weight"] = _linear_back(dx, m, w[p + "mlp.down_proj.weight"])
        dgate = dm * up * sig * (1 + gate * (1 - sig))
        dup = dm * gate * sig
        dhn2, grads[p + "mlp.gate_proj.weight"] = _linear_back(dgate, hn2,
                                                               w[p + "mlp.gate_proj.weight"])
        dhn2_up, grads[p + "mlp.up_proj.weight"] = _linear_back(dup, hn2,
                                                                w[p + "mlp.up_proj.weight"])
        dx1_norm, grads[p + "post_attention_layernorm.weight"] = _rms_back(
            dhn2 + dhn2_up, w[p + "post_attention_layernorm.weight"], norm2)
        dx1 = dx + dx1_norm
        dattn, grads[p + "self_attn.o_proj.weight"] = _linear_back(
            dx1, attn, w[p + "self_attn.o_proj.weight"])
        dattn = dattn.reshape(b, t, h, d)
        dprobs = numpy.einsum("bthd,bshd->bhts", dattn, vx)
        dvx = numpy.einsum("bhts,bthd->bshd", probs, dattn)
        dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True)) / numpy.sqrt(d)
        dq = numpy.einsum("bhts,bshd->bthd", dscores, kx)
        dkx = numpy.einsum("bhts,bthd->bshd", dscores, q)
        dk, dv = (a.reshape(b, t, hk, group, d).sum(3) for a in (dkx, dvx))
        dproj = {"q": _rotate(dq, cos, sin, -1.0), "k": _rotate(dk, cos, sin, -1.0), "v": dv}
        dhn = 0.0
        for name, grad in dproj.items():
            key = p + f"self_attn.{name}_proj."
            grad = grad.reshape(b, t, -1)
            dpart, grads[key + "weight"] = _linear_back(grad, hn, w[key + "weight"])
            dhn = dhn + dpart
            if bias:
                grads[key + "bias"] = grad.reshape(-1, grad.shape[-1]).sum(0)
        dx_norm, grads[p + "input_layernorm.weight"] = _rms_back(
            dhn, w[p + "input_layernorm.weight"], norm1)
        dx = dx1 + dx_norm
    numpy.add.at(grads["model.embed_tokens.weight"], ids, dx)
    return logits, loss, grads
