"""The axlearn and MaxText adapters: the settings and overrides they produce, checked
against those libraries' real signatures and key names (neither installs beside current
JAX, so neither is imported)."""

import importlib
import inspect
import sys
import textwrap
from types import SimpleNamespace

import pytest

import neuron_remat as nr
from neuron_remat import plugin, policies
from neuron_remat.adapters import axlearn as ax
from neuron_remat.adapters import maxtext as mt

from fake_hosts import install_providers

# axlearn's stack classes, by name and inheritance (axlearn/common/attention.py).
BaseStackedTransformerLayer = type("BaseStackedTransformerLayer", (), {})
StackedTransformerLayer = type("StackedTransformerLayer", (BaseStackedTransformerLayer,), {})
RepeatedTransformerLayer = type("RepeatedTransformerLayer", (BaseStackedTransformerLayer,), {})
PipelinedTransformerLayer = type("PipelinedTransformerLayer", (BaseStackedTransformerLayer,), {})
MyStack = type("MyStack", (StackedTransformerLayer,), {})

# axlearn's keyword signature of save_and_offload_only_these_names_regex
# (axlearn/common/utils.py, apple/axlearn 34aed43c).
AXLEARN_KEYWORDS = ["names_which_can_be_saved", "names_which_can_be_offloaded", "offload_src",
                    "offload_dst"]


def test_adapters_do_not_import_their_hosts():
    for name in ("neuron_remat.adapters.axlearn", "neuron_remat.adapters.maxtext",
                 "neuron_remat.adapters.flax", "neuron_remat.adapters.equinox"):
        importlib.import_module(name)
    assert "axlearn" not in sys.modules and "maxtext" not in sys.modules
    assert "MaxText" not in sys.modules


@pytest.mark.parametrize("klass, kind", [
    (StackedTransformerLayer, "stacked"), (MyStack, "stacked"),
    (RepeatedTransformerLayer, "repeated"), (PipelinedTransformerLayer, "pipelined"),
    ("axlearn.common.attention.RepeatedTransformerLayer", "repeated"),
])
def test_stack_kind(klass, kind):
    assert ax.stack_kind(klass) == kind


def test_unknown_stack_class_is_a_clear_error():
    with pytest.raises(ValueError, match="'Conformer' is not an axlearn transformer stack"):
        ax.stack_kind("Conformer")


def test_remat_settings_on_trn2_match_axlearns_signature(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    settings = ax.remat_settings(StackedTransformerLayer)
    assert settings.prevent_cse is True
    assert list(settings.policy_kwargs) == AXLEARN_KEYWORDS
    assert list(inspect.signature(policies.save_and_offload_only_these_names_regex).parameters) \
        == AXLEARN_KEYWORDS
    assert settings.policy_kwargs == {"names_which_can_be_saved": ".*[kqv]_proj|.*linear1_[01]",
                                      "names_which_can_be_offloaded": None,
                                      "offload_src": None, "offload_dst": None}
    # The same keywords build the same policy with our implementation of the function.
    rebuilt = policies.save_and_offload_only_these_names_regex(**settings.policy_kwargs)
    assert rebuilt == policies.preset("trn2-fuji-70b")
    assert settings.to_dict()["policy"]["fn"] == \
        "axlearn.common.utils.save_and_offload_only_these_names_regex"
    assert settings.layer_path == "model.decoder.transformer.layer"


def test_repeated_stacks_get_prevent_cse_false_and_a_planned_policy(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    par = {"tp": 4, "sequence_parallel": True, "fsdp": -1, "hosts": 8}
    settings = ax.remat_settings(RepeatedTransformerLayer, model="fuji-70b", parallelism=par)
    planned = nr.plan(nr.from_instance_type("trn2.48xlarge"), nr.get_model("fuji-70b"),
                      nr.StepShape(seq_len=8192), nr.Parallelism(**par))
    assert settings.prevent_cse is False
    assert settings.policy_kwargs["names_which_can_be_saved"] == planned.policy.save_regex


def test_pipelined_stacks_and_other_devices_get_nothing(monkeypatch):
    assert ax.remat_settings(StackedTransformerLayer) is None  # CPU: no opinion
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    assert ax.remat_settings(PipelinedTransformerLayer) is None


def _trainer(klass):
    layer = SimpleNamespace(remat_spec="host default")
    return SimpleNamespace(model=SimpleNamespace(decoder=SimpleNamespace(
        transformer=SimpleNamespace(klass=klass, layer=layer))))


def test_modify_sets_the_layer_remat_spec_from_the_final_stack_class(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")

    def spec(klass, **context):  # stands in for axlearn's RematSpec(...)
        s = ax.remat_settings(klass, **context)
        return None if s is None else ("RematSpec", s.prevent_cse, s.policy_kwargs)

    par = {"tp": 4, "sequence_parallel": True, "fsdp": -1, "hosts": 8}
    cfg = ax.modify(_trainer(StackedTransformerLayer), spec_factory=spec, model="fuji-70b",
                    parallelism=par)
    kind, prevent_cse, kwargs = cfg.model.decoder.transformer.layer.remat_spec
    planned = nr.plan(nr.from_instance_type("trn2.48xlarge"), nr.get_model("fuji-70b"),
                      nr.StepShape(seq_len=8192), nr.Parallelism(**par))
    assert (kind, prevent_cse) == ("RematSpec", True)
    assert kwargs["names_which_can_be_saved"] == planned.policy.save_regex
    piped = ax.modify(_trainer(PipelinedTransformerLayer), spec_factory=spec, model="fuji-70b")
    assert piped.model.decoder.transformer.layer.remat_spec == "host default"
    # Without model=, modify reads the config (pipelined stacks are left alone before that;
    # reading a real config is tested in test_axlearn_modifier.py).
    assert ax.modify(_trainer(PipelinedTransformerLayer)).model.decoder.transformer.layer \
        .remat_spec == "host default"
    # An unreadable config leaves the spec as it is (one warning), unless strict.
    assert ax.modify(_trainer(StackedTransformerLayer), spec_factory=spec).model.decoder \
        .transformer.layer.remat_spec == "host default"
    monkeypatch.setenv("NEURON_REMAT_STRICT", "1")
    with pytest.raises(ax.ConfigReadError,
                       match=r"transformer\.layer\.klass = None: expected a layer class"):
        ax.modify(_trainer(StackedTransformerLayer), spec_factory=spec)


@pytest.mark.skipif(importlib.util.find_spec("axlearn") is not None, reason="axlearn installed")
def test_remat_spec_needs_axlearn_only_when_called(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    with pytest.raises(ImportError, match="remat_spec needs axlearn"):
        ax.remat_spec(StackedTransformerLayer)
    assert ax.remat_spec.__module__ == "neuron_remat.adapters.axlearn"


# --- MaxText ---------------------------------------------------------------------------

# MaxText's checkpoint tags for the decoder layer (src/maxtext/layers/attentions.py,
# linears.py, decoders.py at AI-Hypercomputer/maxtext e591f30c); each is also its config key.
MAXTEXT_LAYER_TAGS = {"decoder_layer_input", "query_proj", "key_proj", "value_proj",
                      "qkv_proj", "attention_out", "out_proj", "context", "mlpwi_0", "mlpwi_1",
                      "mlpwi", "mlpwo"}


def test_maxtext_vocabulary_is_maxtexts_key_list():
    assert MAXTEXT_LAYER_TAGS <= set(mt.BASE_YML_KEYS)
    tags = nr.MAXTEXT_TAGS
    names = {tags.name(r) for r in ("input", "q_proj", "k_proj", "v_proj", "context", "o_proj",
                                    "linear1_0", "linear1_1", "linear2")}
    names |= {tags.name("linear1_0", gated=False), tags.name("context", flash=True)}
    assert names <= MAXTEXT_LAYER_TAGS
    assert len(mt.BASE_YML_KEYS) == 22 and mt.ALLOWED_VALUES == ("remat", "device", "offload")


def test_maxtext_overrides_for_a_planned_model(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    par = {"tp": 4, "sequence_parallel": True, "fsdp": -1, "hosts": 8}
    out = mt.overrides(model="llama3-70b", parallelism=par)
    assert out["remat_policy"] == "custom"
    assert set(out) == {"remat_policy", *mt.BASE_YML_KEYS}
    assert set(out.values()) <= {"custom", *mt.ALLOWED_VALUES}
    assert out["decoder_layer_input"] == "device"
    cfg = nr.get_model("llama3-70b")
    planned = nr.plan(nr.from_instance_type("trn2.48xlarge"),
                      nr.TransformerConfig(**{**cfg.__dict__, "tags": nr.MAXTEXT_TAGS}),
                      nr.StepShape(seq_len=8192), nr.Parallelism(**par))
    device_keys = {k for k, v in out.items() if v == "device"} - {"decoder_layer_input"}
    assert device_keys == set(planned.saved_tags)
    assert "offload" not in out.values()
    assert mt.as_args({"remat_policy": "custom", "query_proj": "device"}) == [
        "remat_policy=custom", "query_proj=device"]


def test_maxtext_preset_and_fused_qkv(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    out = mt.overrides()
    assert {k for k, v in out.items() if v == "device"} == {
        "decoder_layer_input", "query_proj", "key_proj", "value_proj", "mlpwi_0", "mlpwi_1"}
    fused = mt.overrides(fused_qkv=True)
    assert fused["qkv_proj"] == "device"
    assert fused["query_proj"] == fused["key_proj"] == fused["value_proj"] == "remat"


def test_maxtext_off_neuron_has_no_opinion():
    assert mt.overrides(model="llama3-8b") is None


def test_maxtext_overrides_follow_another_providers_policy(tmp_path, monkeypatch):
    install_providers(tmp_path, "out_proj_provider", textwrap.dedent("""
        from neuron_remat.policies import RegexPolicy

        def provide(**context):
            return RegexPolicy(["out_proj"], ["query_proj"], offload_src="device",
                               offload_dst="pinned_host")
    """), {"aaa_out_proj": "provide"})
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin.clear_cache()
    try:
        out = mt.overrides()
    finally:
        sys.modules.pop("out_proj_provider", None)
        plugin.clear_cache()
    assert {k for k, v in out.items() if v == "device"} == {"decoder_layer_input", "out_proj"}
    assert {k for k, v in out.items() if v == "offload"} == {"query_proj"}


def test_maxtext_overrides_need_a_plan_in_maxtext_names():
    planned = nr.plan(nr.from_instance_type("trn2.48xlarge"), nr.get_model("llama3-8b"),
                      nr.StepShape(seq_len=4096), nr.Parallelism(tp=4, fsdp=-1))
    with pytest.raises(ValueError, match="tags=MAXTEXT_TAGS"):
        mt.overrides_for(planned)
