"""SGD with torch.optim.SGD semantics (no maximize), fused: one `sgd_step` kernel call per
(group, dtypes). Each rank updates its own shards; nothing is communicated."""
from cupytp.launchers.sgd import sgd_scalars, sgd_step
from cupytp.optim.optimizer import Optimizer, check_non_negative


class SGD(Optimizer):
    """Per element: g += weight_decay p; with momentum, buf = g on the parameter's first update,
    else momentum buf + (1 - dampening) g, and g = g + momentum buf (nesterov) or buf;
    p -= lr g. State "momentum_buffer" (only with momentum), laid out like the parameter."""

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, nesterov=False,
                 weight_decay=0.0):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)

    def check_group(self, group):
        check_non_negative(lr=group["lr"], momentum=group["momentum"],
                           weight_decay=group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"nesterov momentum needs momentum > 0 and dampening == 0, got "
                             f"momentum={group['momentum']}, dampening={group['dampening']}")

    def state_names(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def scalars(self, group):
        return sgd_scalars(lr=group["lr"], momentum=group["momentum"],
                           dampening=group["dampening"], weight_decay=group["weight_decay"],
                           nesterov=group["nesterov"])

    def update(self, group, buckets, scalars, found_inf, skipped):
        for (_, _, first_step), bucket in buckets.items():
            sgd_step(bucket.params, bucket.grads, bucket.states.get("momentum_buffer"), scalars,
                     nesterov=group["nesterov"], first_step=first_step, found_inf=found_inf,
                     checked=True)
