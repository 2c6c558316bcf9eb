"""What a checkpoint holds, under flat keys: the model's parameters and buffers, the optimizer's
per-parameter states, and the optimizer's hyperparameters (as JSON).

    model/<name>                a parameter or buffer: model/transformer.h.0.mlp.c_fc.weight
    optimizer/<index>/<state>   a state of parameter <index> in the optimizer's order (as
                                Optimizer.state_dict() counts), laid out like that parameter:
                                optimizer/3/exp_avg
"""
import json

import numpy

from cupytp.checkpoint.storage import CheckpointError

MODEL = "model/"
OPTIMIZER = "optimizer/"


def saved_tensors(model, optimizer):
    """{key: DTensor} of everything `model` and `optimizer` (either may be None) hold."""
    tensors = {}
    if model is not None:
        tensors.update((MODEL + name, t) for name, t in model.sharded_state_dict().items())
    if optimizer is not None:
        for index, states in optimizer.state_dict()["state"].items():
            tensors.update((f"{OPTIMIZER}{index}/{name}", t) for name, t in states.items())
    return tensors


def saved_param_groups(optimizer):
    """The optimizer's hyperparameters, one dict per group (its "params" as indices), as JSON."""
    return to_json(optimizer.state_dict()["param_groups"], "the optimizer's param_groups")


def to_json(value, what):
    """`value` as plain JSON values (tuples become lists, NumPy scalars Python numbers); an error
    naming `what` for anything JSON cannot hold."""
    def plain(item):
        if isinstance(item, numpy.generic):
            return item.item()
        raise TypeError(f"{type(item).__name__} values are not JSON")
    try:
        return json.loads(json.dumps(value, default=plain))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{what} cannot be saved: {err}; give numbers, strings, lists and "
                              "dicts") from None


def model_targets(model):
    """{key: tensor} that loading `model` fills."""
    return {MODEL + name: t for name, t in model.sharded_state_dict().items()}


def optimizer_targets(optimizer, keys):
    """{key: parameter} for the optimizer state `keys` of a checkpoint: each state is loaded laid
    out like its parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    targets = {}
    for key in keys:
        index = int(key[len(OPTIMIZER):].split("/")[0])
        if index >= len(params):
            raise CheckpointError(f"the checkpoint holds {key}, but this optimizer has "
                                  f"{len(params)} parameters")
        targets[key] = params[index]
    return targets


def optimizer_state_dict(optimizer, param_groups, values):
    """What Optimizer.load_state_dict takes, from a checkpoint's `param_groups` and its states
    `values` ({key: DTensor}); a saved list stays a tuple where `optimizer` keeps one (betas)."""
    states = {}
    for key, value in values.items():
        index, name = key[len(OPTIMIZER):].split("/")
        states.setdefault(int(index), {})[name] = value
    groups = []
    for saved, current in zip(param_groups, optimizer.param_groups):
        groups.append({name: tuple(value) if isinstance(current.get(name), tuple) else value
                       for name, value in saved.items()})
    groups += param_groups[len(groups):]
    return {"state": states, "param_groups": groups}
