"""The parameter analyzer of fully_shard: layers are the elements of ModuleLists, consecutive
ones packed up to the byte threshold, a larger one alone, tied parameters counted once."""
import pytest

import cupytp
from cupytp import nn
from cupytp.models.gpt2 import GPT2, GPT2Config
from cupytp.parallel import plan_groups
from cupytp.parallel.data_parallel import layers


@pytest.fixture(scope="module", autouse=True)
def world():
    return cupytp.init()


def names(groups):
    return [[name for name, _ in group] for group in groups]


def test_small_layers_are_packed_and_a_large_one_is_alone():
    sizes = [4, 4, 4, 40, 4, 4]     # (n x n) weights, fp32: 64 B each small, 6400 B the large
    model = nn.Sequential(*[nn.DLinear(n, n, bias=False) for n in sizes])
    assert names(plan_groups(model, 200)) == [["0", "1", "2"], ["3"], ["4", "5"]]
    assert names(plan_groups(model, 0)) == [[str(i)] for i in range(6)]
    assert names(plan_groups(model, 1 << 20)) == [[str(i) for i in range(6)]]


def test_layers_are_found_inside_models_and_tied_weights_count_once():
    model = GPT2(GPT2Config(vocab_size=11, block_size=4, n_layer=3, n_head=2, n_embd=4))
    assert [name for name, _ in layers(model)] == [f"transformer.h.{i}" for i in range(3)]
    assert names(plan_groups(model, 0)) == [[f"transformer.h.{i}"] for i in range(3)]
    shared = nn.DLinear(2, 2)
    twice = nn.Sequential(shared, shared)
    assert names(plan_groups(twice, 0)) == [["0"]]


def test_a_negative_threshold_is_an_error():
    with pytest.raises(ValueError, match="group_bytes must be >= 0"):
        plan_groups(nn.Sequential(nn.DLinear(2, 2)), -1)
