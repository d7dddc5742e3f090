"""Each adapter against its real host library: flax linen ``nn.remat``, flax NNX
``nnx.remat`` (function and decorator forms), equinox ``filter_checkpoint`` (function and
decorator forms) and plain ``jax.checkpoint`` (`neuron_remat.checkpoint`).

What JAX keeps for the backward is read with ``jax._src.ad_checkpoint.saved_residuals``
on the real wrapped layer (`reference.layer` (tests/cpu/reference.py), the layer the planner models):

* on a simulated TRN2 core, with the model described, it keeps exactly the tags the
  planner chose; with nothing described, exactly the tags axlearn's TRN2 preset saves;
* on the CPU, it keeps exactly what the host library keeps when given the host's default
  policy directly;
* wrapping does not detect the device: that happens when the layer is first traced.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals
from jax.ad_checkpoint import checkpoint_name

import neuron_remat as nr
from neuron_remat import device as nr_device
from neuron_remat import plugin
from neuron_remat.adapters.equinox import filter_checkpoint
from neuron_remat.adapters.flax import nnx_remat
from neuron_remat.adapters.flax import remat as linen_remat

import reference  # tests/cpu/reference.py, the plain-JAX layer

# A two-layer model small enough to trace in milliseconds. On one simulated TRN2 core with
# 1064 KiB of HBM the planner saves k_proj, linear1_0 and linear1_1 (44 KiB of a 46.5 KiB
# per-layer budget): not nothing, not every tag, and not the TRN2 preset's set (which
# adds q_proj and v_proj).
CONFIG = nr.TransformerConfig(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, vocab=64,
                              flash_attention=False, name="adapter-test")
SHAPE = nr.StepShape(seq_len=32, micro_batch=1, activation_dtype="float32",
                     param_dtype="float32", optimizer="sgd")
TRN2 = "trn2.48xlarge:hbm=1064KiB:cores=1"
CONTEXT: dict[str, Any] = {"stack": "stacked", "layer": "decoder.layer", "model": CONFIG,
                           "shape": SHAPE, "parallelism": nr.Parallelism()}
# The host's own default, distinct from "save nothing" so that the comparison on the CPU
# is not vacuous.
HOST_DEFAULT = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
NAMES = reference.tag_names(CONFIG)  # role -> full tag, e.g. "MultiheadAttention.q_proj"

KINDS = ("jax", "linen", "nnx", "nnx-decorator", "equinox", "equinox-decorator")
ADAPTER = object()  # "wrap with neuron_remat's adapter" (vs. a policy given directly)


# --------------------------------------------------------------------------------------
# One layer per host library, each a pure function of arrays for saved_residuals.
# --------------------------------------------------------------------------------------


class LinenLayer(nn.Module):
    """The reference layer as a linen module (its parameters one pytree)."""

    config: nr.TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        p = self.param("layer", lambda key: reference.init_layer(key, self.config))
        return reference.layer(x, p, self.config)


class NnxLayer(nnx.Module):
    """The reference layer as an NNX module."""

    def __init__(self, config: nr.TransformerConfig, key: jax.Array) -> None:
        self.config = config
        self.p = nnx.data({k: nnx.Param(v) for k, v in
                           reference.init_layer(key, config).items()})

    def __call__(self, x: jax.Array) -> jax.Array:
        return reference.layer(x, {k: v[...] for k, v in self.p.items()}, self.config)


class EqxLayer(eqx.Module):
    """The reference layer as an equinox module."""

    p: dict[str, jax.Array]
    config: nr.TransformerConfig = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        return reference.layer(x, self.p, self.config)


@dataclass(frozen=True)
class Traceable:
    """A wrapped layer as a function of arrays, and the arguments to trace it with."""

    fn: Callable[..., jax.Array]
    args: tuple[Any, ...]

    def residuals(self) -> list[tuple[str, str]]:
        """(aval, JAX's description) of every residual kept for the backward. An argument is
        "from the argument" whatever JAX calls it: remat3 names it from the signature it
        sees (``x``, or ``args[0]`` through a wrapper), which is not what is compared."""
        return [(aval.str_short(), re.sub(r"^from the argument .*", "from the argument", desc))
                for aval, desc in saved_residuals(self.fn, *self.args)]

    def saved_tags(self) -> set[str]:
        return named(self.residuals())


def named(residuals: list[tuple[str, str]]) -> set[str]:
    """The ``checkpoint_name`` tags among `residuals` (JAX: "named 'TAG' from ...")."""
    return {m.group(1) for _, d in residuals if (m := re.match(r"named '([^']+)'", d))}


def _x() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (SHAPE.micro_batch, SHAPE.seq_len,
                                                 CONFIG.hidden), jnp.float32)


def wrapped(kind: str, policy: Any = ADAPTER, **context: Any) -> Traceable:
    """The reference layer wrapped the way host `kind` does it: with neuron_remat's
    adapter for `context` (``policy=ADAPTER``), or with the host's own remat given
    `policy` directly (prevent_cse=True, as the adapter picks for unrolled layers).

    Every call builds fresh function objects: see `test_rewrapping_an_equal_context_...`
    for why that matters."""
    ctx = {**CONTEXT, **context}
    adapter = policy is ADAPTER
    x, key = _x(), jax.random.key(0)
    if kind == "jax":
        def layer(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
            return reference.layer(x, p, CONFIG)
        fn = (nr.checkpoint(layer, **ctx) if adapter
              else jax.checkpoint(layer, policy=policy, prevent_cse=True))
        return Traceable(fn, (x, reference.init_layer(key, CONFIG)))
    if kind == "linen":
        cls = (linen_remat(LinenLayer, **ctx) if adapter
               else nn.remat(LinenLayer, policy=policy, prevent_cse=True))
        module = cls(CONFIG)
        variables = module.init(key, x)
        return Traceable(lambda v, x: module.apply(v, x), (variables, x))
    if kind in ("nnx", "nnx-decorator"):
        def forward(m: NnxLayer, x: jax.Array) -> jax.Array:
            return m(x)
        if not adapter:
            fwd = nnx.remat(forward, policy=policy, prevent_cse=True)
        elif kind == "nnx":
            fwd = nnx_remat(forward, **ctx)
        else:
            @nnx_remat(**ctx)
            def fwd(m: NnxLayer, x: jax.Array) -> jax.Array:
                return m(x)
        graphdef, state = nnx.split(NnxLayer(CONFIG, key))
        return Traceable(lambda s, x: fwd(nnx.merge(graphdef, s), x), (state, x))
    if kind in ("equinox", "equinox-decorator"):
        def call(m: EqxLayer, x: jax.Array) -> jax.Array:
            return m(x)
        if not adapter:
            efn = eqx.filter_checkpoint(call, policy=policy, prevent_cse=True)
        elif kind == "equinox":
            efn = filter_checkpoint(call, **ctx)
        else:
            @filter_checkpoint(**ctx)
            def efn(m: EqxLayer, x: jax.Array) -> jax.Array:
                return m(x)
        return Traceable(efn, (EqxLayer(reference.init_layer(key, CONFIG), CONFIG), x))
    raise ValueError(kind)


def tags_saved_by(policy: nr.RegexPolicy) -> set[str]:
    """The full tags of the reference layer that `policy` saves and JAX can keep: not the
    layer input (it is an argument, kept anyway) and not linear2 (the backward never
    reads it)."""
    return {NAMES[r] for r in CONFIG.roles if r not in ("input", "linear2")
            and policy.action(NAMES[r]) == "save"}


def planned_tags() -> set[str]:
    chosen = nr.plan(nr.parse_device(TRN2), CONFIG, SHAPE, nr.Parallelism())
    return {NAMES[t] for t in chosen.saved_tags}


def _only_arguments_and(res: list[tuple[str, str]]) -> bool:
    """A names policy keeps only the arguments and named values: nothing else."""
    return all(d.startswith(("from the argument", "named ")) for _, d in res)


# --------------------------------------------------------------------------------------
# The expectations the tests hold the adapters to.
# --------------------------------------------------------------------------------------


def test_the_planned_set_is_a_real_trade_off():
    planned = planned_tags()
    preset = tags_saved_by(nr.preset("trn2-fuji-70b"))
    candidates = {NAMES[r] for r in CONFIG.roles if r not in ("input", "linear2")}
    # Today {k_proj, linear1_0, linear1_1}; several sets tie on bytes and FLOPs (k_proj
    # and v_proj are the same size), so only what makes the tests below meaningful is
    # held here: something saved, not everything, and not the preset's set.
    assert set() < planned < candidates and planned != preset


# --------------------------------------------------------------------------------------
# On a simulated TRN2: the planned policy, or the preset.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_on_trn2_the_layer_keeps_exactly_the_planned_tags(kind, monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", TRN2)
    res = wrapped(kind).residuals()
    assert named(res) == planned_tags()
    assert _only_arguments_and(res), res


@pytest.mark.parametrize("kind", KINDS)
def test_on_trn2_without_a_model_the_layer_keeps_the_preset_tags(kind, monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", TRN2)
    res = wrapped(kind, model=None, shape=None, parallelism=None).residuals()
    assert named(res) == tags_saved_by(nr.preset("trn2-fuji-70b")) == {
        NAMES[r] for r in ("q_proj", "k_proj", "v_proj", "linear1_0", "linear1_1")}
    assert _only_arguments_and(res), res


def test_a_plan_for_a_model_knows_every_name_its_host_emits():
    """MaxText's every per-tensor remat key (its checkpoint names: base.yml's 22 and 0.2.5's
    two more) and axlearn's class-prefixed names are known to a plan for that host, so
    its layers are not warned about; a name of neither is not. On a Neuron device
    MaxText's ``context`` is not (only its cuDNN and TPU flash kernels tag it)."""
    from neuron_remat._maxtext_keys import BASE_YML_KEYS

    model = nr.get_model("mixtral-8x7b")
    maxtext = (*(k for k in BASE_YML_KEYS if k != "context"), "moe_x_sorted", "moe_routing_maps")
    for tags, names in ((nr.MAXTEXT_TAGS, maxtext),
                        (nr.AXLEARN_TAGS, ("MultiheadAttention.q_proj", "TransformerLayer.input",
                                           "TopKGating.gate_weights"))):
        plan = nr.plan(nr.from_instance_type("trn2.48xlarge"),
                       dataclasses.replace(model, tags=tags), nr.StepShape(seq_len=4096),
                       nr.Parallelism(tp=4, fsdp=-1))
        assert [n for n in names if not plan.counts_tag(n)] == [], tags.vocabulary
        assert not plan.counts_tag("my_block.extra")
        assert not plan.counts_tag("context") or tags is nr.AXLEARN_TAGS


def test_a_layer_tag_the_plan_does_not_know_is_warned_about_once(monkeypatch, caplog):
    """The reference layer emits the model's tags: no warning. A layer that names a value
    otherwise (here one more tag beside the model's) gets one warning naming it, however
    often it is traced and however many layers are wrapped, and JAX recomputes it (it is
    not among the kept residuals)."""
    monkeypatch.setenv("NEURON_REMAT_DEVICE", TRN2)
    with caplog.at_level(logging.WARNING, logger="neuron_remat"):
        wrapped("linen").residuals()
    assert not [r for r in caplog.records if "does not know" in r.getMessage()]

    def layer(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        y = reference.layer(x, p, CONFIG)
        return jnp.tanh(checkpoint_name(y * 2.0, "my_block.extra")) + y

    p = reference.init_layer(jax.random.key(0), CONFIG)
    fn = nr.checkpoint(layer, **CONTEXT)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="neuron_remat"):
        res = saved_residuals(fn, _x(), p)
        saved_residuals(fn, _x(), p)
        saved_residuals(nr.checkpoint(layer, **CONTEXT), _x(), p)  # a second layer
    said = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(said) == 1 and "'my_block.extra'" in said[0], said
    kept = named([(a.str_short(), d) for a, d in res])
    assert "my_block.extra" not in kept and kept == planned_tags(), kept


# --------------------------------------------------------------------------------------
# On the CPU: the host's default, exactly as the host applies it itself.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_on_cpu_the_adapter_keeps_what_the_host_default_keeps(kind):
    assert not nr.detect().is_neuron  # the CPU here (any non-Neuron backend will do)
    via_adapter = wrapped(kind, default=HOST_DEFAULT).residuals()
    direct = wrapped(kind, policy=HOST_DEFAULT).residuals()
    assert via_adapter == direct
    # Not vacuous: the default keeps the projections' outputs, full remat would not.
    assert len(direct) > len(wrapped(kind, policy=None).residuals())
    assert any(d.startswith("output of dot_general") for _, d in direct)


@pytest.mark.parametrize("kind", KINDS)
def test_on_cpu_with_no_default_the_adapter_recomputes_everything(kind):
    via_adapter = wrapped(kind).residuals()
    assert via_adapter == wrapped(kind, policy=None).residuals()
    assert all(d.startswith("from the argument") for _, d in via_adapter)


# --------------------------------------------------------------------------------------
# Wrapping defers detection to the first trace.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_wrapping_does_not_detect_the_traced_policy_uses_the_fixed_environment(
        kind, monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn9")  # not a device: detect() would raise
    with pytest.raises(ValueError, match="trn9"):
        nr.detect()
    nr_device._CACHE.clear()
    # Wrap (and, for linen, initialise: a forward pass asks the policy nothing) ...
    traced = wrapped(kind)
    # ... and nothing was asked: no detection ran, no provider answered.
    assert not nr_device._CACHE and not plugin._RESULTS
    monkeypatch.setenv("NEURON_REMAT_DEVICE", TRN2)
    assert traced.saved_tags() == planned_tags()
    # the one detection that ran was at trace time, and it read the fixed value
    assert [spec.hbm_bytes_per_core for spec in nr_device._CACHE.values()] == [1064 * 1024]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_device_surfaces_at_trace_time_under_strict(kind, monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn9")
    monkeypatch.setenv("NEURON_REMAT_STRICT", "1")
    traced = wrapped(kind, default=HOST_DEFAULT)  # wrapping (and linen init) is fine
    with pytest.raises(ValueError, match="trn9"):
        traced.residuals()


def test_a_bad_device_without_strict_warns_and_the_default_stands(monkeypatch, caplog):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn9")
    with caplog.at_level("WARNING", logger="neuron_remat.plugin"):
        res = wrapped("jax", default=HOST_DEFAULT).residuals()
    assert res == wrapped("jax", policy=HOST_DEFAULT).residuals()
    assert any("trn9" in r.getMessage() and "default policy stands" in r.getMessage()
               for r in caplog.records)


# --------------------------------------------------------------------------------------
# JAX caches remat partial evaluation per (jaxpr, policy); deferred policies compare by
# identity so a re-wrap after the environment changed is asked again.
# --------------------------------------------------------------------------------------


def test_rewrapping_an_equal_context_after_the_environment_changed(monkeypatch):
    def layer(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        return reference.layer(x, p, CONFIG)

    args = (_x(), reference.init_layer(jax.random.key(0), CONFIG))
    on_cpu = Traceable(nr.checkpoint(layer, **CONTEXT), args)
    assert on_cpu.saved_tags() == set()
    monkeypatch.setenv("NEURON_REMAT_DEVICE", TRN2)
    plugin.clear_cache()
    on_trn2 = Traceable(nr.checkpoint(layer, **CONTEXT), args)
    assert on_trn2.saved_tags() == planned_tags()


# --- plans end in the line to paste ---------------------------------------------------------


def test_a_traced_plan_ends_in_a_jax_checkpoint_call_that_keeps_the_planned_tags():
    import small_layer as sl

    x, params = sl.make_args()
    fp = nr.traced_footprint(sl.layer, x, params)
    budget = fp.evaluate(())[0] + fp.evaluate(())[0] // 2
    plan = nr.plan_footprint(footprint=fp, budget_bytes=budget)
    assert plan.saved_tags and set(plan.saved_tags) != set(fp)  # not nothing, not all
    how, line = plan.paste()
    assert plan.table().splitlines()[-2:] == [f"# {how}:", line]
    assert line.startswith("layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.")
    scope = {"jax": jax, "layer": sl.layer}
    exec(line, scope)  # noqa: S102  the pasted line, as a user would run it
    kept = named([(a.str_short(), d) for a, d in saved_residuals(scope["layer"], x, params)])
    assert kept - {sl.NAMES["input"]} == set(plan.saved_tags) - {sl.NAMES["input"]}


def test_a_maxtext_plan_ends_in_its_remat_policy_custom_keys(monkeypatch):
    from neuron_remat.adapters import maxtext

    config = dataclasses.replace(nr.get_model("llama3-8b"), tags=nr.MAXTEXT_TAGS)
    plan = nr.plan(nr.from_instance_type("trn2.48xlarge"), config, nr.StepShape(seq_len=8192),
                   nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1))
    how, line = plan.paste()
    assert plan.table().splitlines()[-1] == line and how.startswith("MaxText")
    keys = dict(item.split("=") for item in line.split())
    assert keys.pop("remat_policy") == "custom"
    assert set(keys) <= set(maxtext.BASE_YML_KEYS)  # MaxText's own per-tensor keys
    assert set(keys.values()) <= set(maxtext.ALLOWED_VALUES)
    assert {k for k, v in keys.items() if v == "device"} == {"decoder_layer_input",
                                                             *plan.saved_tags}
    assert keys["context"] == "remat"  # not emitted on Neuron; set, not left to the user's
    # every key the adapter sets, as it sets it: a key left out keeps the user's value
    assert keys == {k: v for k, v in maxtext.overrides_for(plan).items()
                    if k != "remat_policy"}


def test_exact_ties_are_shown_as_ties():
    cost = dataclasses.make_dataclass("Cost", ["bytes", "recompute_flops"])
    fp = {"a": cost(100, 1e6), "b": cost(100, 1e6), "c": cost(100, 5e5)}
    plan = nr.plan_footprint(footprint=fp, budget_bytes=150)
    assert plan.saved_tags in (("a",), ("b",))
    other = "b" if plan.saved_tags == ("a",) else "a"
    lines = plan.table().splitlines()
    tie = f"tie: ['{other}']: 100 B/layer, 0.0015 GFLOP/layer, exactly as good as the plan"
    assert tie in lines
    assert not any(line.startswith(f"runner-up: ['{other}']") for line in lines)
    assert "runner-up: ['c']: 100 B/layer, 0.002 GFLOP/layer" in lines
