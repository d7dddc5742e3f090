"""axlearn per-layer plans (`adapters.axlearn.apply_per_layer`) on the axlearn stand-in: a
StackedTransformerLayer gets a list of layer configs with their own remat_spec, a
RepeatedTransformerLayer keeps one spec."""

import re

import pytest

import neuron_remat as nr
from neuron_remat.adapters import axlearn as ax

import axlearn_fixtures as fx

TRN2 = nr.from_instance_type("trn2.48xlarge")


@pytest.fixture
def axlearn():
    with fx.on_path():
        yield


def _saved(spec):
    return spec.policy.names_which_can_be_saved


def test_stacked_stack_gets_one_layer_config_per_layer(axlearn):
    cfg = fx.launched(fx.fuji("70B"))
    stack = cfg.model.decoder.transformer
    assert type(stack).__qualname__.startswith("StackedTransformerLayer") or \
        "Stacked" in repr(stack.klass)
    base = stack.layer
    emitted = ax.describe_trainer(cfg, device=TRN2, hosts=64).emitted
    plan = ax.apply_per_layer(cfg, device=TRN2, hosts=64)
    assert plan is not None and plan.layer_policies is not None
    layers = cfg.model.decoder.transformer.layer
    assert isinstance(layers, list) and len(layers) == cfg.model.decoder.transformer.num_layers
    # each layer's spec says what the plan says for that layer, as axlearn spells it
    for got, policy in zip(layers, plan.layer_policies):
        assert got.remat_spec.prevent_cse is True
        assert _saved(got.remat_spec) == policy.save_regex
        assert got.self_attention.attention.num_heads == base.self_attention.attention.num_heads
    distinct = {_saved(got.remat_spec) for got in layers}
    assert len(distinct) == len(plan.layer_mix) == 2
    # the counts: layers per set, independently of the plan's own bookkeeping
    counts = {}
    for got in layers:
        counts[_saved(got.remat_spec)] = counts.get(_saved(got.remat_spec), 0) + 1
    assert sorted(counts.values()) == sorted(m.layers for m in plan.layer_mix)
    # every saved pattern names a tag the layer emits on Neuron
    for pattern in distinct:
        for p in pattern.split("|"):
            assert any(re.fullmatch(p, n) for n in emitted), p


def test_repeated_stack_keeps_one_spec(axlearn):
    from axlearn.common.attention import RepeatedTransformerLayer

    cfg = fx.launched(fx.fuji("70B"))
    stack = cfg.model.decoder.transformer
    repeated = RepeatedTransformerLayer.default_config().set(
        num_layers=stack.num_layers, layer=stack.layer, input_dim=stack.input_dim)
    cfg.model.decoder.transformer = repeated
    plan = ax.apply_per_layer(cfg, device=TRN2, hosts=64)
    assert plan is not None
    layer = cfg.model.decoder.transformer.layer
    assert not isinstance(layer, list)
    assert _saved(layer.remat_spec) == plan.policy.save_regex
    assert layer.remat_spec.prevent_cse is False


def test_off_neuron_leaves_the_config(axlearn):
    cfg = fx.launched(fx.fuji("70B"))
    before = cfg.model.decoder.transformer.layer
    assert ax.apply_per_layer(cfg, device=nr.parse_device("cpu"), hosts=64) is None
    assert cfg.model.decoder.transformer.layer is before
