"""What a checkpoint holds, under flat keys: the model's parameters and buffers, the optimizer's
per-parameter states, and the optimizer's hyperparameters (as JSON).

    model/<name>                a parameter or buffer: model/transformer.h.0.mlp.c_fc.weight
    optimizer/<param>/<state>   a state of a parameter, laid out like it:
                                optimizer/transformer.h.0.mlp.c_fc.weight/exp_avg

A parameter's optimizer states go under its name in the model (saved without a model: its index
in the optimizer's order), and the hyperparameters list each group's parameters by the same
keys. So a checkpoint does not depend on how the model is split: a pipeline rank saves and
loads the states of the parameters it holds, whatever the number of stages.
"""
import json

import numpy

from cupytp.checkpoint.storage import CheckpointError

MODEL = "model/"
OPTIMIZER = "optimizer/"


def optimizer_keys(model, optimizer):
    """Per parameter of `optimizer`, in its order: the key its states are saved under (its name
    in `model`; its index when no model is given)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if model is None:
        return [str(index) for index in range(len(params))]
    names = {id(p): name for name, p in model.named_parameters()}
    strangers = [index for index, p in enumerate(params) if id(p) not in names]
    if strangers:
        raise CheckpointError(f"the optimizer's parameters {strangers[:4]} (in its order) are not "
                              "the model's: give the optimizer of this model")
    return [names[id(p)] for p in params]


def saved_tensors(model, optimizer, keys):
    """{key: DTensor} of everything `model` and `optimizer` (either may be None) hold; `keys`:
    the optimizer's parameter keys (optimizer_keys)."""
    tensors = {}
    if model is not None:
        tensors.update((MODEL + name, t) for name, t in model.sharded_state_dict().items())
    if optimizer is not None:
        for index, states in optimizer.state_dict()["state"].items():
            tensors.update((f"{OPTIMIZER}{keys[index]}/{name}", t) for name, t in states.items())
    return tensors


def saved_param_groups(optimizer, keys):
    """The optimizer's hyperparameters, one dict per group, its "params" as parameter keys, as
    JSON."""
    groups = optimizer.state_dict()["param_groups"]
    for group in groups:
        group["params"] = [keys[index] for index in group["params"]]
    return to_json(groups, "the optimizer's param_groups")


def merged_param_groups(every_rank):
    """One list of groups from every rank's (a pipeline's stages each hold some parameters):
    group i lists the parameters of every rank's group i, each once; its hyperparameters must
    be the same on every rank."""
    merged = []
    for rank, groups in enumerate(every_rank):
        for i, group in enumerate(groups or []):
            hyper = {k: v for k, v in group.items() if k != "params"}
            if i == len(merged):
                merged.append(dict(hyper, params=[]))
            elif {k: v for k, v in merged[i].items() if k != "params"} != hyper:
                raise CheckpointError(f"the optimizer's group {i} has other hyperparameters on "
                                      f"rank {rank} ({hyper}) than on lower ranks")
            listed = set(merged[i]["params"])
            merged[i]["params"] += [key for key in group["params"] if key not in listed]
    return merged if any(groups is not None for groups in every_rank) else None


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


def optimizer_targets(optimizer, keys, saved):
    """{key: parameter} of the saved optimizer states this rank loads: those of its own
    parameters (`keys`: optimizer_keys), each laid out like its parameter."""
    params = {key: p for key, p in zip(keys, (p for group in optimizer.param_groups
                                              for p in group["params"]))}
    targets = {}
    for key in saved:
        param = params.get(_param_key(key))
        if param is not None:
            targets[key] = param
    return targets


def optimizer_state_dict(optimizer, keys, param_groups, values):
    """What Optimizer.load_state_dict takes, from a checkpoint's `param_groups` (each listing
    its parameters by key) and its states `values` ({key: DTensor}) of this rank's parameters;
    each of the optimizer's groups takes the hyperparameters of the saved group that holds its
    parameters. A saved list stays a tuple where `optimizer` keeps one (betas)."""
    index = {key: i for i, key in enumerate(keys)}
    states = {}
    for key, value in values.items():
        states.setdefault(index[_param_key(key)], {})[key.rsplit("/", 1)[1]] = value
    saved_in = {str(key): g for g, group in enumerate(param_groups) for key in group["params"]}
    groups, start = [], 0
    for number, current in enumerate(optimizer.param_groups):
        own = keys[start:start + len(current["params"])]
        start += len(own)
        homes = {saved_in.get(key) for key in own}
        if len(homes) > 1 or None in homes:
            raise ValueError(f"the optimizer's group {number} holds parameters that the "
                             f"checkpoint's groups place differently (or lack): {own[:4]}")
        home = homes.pop() if homes else min(number, len(param_groups) - 1)
        saved = {k: v for k, v in param_groups[home].items() if k != "params"}
        groups.append({name: tuple(value) if isinstance(current.get(name), tuple) else value
                       for name, value in saved.items()})
        groups[-1]["params"] = list(range(start - len(own), start))
    return {"state": states, "param_groups": groups}


def _param_key(key):
    """The parameter key of an optimizer state's key: optimizer/<param>/<state>."""
    return key[len(OPTIMIZER):].rsplit("/", 1)[0]
