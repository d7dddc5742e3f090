"""The jax_remat_policy entry point: discovery, the provider's behaviour, its switches, and
failure containment, through importlib.metadata as a host library would use it."""

import logging
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
from jax.ad_checkpoint import checkpoint_policies

import neuron_remat as nr
from neuron_remat import plugin
from neuron_remat.policies import RegexPolicy, preset

from fake_hosts import install_providers

HOST_DEFAULT = checkpoint_policies.dots_with_no_batch_dims_saveable
SMALL = nr.TransformerConfig(hidden=256, heads=8, kv_heads=2, ffn=1024, layers=16, vocab=1000,
                             flash_attention=True, name="small")
SIM = "trn2.48xlarge:hbm=500MiB:cores=1"  # one simulated core with scaled-down HBM


def host_remat_policy(default, **context):
    """The few lines the README tells a host library to write (no neuron_remat import)."""
    for ep in sorted(entry_points(group="jax_remat_policy"), key=lambda e: e.name):
        answer = ep.load()(default=default, **context)
        if answer is not None:
            return answer
    return default


def test_entry_point_is_registered_by_the_installed_package():
    eps = {ep.name: ep for ep in entry_points(group="jax_remat_policy")}
    assert eps["neuron_remat"].value == "neuron_remat.plugin:provide"
    assert eps["neuron_remat"].load() is plugin.provide


def test_off_neuron_the_host_default_stands():
    choice = nr.resolve_policy(default=HOST_DEFAULT, layer="decoder.layer", stack="stacked")
    assert choice.policy is HOST_DEFAULT and choice.provider is None
    assert host_remat_policy(HOST_DEFAULT, layer="decoder.layer", stack="stacked") is HOST_DEFAULT
    assert plugin.provide(layer="x") is None


def test_on_trn2_told_nothing_gives_the_trn2_preset(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    choice = nr.resolve_policy(default=HOST_DEFAULT, layer="decoder.layer", stack="stacked")
    assert choice.provider == "neuron_remat"
    assert choice.policy == preset("trn2-fuji-70b")
    policy, prevent_cse = choice
    assert prevent_cse is True
    answer = host_remat_policy(HOST_DEFAULT, layer="decoder.layer", stack="stacked")
    assert answer.policy == preset("trn2-fuji-70b") and answer.prevent_cse is True


@pytest.mark.parametrize("override, answers", [
    ("trn2.48xlarge", True), ("trn2:lnc=1", True), ("trn1.32xlarge", True),
    ("inf2.48xlarge", True), ("trn3", True), ("cpu", False)])
def test_provider_per_device_family(monkeypatch, override, answers):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", override)
    choice = nr.resolve_policy(default=HOST_DEFAULT, stack="repeated")
    assert (choice.provider == "neuron_remat") is answers
    assert choice.policy == (preset("trn2-fuji-70b") if answers else HOST_DEFAULT)


@pytest.mark.parametrize("stack, cse", [("stacked", True), ("repeated", False)])
def test_prevent_cse_follows_the_stack(monkeypatch, stack, cse):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2")
    assert nr.resolve_policy(stack=stack).prevent_cse is cse


def test_pipelined_stacks_are_left_alone(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    choice = nr.resolve_policy(default=HOST_DEFAULT, stack="pipelined", model="fuji-70b")
    assert choice.policy is HOST_DEFAULT and choice.provider is None


def test_a_described_model_gets_the_planned_policy(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", SIM)
    shape = nr.StepShape(seq_len=2048, micro_batch=2)
    choice = nr.resolve_policy(stack="repeated", model=SMALL, shape=shape,
                               parallelism={"tp": 1})
    expected = nr.plan(nr.parse_device(SIM), SMALL, shape,
                       nr.Parallelism())
    assert choice.policy == expected.policy and choice.prevent_cse is False
    assert 0 < len(expected.saved_tags) < len(SMALL.roles) - 1  # a real trade-off
    assert choice.plan.saved_tags == expected.saved_tags


def test_hugging_face_dicts_and_model_names_are_accepted(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    hf = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
          "intermediate_size": 28672, "num_hidden_layers": 80, "vocab_size": 128256,
          "max_position_embeddings": 8192}
    par = {"tp": 4, "sequence_parallel": True, "fsdp": -1, "hosts": 8}
    shape = {"seq_len": 8192}
    by_dict = plugin.provide(model=hf, parallelism=par, shape=shape)
    by_name = plugin.provide(model="llama3-70b", parallelism=par)
    assert isinstance(by_dict.policy, RegexPolicy) and by_dict.policy == by_name.policy
    # config.json gives no training sequence length: without shape= it cannot plan.
    assert plugin.provide(model=hf, parallelism=par) is None


def test_failures_warn_once_and_the_default_stands(monkeypatch, caplog):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    caplog.set_level(logging.WARNING, logger="neuron_remat")
    for _ in range(3):  # a host asks for every layer
        choice = nr.resolve_policy(default=HOST_DEFAULT, model="no-such-model")
        assert choice.policy is HOST_DEFAULT
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "unknown model 'no-such-model'" in warnings[0].getMessage()
    assert "default policy stands" in warnings[0].getMessage()


def test_provide_takes_a_device_string_as_fit_and_plan_do():
    plan = nr.plan(nr.parse_device("trn2.48xlarge"), "llama3-8b", nr.StepShape(seq_len=4096))
    got = plugin.provide(device="trn2.48xlarge", model="llama3-8b", shape={"seq_len": 4096})
    assert got.policy == plan.policy  # before: AttributeError, and the host's default


def test_a_refusal_naming_each_layer_warns_once(monkeypatch, caplog):
    """Once per cause, whatever the number of layers: refusals whose message names the
    layer (its number, its tag names) are one cause."""
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    caplog.set_level(logging.WARNING, logger="neuron_remat")
    common = dict(model="fuji-7b-v3", shape={"seq_len": 4096}, stack="stacked")
    for i in range(4):  # the dead patterns are the same; the names differ per layer
        assert plugin.provide(layer=f"layers_{i}", parallelism={"tp": 4, "fsdp": -1},
                              tags=[f"layers_{i}.q_proj", f"layers_{i}.o_proj"],
                              **common) is None
    for i in range(30, 34):  # past the 16 layers per core of 2 pipeline stages
        assert plugin.provide(layer=f"layer{i}", layer_index=i,
                              parallelism={"tp": 4, "fsdp": -1, "pp": 2}, **common) is None
    for i in range(4):  # no model: the preset, against per-layer names it does not match
        assert plugin.provide(layer=f"layers.{i}", tags=[f"layers.{i}.query"],
                              stack="stacked") is None
    for i in (1.5, "2"):  # not layer numbers, once per kind
        assert plugin.provide(layer_index=i, **common) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5, warnings
    assert "match none of the tags" in warnings[0] and "is past the" in warnings[1]
    assert "preset matches none" in warnings[2]
    assert "layer_index=1.5" in warnings[3] and "layer_index='2'" in warnings[4]


def test_a_model_that_cannot_fit_falls_back(monkeypatch, caplog):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2:hbm=1GiB")
    caplog.set_level(logging.WARNING, logger="neuron_remat")
    choice = nr.resolve_policy(default=HOST_DEFAULT, model="fuji-70b",
                               parallelism={"tp": 4})
    assert choice.policy is HOST_DEFAULT
    assert "NoFitError" in caplog.text and "even full recompute" in caplog.text


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    monkeypatch.setenv("NEURON_REMAT_STRICT", "1")
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        nr.resolve_policy(default=HOST_DEFAULT, model="no-such-model")


def test_a_bad_override_is_contained_unless_strict(monkeypatch, caplog):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn9")
    assert nr.resolve_policy(default=HOST_DEFAULT).policy is HOST_DEFAULT
    assert "unknown device 'trn9'" in caplog.text
    monkeypatch.setenv("NEURON_REMAT_STRICT", "1")
    with pytest.raises(ValueError, match="trn9"):
        nr.resolve_policy(default=HOST_DEFAULT)


def test_tags_the_preset_does_not_match_fall_back(monkeypatch, caplog):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2")
    choice = nr.resolve_policy(default=HOST_DEFAULT, tags=["Block.mlp_in", "Block.mlp_out"])
    assert choice.policy is HOST_DEFAULT
    assert "matches none of the tags" in caplog.text
    ok = nr.resolve_policy(default=HOST_DEFAULT, tags=["Attn.q_proj", "Block.mlp_out"])
    assert ok.policy == preset("trn2-fuji-70b")


def test_the_host_vocabulary_and_its_tag_names(monkeypatch, caplog):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2")
    maxtext = nr.resolve_policy(tags="maxtext").policy
    assert maxtext.action("query_proj") == "save" and maxtext.action("mlpwi_1") == "save"
    assert maxtext.action("out_proj") == "recompute"
    assert nr.resolve_policy(tags="axlearn").policy == preset("trn2-fuji-70b")
    # A described model planned in axlearn's names, checked against MaxText's tag names:
    monkeypatch.setenv("NEURON_REMAT_DEVICE", SIM)
    context = dict(model=SMALL, shape={"seq_len": 2048, "micro_batch": 2}, parallelism={})
    names = ["decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj"]
    assert nr.resolve_policy(default=HOST_DEFAULT, tags=names, **context).policy is HOST_DEFAULT
    assert "match none of the tags the host emits" in caplog.text
    matched = nr.resolve_policy(tags=names + ["context"], **{  # flash: MaxText says context
        **context, "model": nr.TransformerConfig(**{**SMALL.__dict__, "tags": nr.MAXTEXT_TAGS})})
    assert matched.provider == "neuron_remat"


def test_disable_switch(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    monkeypatch.setenv("NEURON_REMAT_DISABLE", "1")
    assert nr.resolve_policy(default=HOST_DEFAULT).policy is HOST_DEFAULT
    assert plugin.provide() is None


def test_answers_are_cached_per_context(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", SIM)
    shape = {"seq_len": 2048, "micro_batch": 2}
    first = plugin.provide(stack="repeated", model=SMALL, shape=shape, parallelism={})
    second = plugin.provide(stack="repeated", model=SMALL, shape=dict(shape), parallelism={})
    assert second is first and second.plan is first.plan  # planned once
    other = plugin.provide(stack="stacked", model=SMALL, shape=shape, parallelism={})
    assert other is not first and other.policy == first.policy


def test_bad_stack_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="stack='scanned'.*stacked, repeated, pipelined"):
        nr.resolve_policy(stack="scanned")


# --- several providers, through real (temporary) distributions on sys.path -----------


@pytest.fixture
def extra_providers(tmp_path, monkeypatch):
    """Two more providers, installed the way pip would leave them."""
    install_providers(tmp_path, "other_providers", textwrap.dedent("""
        from jax.ad_checkpoint import checkpoint_policies

        def broken(**context):
            raise RuntimeError("provider bug")

        def dots(**context):
            return checkpoint_policies.dots_saveable if context.get("layer") == "dots" else None

        def named(**context):  # a policy's name, not the policy
            return "dots_saveable" if context.get("layer") == "named" else None
    """), {"aaa_broken": "broken", "aab_dots": "dots", "aac_named": "named"})
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin.clear_cache()
    yield
    sys.modules.pop("other_providers", None)
    plugin.clear_cache()


def test_first_answer_in_name_order_wins_and_a_broken_provider_is_skipped(
        extra_providers, monkeypatch, caplog):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    names = [ep.name for ep in entry_points(group="jax_remat_policy")]
    assert {"aaa_broken", "aab_dots", "neuron_remat"} <= set(names)
    choice = nr.resolve_policy(layer="dots", stack="repeated")
    assert choice.policy is checkpoint_policies.dots_saveable and choice.provider == "aab_dots"
    assert choice.prevent_cse is False
    assert "'aaa_broken' raised RuntimeError: provider bug" in caplog.text
    # Where the second provider has no opinion, neuron_remat answers.
    assert nr.resolve_policy(layer="decoder").provider == "neuron_remat"
    monkeypatch.setenv("NEURON_REMAT_STRICT", "1")
    with pytest.raises(RuntimeError, match="provider bug"):
        nr.resolve_policy(layer="decoder")


def test_an_answer_a_host_cannot_use_is_skipped_with_one_warning(
        extra_providers, monkeypatch, caplog):
    """A provider answering a string is skipped, as one that raised: the next answers (a
    string would reach jax.checkpoint and fail at trace time). axlearn's remat_spec takes a
    regex of names: another provider's dots_saveable leaves the config's spec, with one
    warning, not a TypeError."""
    from neuron_remat.adapters import axlearn as ax

    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    with caplog.at_level(logging.WARNING, logger="neuron_remat"):
        for _ in range(2):
            choice = nr.resolve_policy(layer="named")
            assert choice.provider == "neuron_remat" and callable(choice.policy)
            assert ax.remat_settings("RepeatedTransformerLayer", layer="dots") is None
    said = [r.getMessage() for r in caplog.records]
    assert sum("'aac_named' answered str" in m for m in said) == 1
    assert sum("'aab_dots' answered" in m and "RegexPolicy" in m for m in said) == 1


# --- a provider's prevent_cse ------------------------------------------------------------------


@pytest.fixture
def cse_provider(tmp_path, monkeypatch):
    """A provider that answers layer "cse" with a policy AND prevent_cse=False."""
    install_providers(tmp_path, "cse_provider", textwrap.dedent("""
        import types
        from jax.ad_checkpoint import checkpoint_policies

        def answer(**context):
            if context.get("layer") != "cse":
                return None
            return types.SimpleNamespace(policy=checkpoint_policies.nothing_saveable,
                                         prevent_cse=False)
    """), {"aaa_cse": "answer"})
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin.clear_cache()
    yield
    sys.modules.pop("cse_provider", None)
    plugin.clear_cache()


def _remat_prevent_cse(fn, *args):
    """The prevent_cse of the remat equations in `fn`'s jaxpr, as JAX records it."""
    import jax

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if "prevent_cse" in eqn.params:
                found.append(eqn.params["prevent_cse"])
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr or a Jaxpr
                if hasattr(inner, "eqns"):
                    walk(inner)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_the_adapters_honour_a_providers_prevent_cse(cse_provider, monkeypatch, caplog):
    import jax
    import jax.numpy as jnp

    monkeypatch.setenv("NEURON_REMAT_DEVICE", "cpu")
    x = jnp.ones((4, 4))
    body = lambda v: jnp.sin(v) @ v  # noqa: E731
    if not _remat_prevent_cse(jax.checkpoint(body, prevent_cse=False), x):
        pytest.skip("this remat implementation (jax_remat3) records no prevent_cse")
    # Unrolled layers default to prevent_cse=True; the provider says False, and JAX gets it.
    assert _remat_prevent_cse(nr.checkpoint(body, layer="cse"), x) == [False]
    assert _remat_prevent_cse(nr.checkpoint(body, layer="other"), x) == [True]
    assert _remat_prevent_cse(nr.checkpoint(body, layer="cse", prevent_cse=True), x) == [True]
    assert nr.checkpoint(body, layer="cse").prevent_cse is False

    pytest.importorskip("flax", reason="the Flax adapters need flax (the test extra)")
    import flax.linen as nn
    from flax import nnx

    from neuron_remat.adapters.flax import nnx_remat
    from neuron_remat.adapters.flax import remat as linen_remat

    class Lin(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 4)))

        def __call__(self, v):
            return jnp.sin(v) @ self.w

    fwd = nnx_remat(lambda m, v: m(v), layer="cse")
    assert _remat_prevent_cse(lambda v: fwd(Lin(), v), x) == [False]

    # Linen transforms the class when wrapped: the stack's value stands, and one warning
    # names the value to pass.
    class Block(nn.Module):
        @nn.compact
        def __call__(self, v):
            return jnp.sin(nn.Dense(4)(v))

    Wrapped = linen_remat(Block, layer="cse")
    block = Wrapped()
    grad = __import__("jax").grad
    with caplog.at_level(logging.WARNING, logger="neuron_remat"):
        params = block.init(__import__("jax").random.PRNGKey(0), x)
        # The policy is asked (and so resolved) when the backward is formed.
        assert _remat_prevent_cse(grad(lambda v: block.apply(params, v).sum()), x) == [True]
        _remat_prevent_cse(grad(lambda v: block.apply(params, v).sum()), x)
    warned = [r for r in caplog.records if "answered prevent_cse=False" in r.getMessage()]
    assert len(warned) == 1 and "pass prevent_cse=False" in warned[0].getMessage()
