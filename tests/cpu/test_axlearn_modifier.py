"""The axlearn mesh-rule modifier, against Fuji trainer configs built the way axlearn builds
them (apple/axlearn 34aed43c) on the stand-in package of axlearn_fixtures, and the
Neuron-true tag vocabulary and fused-QKV graph it plans with."""

import dataclasses
import importlib.util
import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax._src.ad_checkpoint import name_p
from jax.ad_checkpoint import Saveable

import neuron_remat as nr
from neuron_remat import memory_model as mm
from neuron_remat import models, planner
from neuron_remat.adapters import axlearn as ax
from neuron_remat.policies import RegexPolicy

import axlearn_fixtures as fx

LAYER = "model.decoder.transformer.layer"
PR_898 = ".*[kqv]_proj|.*linear1_[01]"
AXLEARN_KEYWORDS = ["names_which_can_be_saved", "names_which_can_be_offloaded", "offload_src",
                    "offload_dst"]
TRN2 = nr.from_instance_type("trn2.48xlarge")
# What Fuji-v3's layer tags on Neuron after the TRN2 rule (FlashAttention, NKI kernel), as
# axlearn's ``_remat_name`` spells them: ``f"{type(self).__name__}.{name}"``.
FUJI_NEURON_NAMES = (
    "TransformerLayer.input", "FlashAttention.q_proj", "FlashAttention.k_proj",
    "FlashAttention.v_proj", "FlashAttention.o_proj", "TransformerFeedForwardLayer.linear1_0",
    "TransformerFeedForwardLayer.linear1_1", "TransformerFeedForwardLayer.linear2")


def _saved_by(spec):
    """The names the config's policy keeps: axlearn's closure, instantiated from the config
    and asked as jax.checkpoint asks it about each tag."""
    policy = spec.policy.instantiate()
    return {n for n in FUJI_NEURON_NAMES if policy(name_p, name=n) is Saveable}


def _matching(tags):
    """The names axlearn-style patterns (``.*<tag>``) for `tags` fully match."""
    return {n for n in FUJI_NEURON_NAMES if any(re.fullmatch(r".*" + t, n) for t in tags)}


@pytest.fixture
def axlearn():
    with fx.on_path():
        yield


@pytest.fixture
def trn2(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")


def _spec(cfg):
    return cfg.model.decoder.transformer.layer.remat_spec


def _policy_kwargs(spec):
    return {k: getattr(spec.policy, k) for k in AXLEARN_KEYWORDS}


def _launch(size, plan, **kw):
    return fx.launched(fx.fuji(size, plan=plan, **kw))


# --- building the modifier ----------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("axlearn") is not None, reason="axlearn installed")
def test_without_axlearn_the_modifier_says_how_to_install_it():
    with pytest.raises(ImportError, match=r"remat_plan_modifier needs axlearn.*pip install "
                                          r"'axlearn @ git\+https://github.com/apple/axlearn'"):
        ax.remat_plan_modifier()
    with pytest.raises(ImportError, match="needs axlearn"):
        ax.RematPlanModifier  # noqa: B018


def test_the_modifier_is_a_config_modifier_of_the_axlearn_it_finds(axlearn):
    from axlearn.common.config import ConfigModifier

    cfg = ax.remat_plan_modifier(instance_type="trn2.48xlarge")
    assert issubclass(cfg.klass, ConfigModifier)
    assert cfg.klass is ax.RematPlanModifier
    assert (cfg.klass.__module__, cfg.klass.__qualname__) == (
        "neuron_remat.adapters.axlearn", "RematPlanModifier")
    assert (cfg.instance_type, cfg.hosts, cfg.reserve, cfg.strict, cfg.stack_path) == (
        "trn2.48xlarge", None, None, None, "model.decoder.transformer")
    with pytest.raises(AttributeError, match="instnce_type"):
        ax.remat_plan_modifier(instnce_type="trn2.48xlarge")


@pytest.mark.skipif(fx.REAL, reason="one installed axlearn: nothing to rebuild for")
def test_the_class_is_rebuilt_for_another_axlearn():
    with fx.on_path():
        first = ax.RematPlanModifier
    with fx.on_path():
        from axlearn.common.config import ConfigModifier

        second = ax.RematPlanModifier
        assert second is not first and issubclass(second, ConfigModifier)


# --- Fuji-70B-v3 on TRN2 ------------------------------------------------------------------


def test_fuji_70b_trn2_rule_is_read_after_the_swaps(axlearn, trn2):
    cfg = _launch("70B", None)
    desc = ax.describe_trainer(cfg, device=TRN2, hosts=64)
    builtin = nr.get_model("fuji-70b-v3")
    for f in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "layers", "vocab", "gated_ffn",
              "flash_attention", "norm", "activation", "causal", "tie_embeddings"):
        assert getattr(desc.config, f) == getattr(builtin, f), f
    assert desc.config.fused_qkv is False  # GroupedQKVLinear swapped in by the rule
    assert desc.config.tags == models.AXLEARN_NEURON_TAGS
    assert (desc.stack_kind, desc.stack_class) == ("stacked", "StackedTransformerLayer")
    assert desc.parallelism == nr.Parallelism(tp=4, sequence_parallel=True, fsdp=1024,
                                              hosts=64)
    assert desc.shape == nr.StepShape(seq_len=8192, micro_batch=2)  # 2048 / 1024
    assert set(desc.emitted) == set(FUJI_NEURON_NAMES)
    assert desc.sources["sequence_parallel"] == f"{LAYER}.self_attention.norm.input_partition_spec"
    assert desc.sources["global_batch"] == "input.input_dispatcher.global_logical_batch_size"


def test_fuji_70b_last_in_the_trn2_rule_replaces_the_pr_898_spec(axlearn, trn2):
    before = _launch("70B", None)
    assert _spec(before).policy.names_which_can_be_saved == PR_898
    cfg = _launch("70B", ax.remat_plan_modifier(hosts=64))
    spec = _spec(cfg)
    planned = nr.plan(TRN2, nr.get_model("fuji-70b-v3"), nr.StepShape(seq_len=8192,
                                                                       micro_batch=2),
                      nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=64))
    assert spec.prevent_cse is True
    assert spec.policy.fn.__module__ == "axlearn.common.utils"
    assert spec.policy.fn.__name__ == "save_and_offload_only_these_names_regex"
    assert _policy_kwargs(spec) == {"names_which_can_be_saved": planned.policy.save_regex,
                                    "names_which_can_be_offloaded": None, "offload_src": None,
                                    "offload_dst": None}
    saved = planned.policy.save_regex
    assert saved != PR_898 and "flash_residuals" not in saved and "context" not in saved
    # The config's policy, axlearn's closure instantiated from it, keeps q, k, v and o
    # (README: fuji-70B-v3-flash on 64 trn2.48xlarge, 19.43% recompute), and the PR 898
    # spec it replaced kept q, k, v and the gated FFN input.
    assert _saved_by(spec) == _matching(["q_proj", "k_proj", "v_proj", "o_proj"])
    assert _saved_by(_spec(before)) == _matching(["[kqv]_proj", "linear1_[01]"])
    assert round(100 * planned.overhead, 2) == 19.43


def test_fuji_70b_on_one_host_does_not_fit_and_says_so(axlearn, trn2):
    with pytest.raises(nr.NoFitError, match="To fit: .*shard the model state further"):
        _launch("70B", ax.remat_plan_modifier(strict=True))  # hosts: JAX's process count


def test_fuji_70b_without_flash_does_not_fit_and_names_axlearns_knobs(axlearn, trn2):
    # README: plain fuji-70B-v3 on the TRN2 rule: the float32 seq x seq scores of native
    # attention need a 24.08 GiB workspace per core, more than the 24 GiB of HBM.
    with pytest.raises(nr.NoFitError) as err:
        _launch("70B", ax.remat_plan_modifier(hosts=64, strict=True), flash=False)
    text = str(err.value)
    assert "workspace 24.08 GiB" in text
    knobs = text.split("In axlearn's terms: ")[1]
    assert "self_attention.attention is GroupedQueryAttention; set it to FlashAttention" in knobs
    assert "input.input_dispatcher.global_logical_batch_size (now 2048)" in knobs
    assert "GradientAccumulationModifier" in knobs
    assert "MeshShapeModifier (now model=4 fsdp=1024 data=1 over 64 host(s))" in knobs
    assert "model=8 where it divides num_heads=64" in knobs


def test_not_strict_keeps_the_rules_spec_and_warns_once(axlearn, trn2, caplog):
    with caplog.at_level(logging.WARNING, logger="neuron_remat"):
        cfg = _launch("70B", ax.remat_plan_modifier(strict=False))
        again = _launch("70B", ax.remat_plan_modifier(strict=False))
    assert _spec(cfg).policy.names_which_can_be_saved == PR_898
    assert _spec(again).policy.names_which_can_be_saved == PR_898
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NoFitError" in warnings[0].getMessage()


def test_by_default_the_modifier_falls_back_unless_strict_is_asked(axlearn, trn2,
                                                                   monkeypatch):
    """A host never crashes because the plan could not be made, unless the user asked
    (``strict=True`` or ``NEURON_REMAT_STRICT``); ``NEURON_REMAT_DISABLE`` leaves the
    config alone."""
    cfg = _launch("70B", ax.remat_plan_modifier())  # does not fit on one host
    assert _spec(cfg).policy.names_which_can_be_saved == PR_898
    monkeypatch.setenv("NEURON_REMAT_STRICT", "1")
    with pytest.raises(nr.NoFitError):
        _launch("70B", ax.remat_plan_modifier())
    assert _spec(_launch("70B", ax.remat_plan_modifier(strict=False))
                 ).policy.names_which_can_be_saved == PR_898
    monkeypatch.delenv("NEURON_REMAT_STRICT")
    monkeypatch.setenv("NEURON_REMAT_DISABLE", "1")
    cfg = _launch("70B", ax.remat_plan_modifier(hosts=64))  # would plan without the switch
    assert _spec(cfg).policy.names_which_can_be_saved == PR_898


@pytest.mark.skipif(not fx.REAL, reason="needs a real axlearn (see README, axlearn)")
@pytest.mark.parametrize("name, size, kw, hosts", [
    ("fuji-70B-v3-flash", "70B", {}, 64), ("fuji-7B-v3-flash-single-host", "7B",
                                         {"single_host": True}, 1)])
def test_the_fixtures_read_as_axlearns_own_fuji_configs(name, size, kw, hosts):
    """On a real axlearn: fuji.py's own trainer config, after its TRN2 mesh rule, reads
    field for field as the fixture's, and plans alike."""
    from axlearn.common.config import config_for_function
    from axlearn.common.trainer import select_mesh_config
    from axlearn.experiments.text.gpt import fuji

    def source(*, vocab_size, max_sequence_length):
        return config_for_function(fx.lm_source).set(
            vocab_size=vocab_size, max_sequence_length=max_sequence_length)

    own = fuji.trainer_configs(source, lambda **_: {})[name]()
    select_mesh_config(own, mesh_selector=fx.TRN2_SELECTOR)
    ours = fx.launched(fx.fuji(size, **kw))
    theirs = ax.describe_trainer(own, device=TRN2, hosts=hosts)
    mine = ax.describe_trainer(ours, device=TRN2, hosts=hosts)
    assert dataclasses.replace(theirs.config, name="") == dataclasses.replace(mine.config, name="")
    assert (theirs.shape, theirs.parallelism, theirs.stack_class, theirs.emitted) == (
        mine.shape, mine.parallelism, mine.stack_class, mine.emitted)
    assert theirs.sources == mine.sources
    assert _saved_by(_spec(own)) == _saved_by(_spec(ours))  # the rule's own remat_spec


# --- Fuji-7B ------------------------------------------------------------------------------


def test_fuji_7b_single_host_plans_with_no_arguments(axlearn, trn2):
    cfg = fx.fuji("7B", single_host=True)
    assert _spec(cfg).prevent_cse is False  # the base config's spec, for a scanned stack
    modifier = ax.remat_plan_modifier().instantiate()
    fx.launched(cfg)  # the TRN2 rule: StackedTransformerLayer, GroupedQKVLinear, mesh
    out = modifier(cfg)
    result = modifier.last_plan
    assert out is cfg and result.description.stack_class == "StackedTransformerLayer"
    assert _spec(cfg).prevent_cse is True  # follows the final class
    assert result.description.parallelism.hosts == jax.process_count() == 1
    assert result.description.shape == nr.StepShape(seq_len=8192, micro_batch=1)
    assert _spec(cfg).policy.names_which_can_be_saved == result.plan.policy.save_regex
    planned = nr.plan(TRN2, nr.get_model("fuji-7b-v3"), nr.StepShape(seq_len=8192),
                      nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1))
    assert result.plan.saved_tags == planned.saved_tags
    assert result.plan.kept_bytes_per_layer == planned.kept_bytes_per_layer
    # README: fuji-7B-v3-flash on one trn2.48xlarge saves q, k, v, o and the gated FFN
    # input at 5.45% recompute.
    assert _saved_by(_spec(cfg)) == _matching(["[qkvo]_proj", "linear1_[01]"])
    assert round(100 * result.plan.overhead, 2) == 5.45


def _base_7b_with_own_rule(plan):
    """Base Fuji-7B-v3 (RepeatedTransformerLayer, FusedGroupedQKVLinear) under a user's TRN2
    rule that only sets the mesh."""
    from axlearn.common.trainer_config_modifier import ChainConfigModifier, MeshShapeModifier
    from axlearn.experiments.text.gpt.common import mesh_shape_from_axes

    cfg = fx.fuji("7B", single_host=True)
    cfg.mesh_rules = ((fx.TRN2_SELECTOR, ChainConfigModifier.default_config().set(
        config_modifiers=[MeshShapeModifier.default_config().set(
            mesh_shape=mesh_shape_from_axes(fsdp=-1, model=4)), plan])),)
    return fx.launched(cfg)


def test_base_fuji_7b_with_fused_qkv(axlearn, trn2):
    cfg = _base_7b_with_own_rule(ax.remat_plan_modifier())
    result = ax.plan_trainer(cfg)
    desc = result.description
    assert desc.config.fused_qkv is True and desc.stack_kind == "repeated"
    assert desc.config.kv_heads == 8 and desc.config.ffn == 11008
    assert desc.parallelism.sequence_parallel is False  # no partition-spec rule
    assert _spec(cfg).prevent_cse is False
    assert _spec(cfg).policy.names_which_can_be_saved == result.plan.policy.save_regex
    qkv = {"q_proj", "k_proj", "v_proj"} & set(result.plan.saved_tags)
    assert qkv in (set(), {"q_proj", "k_proj", "v_proj"})  # a slice alone avoids nothing
    # README: the base config on one trn2.48xlarge saves all three slices, o and the gated
    # FFN input at 5.46% recompute.
    assert _saved_by(_spec(cfg)) == _matching(["[qkvo]_proj", "linear1_[01]"])
    assert round(100 * result.plan.overhead, 2) == 5.46


# --- fused QKV: one matmul, three tags ----------------------------------------------------


def test_fused_qkv_graph_one_matmul_three_slices():
    config = dataclasses.replace(nr.get_model("fuji-7b-v3"), fused_qkv=True,
                                 tags=models.AXLEARN_NEURON_TAGS)
    shape, par = nr.StepShape(seq_len=4096), nr.Parallelism(tp=4)
    graph = mm.layer_graph(config, shape, par)
    full = graph.evaluate_roles(())
    t, h, d = 4096, 4096, 128
    matmul = 2 * t * h * (32 // 4 + 2 * (8 // 4)) * d
    for some in (("q_proj",), ("k_proj",), ("q_proj", "k_proj"), ("k_proj", "v_proj")):
        assert graph.evaluate_roles(some).recompute_flops == full.recompute_flops, some
    all3 = graph.evaluate_roles(("q_proj", "k_proj", "v_proj"))
    assert full.recompute_flops - all3.recompute_flops == matmul
    assert "qkv_matmul" in full.recomputed and "qkv_matmul" not in all3.recomputed
    fp = mm.layer_footprint(config, shape, par)
    assert fp["q_proj"].recompute_flops == 0 and fp["q_proj"].bytes == t * 8 * d * 2
    separate = mm.layer_graph(dataclasses.replace(config, fused_qkv=False), shape, par)
    assert separate.forward_flops() == graph.forward_flops()


def _fused_layer(w):
    def layer(x):
        qkv = x @ w  # one matmul
        q, k, v = jnp.split(qkv, 3, axis=-1)
        q = jax.ad_checkpoint.checkpoint_name(q, "FusedLayer.q_proj")
        k = jax.ad_checkpoint.checkpoint_name(k, "FusedLayer.k_proj")
        v = jax.ad_checkpoint.checkpoint_name(v, "FusedLayer.v_proj")
        return jnp.sum(jnp.tanh(q) * jnp.tanh(k) * jnp.tanh(v))
    return layer


@pytest.mark.parametrize("saved, recomputes_matmul", [
    ([], True), ([".*q_proj"], True), ([".*q_proj", ".*k_proj"], True),
    ([".*[qkv]_proj"], False)])
def test_fused_qkv_matches_what_jax_recomputes(saved, recomputes_matmul):
    """dot_generals in JAX's linearized program (as axlearn's tests count them): the fused
    matmul is redone in the backward unless all three slices are saved, as the graph says."""
    x = jnp.ones((64, 32), jnp.float32)
    w = jnp.ones((32, 3 * 16), jnp.float32)
    layer = jax.checkpoint(lambda x, w: _fused_layer(w)(x), policy=RegexPolicy(saved))
    _, linear = jax.linearize(layer, x, w)
    plain = jax.linearize(lambda x, w: _fused_layer(w)(x), x, w)[1]
    extra = str(linear).count(" dot_general") - str(plain).count(" dot_general")
    assert extra == (1 if recomputes_matmul else 0)


# --- Neuron-true vocabulary ---------------------------------------------------------------


def test_on_neuron_axlearn_emits_no_flash_tag_and_attention_is_recomputed():
    assert models.host_tags(models.AXLEARN_TAGS, TRN2) is models.AXLEARN_NEURON_TAGS
    assert models.host_tags(models.AXLEARN_TAGS, nr.parse_device("cpu")) is models.AXLEARN_TAGS
    assert models.host_tags(models.MAXTEXT_TAGS, TRN2) is models.MAXTEXT_NEURON_TAGS
    assert models.host_tags(models.MAXTEXT_TAGS, nr.parse_device("cpu")) is models.MAXTEXT_TAGS
    flash = dataclasses.replace(nr.get_model("fuji-70b"), tags=models.AXLEARN_NEURON_TAGS)
    native = dataclasses.replace(flash, flash_attention=False)
    assert "context" not in flash.roles and "context" in native.roles
    shape, par = nr.StepShape(seq_len=8192), nr.Parallelism(tp=4, sequence_parallel=True)
    graph = mm.layer_graph(flash, shape, par)
    every = graph.evaluate_roles(flash.roles)
    assert "flash_attention" in every.recomputed
    attn = next(op.flops for op in graph.ops if op.name == "flash_attention")
    assert every.recompute_flops >= attn > 0


def test_built_in_trn2_plans_name_no_tag_neuron_never_emits():
    for name in ("fuji-7b", "fuji-70b", "llama3-70b"):
        planned = nr.plan(TRN2, nr.get_model(name), nr.StepShape(seq_len=8192),
                          nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=8))
        assert planned.config.tags == models.AXLEARN_NEURON_TAGS
        assert not re.search("flash_residuals|context", planned.policy.save_regex or "")
        assert {d.tag for d in planned.decisions}.isdisjoint({"flash_residuals", "context"})
    # Off Neuron the GPU/TPU vocabulary stands.
    fp = mm.layer_footprint(nr.get_model("fuji-70b"), nr.StepShape(seq_len=8192),
                            nr.Parallelism(tp=4))
    assert "flash_residuals" in fp


# Names each host's GPU/TPU flash kernels tag, which no Neuron kernel emits: axlearn's
# ``flash_residuals`` (flash_attention/gpu_attention.py, tpu_attention.py at 34aed43c; its
# FlashAttention layer tags no ``context`` either) and MaxText's ``context`` (cuDNN and
# splash kernels in layers/attention_op.py at e591f30c).
NOT_ON_NEURON = {("axlearn", True): {"flash_residuals", "context"},
                 ("axlearn", False): {"flash_residuals"},
                 ("maxtext", True): {"context"}, ("maxtext", False): {"context"}}
BIG_TRN2 = nr.parse_device("trn2.48xlarge:hbm=1TiB")  # room to save every tag that pays


@pytest.mark.parametrize("host, tags", [("axlearn", models.AXLEARN_TAGS),
                                        ("maxtext", models.MAXTEXT_TAGS)])
@pytest.mark.parametrize("flash", [True, False])
def test_on_neuron_no_host_vocabulary_plans_a_tag_the_host_does_not_emit(host, tags, flash):
    dead = NOT_ON_NEURON[host, flash]
    names = set(dead) | {f"FlashAttention.{n}" for n in dead}
    for name in nr.MODELS:
        config = dataclasses.replace(nr.get_model(name), flash_attention=flash, tags=tags)
        planned = nr.plan(BIG_TRN2, config, nr.StepShape(seq_len=4096),
                          nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=8))
        assert not dead & set(planned.saved_tags), (name, planned.saved_tags)
        assert not any(planned.policy.action(n) != "recompute" for n in names), name
        assert planned.saved_tags  # the budget is roomy: something is saved
    if not flash:
        return
    # The same flash layer off Neuron is tagged with that name, and it pays: the test can
    # fail.
    off = mm.layer_footprint(dataclasses.replace(nr.get_model("llama3-8b"), tags=tags,
                                                 flash_attention=flash),
                             nr.StepShape(seq_len=4096), nr.Parallelism(tp=4))
    on_gpu = "flash_residuals" if host == "axlearn" else "context"
    assert on_gpu in off and off[on_gpu].recompute_flops > 0


def test_cli_maxtext_plan_on_trn2_keeps_context_recomputed(capsys):
    """The issue's case: ``plan --model llama3-8b --tags maxtext`` on TRN2 saved ``context``."""
    import json

    from neuron_remat.cli import main

    assert main(["plan", "--model", "llama3-8b", "--tags", "maxtext", "--device",
                 "trn2.48xlarge", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "context" not in out["saved_tags"]
    assert out["maxtext_overrides"]["remat_policy"] == "custom"
    assert out["maxtext_overrides"]["context"] == "remat"
    # The output ends in the line to paste: MaxText's keys, in JSON and as text.
    keys = dict(kv.split("=") for kv in out["paste"]["line"].split())
    assert keys["remat_policy"] == "custom" and keys["context"] == "remat"
    assert keys == out["maxtext_overrides"]  # every key, as the adapter sets them
    assert main(["plan", "--model", "llama3-8b", "--tags", "maxtext", "--device",
                 "trn2.48xlarge"]) == 0
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1] == out["paste"]["line"]


def test_dead_patterns_are_refused_where_the_names_are_known():
    emitted = ["FlashAttention.q_proj", "FlashAttention.k_proj", "TransformerLayer.input"]
    policy = RegexPolicy([".*q_proj", ".*flash_residuals"], [".*context"],
                         offload_src="device", offload_dst="pinned_host")
    assert planner.dead_patterns(policy, emitted) == [".*flash_residuals", ".*context"]
    with pytest.raises(ValueError, match=r"\['\.\*flash_residuals', '\.\*context'\] match none "
                                         r"of the tags model.decoder.transformer.layer emits"):
        planner.refuse_dead_patterns(policy, emitted, host=LAYER)
    planner.refuse_dead_patterns(RegexPolicy([".*[kq]_proj"]), emitted)


# --- what stays alone, and errors ---------------------------------------------------------


def test_off_neuron_and_pipelined_stacks_are_left_alone(axlearn, monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "cpu")
    cfg = _launch("70B", ax.remat_plan_modifier(hosts=64))
    assert _spec(cfg).policy.names_which_can_be_saved == PR_898
    # An explicit instance type plans on any machine.
    cfg = _launch("70B", ax.remat_plan_modifier(hosts=64, instance_type="trn2.48xlarge"))
    assert _spec(cfg).policy.names_which_can_be_saved != PR_898

    from axlearn.common.attention import PipelinedTransformerLayer

    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    cfg = fx.fuji("70B")
    stack = cfg.model.decoder.transformer
    cfg.model.decoder.transformer = PipelinedTransformerLayer.default_config().set(
        num_layers=80, num_stages=4, layer=stack.layer)
    before = _spec(cfg)
    assert ax.plan_trainer(cfg, hosts=64) is None
    out = ax.remat_plan_modifier(hosts=64).instantiate()(cfg)
    assert _spec(out) is before


@pytest.mark.parametrize("edit, path", [
    (lambda c: setattr(c.input.input_dispatcher, "global_logical_batch_size", 0),
     "input.input_dispatcher.global_logical_batch_size"),
    (lambda c: setattr(c.model.decoder.transformer.layer.feed_forward, "activation", "nn.relu"),
     f"{LAYER}.feed_forward.activation"),
    (lambda c: setattr(c.model.decoder, "dim", None), "model.decoder.dim"),
    (lambda c: setattr(c.model.decoder.transformer.layer.self_attention.attention.input_linear
                       .input_linear, "num_kv_heads", None),
     f"{LAYER}.self_attention.attention.input_linear.input_linear.num_kv_heads"),
    (lambda c: setattr(c, "mesh_shape", None), "mesh_shape"),
])
def test_an_unreadable_field_is_an_error_naming_its_path(axlearn, trn2, edit, path):
    cfg = _launch("70B", None)
    edit(cfg)
    with pytest.raises(ax.ConfigReadError, match=re.escape(path)):
        ax.plan_trainer(cfg, hosts=64)


def test_a_mixture_of_experts_feed_forward_is_refused_not_read_as_dense(axlearn, trn2, caplog):
    """axlearn's MoE feed-forward (mixture_of_experts.py, TransformerFeedForwardMoE: a
    BaseLayer with hidden_dim, activation, norm and num_experts; declared here by name, as
    the reader matches classes by name, since the real module needs more than the CPU
    venv has) is not the dense layer the model describes: an error naming the path, and
    the modifier keeps the config's spec with one warning."""
    from axlearn.common.base_layer import BaseLayer
    from axlearn.common.config import REQUIRED, Required, config_class

    class TransformerFeedForwardMoE(BaseLayer):
        @config_class
        class Config(BaseLayer.Config):
            input_dim: Required[int] = REQUIRED
            hidden_dim: Required[int] = REQUIRED
            num_experts: Required[int] = REQUIRED
            activation: Any = "nn.relu"
            norm: Any = None
            structure: str = "prenorm"

    cfg = _launch("70B", None)
    ff = cfg.model.decoder.transformer.layer.feed_forward
    cfg.model.decoder.transformer.layer.feed_forward = \
        TransformerFeedForwardMoE.default_config().set(
            num_experts=64, hidden_dim=ff.hidden_dim, activation=ff.activation, norm=ff.norm)
    with pytest.raises(ax.ConfigReadError, match=re.escape(f"{LAYER}.feed_forward.klass is "
                                                           "TransformerFeedForwardMoE")):
        ax.plan_trainer(cfg, hosts=64)
    before = _spec(cfg)
    with caplog.at_level(logging.WARNING, logger="neuron_remat"):
        out = ax.remat_plan_modifier(hosts=64).instantiate()(cfg)
    assert _spec(out) is before
    assert sum("TransformerFeedForwardMoE" in r.getMessage() for r in caplog.records) == 1


def test_a_required_field_left_unset_is_named(axlearn, trn2):
    from axlearn.common.config import REQUIRED

    cfg = _launch("70B", None)
    cfg.model.decoder.transformer.layer.self_attention.attention.num_heads = REQUIRED
    with pytest.raises(ax.ConfigReadError, match=r"self_attention\.attention\.num_heads is not "
                                                 r"set \(REQUIRED\)"):
        ax.plan_trainer(cfg, hosts=64)


# --- modify(), for configs built by hand ----------------------------------------------------


def test_modify_after_the_mesh_rule_reads_the_config(axlearn, trn2):
    cfg = ax.modify(_launch("7B", None, single_host=True))
    expected = ax.plan_trainer(_launch("7B", None, single_host=True))
    assert _spec(cfg).prevent_cse is True
    assert _policy_kwargs(_spec(cfg)) == expected.settings.policy_kwargs


def test_modify_with_a_model_falls_back_on_a_stack_it_cannot_set(axlearn, trn2, caplog):
    """modify(model=...) skips reading the config, not checking it: an unknown stack class,
    or a layer list apply_per_layer left, keeps the config as it is with one warning
    each (before: a ValueError and an AttributeError out of the host's launcher)."""
    from axlearn.common.base_layer import BaseLayer

    class MyStack(BaseLayer):  # the user's own stack, not one of axlearn's three
        pass

    odd = _launch("7B", None, single_host=True)
    odd.model.decoder.transformer.klass = MyStack
    listed = _launch("70B", None)
    assert ax.apply_per_layer(listed, hosts=64, max_sets=2) is not None
    assert isinstance(listed.model.decoder.transformer.layer, list)
    with caplog.at_level(logging.WARNING, logger="neuron_remat"):
        for cfg in (odd, odd, listed, listed):
            layer = cfg.model.decoder.transformer.layer
            assert ax.modify(cfg, model="llama3-8b") is cfg
            assert cfg.model.decoder.transformer.layer is layer
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "MyStack" in said[0] and "apply_per_layer" in said[1]


def test_modify_falls_back_on_what_it_cannot_read(axlearn, monkeypatch, caplog):
    """modify() leaves the config as it is, with one warning, when the device cannot be
    read; under NEURON_REMAT_STRICT it raises; NEURON_REMAT_DISABLE leaves it alone."""
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn9")
    before = _policy_kwargs(_spec(_launch("7B", None, single_host=True)))
    with caplog.at_level(logging.WARNING, logger="neuron_remat"):
        for _ in range(2):
            cfg = ax.modify(_launch("7B", None, single_host=True))
            assert _policy_kwargs(_spec(cfg)) == before
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "trn9" in warnings[0].getMessage()
    import types

    broken = types.SimpleNamespace(model=types.SimpleNamespace())  # no stack where it looks
    assert ax.modify(broken) is broken
    monkeypatch.setenv("NEURON_REMAT_STRICT", "1")
    with pytest.raises(ValueError, match="trn9"):
        ax.modify(_launch("7B", None, single_host=True))
    monkeypatch.setenv("NEURON_REMAT_DISABLE", "1")
    assert _policy_kwargs(_spec(ax.modify(_launch("7B", None, single_host=True)))) == before


# --- no arguments in a real multi-process job -----------------------------------------------

_JOB = r"""
import json, os, sys
import jax
jax.distributed.initialize(coordinator_address=os.environ["COORD"], num_processes=2,
                           process_id=int(sys.argv[1]), initialization_timeout=60)
sys.path.insert(0, os.environ["FIXTURES"])
import axlearn_fixtures as fx
from neuron_remat.adapters import axlearn as ax
with fx.on_path():
    cfg = fx.fuji("70B", plan=ax.remat_plan_modifier())
    cfg.input.input_dispatcher.global_logical_batch_size = 32  # a 2-instance job's batch
    fx.launched(cfg)
    spec = cfg.model.decoder.transformer.layer.remat_spec
    d = ax.plan_trainer(cfg).description
    print(json.dumps({"hosts": jax.process_count(), "fsdp": d.parallelism.fsdp,
                      "micro_batch": d.shape.micro_batch, "prevent_cse": spec.prevent_cse,
                      "saved": spec.policy.names_which_can_be_saved}))
"""


def _two_processes(tmp_path, job: str, **env_more: str) -> list[str]:
    """Run `job` as two CPU processes joined by jax.distributed on 127.0.0.1, each
    simulating a trn2.48xlarge; the last line each printed."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "job.py"
    script.write_text(job)
    env = {**os.environ, "COORD": f"127.0.0.1:{port}", "NEURON_REMAT_DEVICE": "trn2.48xlarge",
           "FIXTURES": str(fx.STUB.parent), "JAX_PLATFORMS": "cpu", **env_more}
    procs = [subprocess.Popen([sys.executable, str(script), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-2000:]
        outs.append(out.strip().splitlines()[-1])
    return outs


def test_fuji_70b_in_a_two_process_job_plans_with_no_arguments(tmp_path):
    """Two CPU processes joined by jax.distributed on 127.0.0.1, each simulating a
    trn2.48xlarge: the modifier takes the job size from JAX and both plan alike."""
    import json
    outs = [json.loads(line) for line in _two_processes(tmp_path, _JOB)]
    assert outs[0] == outs[1]
    got = outs[0]
    assert (got["hosts"], got["fsdp"], got["micro_batch"], got["prevent_cse"]) == (2, 32, 1, True)
    planned = nr.plan(TRN2, nr.get_model("fuji-70b-v3"), nr.StepShape(seq_len=8192),
                      nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=2))
    assert got["saved"] == planned.policy.save_regex != PR_898


_MISMATCH_JOB = r"""
import os, sys
if sys.argv[1] == "1":
    os.environ["NEURON_RT_VISIBLE_CORES"] = "0-31"  # this host sees half the cores
import jax
jax.distributed.initialize(coordinator_address=os.environ["COORD"], num_processes=2,
                           process_id=int(sys.argv[1]), initialization_timeout=60)
sys.path.insert(0, os.environ["FIXTURES"])
import axlearn_fixtures as fx
from neuron_remat.adapters import axlearn as ax
with fx.on_path():
    try:
        fx.launched(fx.fuji("7B", single_host=True, plan=ax.remat_plan_modifier(strict=False)))
    except Exception as err:
        print(type(err).__name__)
        raise SystemExit(0)
print("no error")
"""


def test_hosts_that_would_leave_the_stack_differently_are_stopped(tmp_path):
    """Two processes, one seeing half the cores: one plans, the other cannot read the
    config for its device and keeps the rule's spec (not strict). Left so, the two would
    compile different programs; the modifier's agreement check stops both."""
    outs = _two_processes(tmp_path, _MISMATCH_JOB, NEURON_REMAT_AGREEMENT_TIMEOUT="60")
    assert outs == ["PolicyMismatchError", "PolicyMismatchError"], outs


_DISABLED_JOB = r"""
import os, sys
me = sys.argv[1]
if me == "0":
    os.environ["NEURON_REMAT_DISABLE"] = "1"  # the plugin is off on this process only
elif os.environ["OTHER"] == "plans":
    # seeing half the cores, this one plans; seeing all, the 7B config's global batch of
    # 16 does not divide over them, and it cannot
    os.environ["NEURON_RT_VISIBLE_CORES"] = "0-31"
import jax
jax.distributed.initialize(coordinator_address=os.environ["COORD"], num_processes=2,
                           process_id=int(me), initialization_timeout=60)
jax.devices()  # as a launcher has by now: the backend joins every process once
sys.path.insert(0, os.environ["FIXTURES"])
import axlearn_fixtures as fx
from neuron_remat.adapters import axlearn as ax
with fx.on_path():
    try:
        if os.environ["CALL"] == "modifier":
            fx.launched(fx.fuji("7B", single_host=True, plan=ax.remat_plan_modifier()))
        else:
            ax.modify(fx.launched(fx.fuji("7B", single_host=True)))
    except Exception as err:
        print(type(err).__name__)
        raise SystemExit(0)
print("no error")
"""


@pytest.mark.parametrize("call", ["modifier", "modify"])
@pytest.mark.parametrize("other, expected", [("cannot", "no error"),
                                             ("plans", "PolicyMismatchError")])
def test_a_process_with_the_plugin_off_tells_the_others(tmp_path, call, other, expected):
    """Two processes, NEURON_REMAT_DISABLE=1 on one. Where the other cannot plan either,
    both leave the rule's spec and the job goes on; where the other plans, the two would
    compile different programs and both stop, at once (the timeout is 120 s; before, the
    disabled one published nothing and the other waited all of it, then said "silent")."""
    import time

    start = time.monotonic()
    outs = _two_processes(tmp_path, _DISABLED_JOB, NEURON_REMAT_AGREEMENT_TIMEOUT="120",
                          CALL=call, OTHER=other)
    assert outs == [expected, expected], outs
    assert time.monotonic() - start < 60


@pytest.mark.skipif(not hasattr(jax.config, "jax_remat3"), reason="JAX has no jax_remat3")
def test_under_remat3_the_spec_names_a_policy_jax_honours(axlearn, trn2, caplog):
    # axlearn's function returns a closure, which JAX's new remat would silently treat as
    # full remat; under jax_remat3 the spec names neuron_remat's function of the same
    # keywords, whose RegexPolicy that implementation honours, and says so once.
    from jax._src import ad_checkpoint

    old = jax.config.jax_remat3
    jax.config.update("jax_remat3", True)
    logged_before = ax._REMAT3_LOGGED
    ax._REMAT3_LOGGED = False
    try:
        with caplog.at_level(logging.WARNING, logger="neuron_remat"):
            cfg = _launch("70B", ax.remat_plan_modifier(hosts=64))
            _launch("70B", ax.remat_plan_modifier(hosts=64))
    finally:
        jax.config.update("jax_remat3", old)
        ax._REMAT3_LOGGED = logged_before
    spec = _spec(cfg)
    assert f"{spec.policy.fn.__module__}.{spec.policy.fn.__name__}" == ax.REMAT3_POLICY_FN
    policy = spec.policy.instantiate()
    assert isinstance(policy, ad_checkpoint.SaveOnlyTheseNames)
    assert "FlashAttention.q_proj" in policy.saveable_names
    assert sum("jax_remat3 is on" in r.message for r in caplog.records) == 1


# --- notes where nothing can be saved ---------------------------------------------------------


def test_axlearn_moe_note_names_the_untagged_expert_einsums():
    """Mixtral with axlearn's names: the expert einsums carry no remat name, so nothing can
    save them; the plan says so and names the tags that would help, each avoiding one
    expert projection: tokens x top-k x 2 x hidden x ffn / tp FLOPs per core."""
    shape, par = nr.StepShape(seq_len=4096), nr.Parallelism(tp=4, sequence_parallel=True,
                                                            fsdp=-1)
    planned = nr.plan(TRN2, nr.get_model("mixtral-8x7b"), shape, par)
    note = next(n for n in planned.notes if "no axlearn tag covers" in n)
    # README: 29.9% of a step recomputed with 9.1 GiB free.
    assert round(100 * planned.overhead, 1) == 29.9
    assert round(planned.headroom_bytes / 2**30, 1) == 9.1
    assert "wi_0, wi_1 and wo carry no remat name" in note
    one_projection = 4096 * 2 * 2 * 4096 * 14336 / 4
    for tag in ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo"):
        assert f"'{tag}' (moe_linear" in note
        assert f"up to {one_projection / 1e9:.4g}" in note
    assert f"note: {note}" in planned.table()
    # MaxText tags its experts: the plan saves them and needs no such note.
    maxtext = nr.plan(TRN2, dataclasses.replace(nr.get_model("mixtral-8x7b"),
                                                tags=models.MAXTEXT_TAGS), shape, par)
    assert not any("tag covers" in n for n in maxtext.notes)
    assert "moe_mlpwi_1" in maxtext.saved_tags
    # A dense layer has no untagged role that would help.
    dense = nr.plan(TRN2, nr.get_model("fuji-7b-v3"), shape, par)
    assert not any("tag covers" in n for n in dense.notes)


# --- the line to paste ------------------------------------------------------------------------


def test_an_axlearn_plan_ends_in_a_remat_spec_line_axlearn_runs(axlearn):
    """The last line of the table, run against axlearn's own RematSpec, config_for_function
    and save_and_offload_only_these_names_regex, gives a spec whose closure keeps the
    planned tags."""
    from axlearn.common.base_layer import RematSpec
    from axlearn.common.config import config_for_function
    from axlearn.common.utils import save_and_offload_only_these_names_regex

    planned = nr.plan(TRN2, nr.get_model("fuji-70b-v3"), nr.StepShape(seq_len=8192,
                                                                       micro_batch=2),
                      nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=64))
    how, line = planned.paste()
    assert planned.table().splitlines()[-1] == line and "remat_plan_modifier()" in how
    cfg = _launch("70B", None)
    exec(line, {"cfg": cfg, "RematSpec": RematSpec,  # noqa: S102  as a user pastes it
                "config_for_function": config_for_function,
                "save_and_offload_only_these_names_regex":
                    save_and_offload_only_these_names_regex})
    assert _saved_by(_spec(cfg)) == _matching(["q_proj", "k_proj", "v_proj", "o_proj"])
    assert _spec(cfg).prevent_cse is True  # the TRN2 rule's StackedTransformerLayer
