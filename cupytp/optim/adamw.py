"""AdamW with torch.optim.AdamW semantics (no amsgrad, no maximize), fused: one `adamw_step`
kernel call per (group, dtypes). Each rank updates its own shards; nothing is communicated."""
from cupytp.launchers.adamw import adamw_scalars, adamw_step
from cupytp.optim.optimizer import Optimizer, check_non_negative


class AdamW(Optimizer):
    """Per element: p -= lr weight_decay p; m = beta1 m + (1 - beta1) g;
    v = beta2 v + (1 - beta2) g^2; p -= lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps).

    States "exp_avg" (m) and "exp_avg_sq" (v), laid out like the parameter. The step count t is
    kept per group (`group["step"]`, saved with the group) and advances on every step() in which
    any of the group's parameters has a gradient (a step that `GradScaler` skipped for non-finite
    gradients is counted on the device and taken out again: bias corrections and the saved step
    count only the steps taken). torch counts per parameter: the two differ only
    for a parameter that has no gradient in some steps while others of its group update.
    """

    writes_casts = True         # autocast's kept casts get the new values in the same pass

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, step=0)
        super().__init__(params, defaults)

    def check_group(self, group):
        check_non_negative(lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"],
                           step=group["step"])
        if len(group["betas"]) != 2:
            raise ValueError(f"betas must be (beta1, beta2), got {group['betas']}")
        for i, beta in enumerate(group["betas"]):
            if not 0 <= beta < 1:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")

    def state_names(self, group):
        return ("exp_avg", "exp_avg_sq")

    def scalars(self, group):
        group["step"] += 1
        beta1, beta2 = group["betas"]
        return adamw_scalars(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"], step=group["step"])

    def update(self, group, buckets, scalars, found_inf, skipped):
        for bucket in buckets.values():
            adamw_step(bucket.params, bucket.grads, bucket.states["exp_avg"],
                       bucket.states["exp_avg_sq"], scalars, found_inf, skipped, checked=True,
                       casts=bucket.casts if bucket.cast_keys else None)


def decay_groups(params, weight_decay):
    """The usual AdamW grouping (GPT-2, nanoGPT): matrices (ndim >= 2: linear and embedding
    weights) decay with `weight_decay`; biases and norm weights (ndim < 2) do not. Given
    (name, parameter) pairs, a parameter named `...bias` never decays, whatever its shape (GPT-2's
    fused q|k|v bias is `[3, C]`).

        AdamW(decay_groups(model.named_parameters(), 0.1), lr=6e-4)
    """
    named = [item if isinstance(item, tuple) else ("", item) for item in params]
    decays = [p.ndim >= 2 and not name.endswith("bias") for name, p in named]
    return [{"params": [p for (_, p), d in zip(named, decays) if d],
             "weight_decay": weight_decay},
            {"params": [p for (_, p), d in zip(named, decays) if not d], "weight_decay": 0.0}]
