"""Mixture-of-experts and latent-attention layers: the analytic graphs (neuron_remat.moe)
held to what JAX keeps and XLA computes for the plain-JAX reference layers, and the plans
for the built-in MoE models."""

import itertools
import json

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_policies

import neuron_remat as nr
from neuron_remat import _trace, models, moe, planner
from neuron_remat import memory_model as mm
from neuron_remat import reference_moe as rm
from neuron_remat.cli import main

# Tiny layers, float32 (XLA's CPU backend stores bfloat16 as float32). Capacity factor
# 1.25 leaves padding rows in the expert buffers; a shared expert sits beside the routed ones.
EXPERTS = models.MoEConfig(experts=4, experts_per_token=2, expert_ffn=96, shared_ffn=64,
                           capacity_factor=1.25)
LATENT = models.MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                          qk_rope_head_dim=8, v_head_dim=16)
SHAPE = models.StepShape(seq_len=16, micro_batch=2, activation_dtype="float32")


def config(tags, mla=False, shared=True, dense_first=False):
    e = EXPERTS if shared else models.MoEConfig(experts=4, experts_per_token=2,
                                                expert_ffn=96, capacity_factor=1.25)
    if dense_first:
        e = models.MoEConfig(**{**e.__dict__, "dense_layers": (0,)})
    return models.TransformerConfig(
        hidden=64, heads=4, kv_heads=None if mla else 2, ffn=128, layers=2, vocab=64,
        moe=e, mla=LATENT if mla else None, tags=tags, name="tiny")


CASES = {
    "moe-axlearn": (config(models.AXLEARN_TAGS), "moe"),
    "moe-maxtext": (config(models.MAXTEXT_TAGS), "moe"),
    "mla-moe-maxtext": (config(models.MAXTEXT_TAGS, mla=True, shared=False), "moe"),
    "mla-dense-axlearn": (config(models.AXLEARN_TAGS, mla=True, dense_first=True), "dense"),
}


def inputs(cfg, kind, layers=None):
    x = jax.random.normal(jax.random.PRNGKey(1), (SHAPE.micro_batch, SHAPE.seq_len, cfg.hidden))
    if layers is None:
        return x, rm.init_layer(jax.random.PRNGKey(0), cfg, kind)
    return x, rm.init_stack(jax.random.PRNGKey(0), cfg, layers, kind)


def kept_bytes(fn, x, p):
    res = _trace.residuals(fn, (x, p))
    return sum(r.bytes for r in res if r.kind != "argument" or r.argnum == 0)


def tag_sets(names):
    """Every subset of the layer's tags (each tag by its every name)."""
    tags = sorted({n for ns in names.values() for n in ns})
    return [s for r in range(len(tags) + 1) for s in itertools.combinations(tags, r)]


def roles_saved(names, saved):
    return {role for role, ns in names.items() if set(ns) & set(saved)}


@pytest.mark.parametrize("case", list(CASES))
def test_kept_bytes_equal_jax_for_every_tag_subset(case):
    cfg, kind = CASES[case]
    x, p = inputs(cfg, kind)
    names = rm.tag_names(cfg, kind)
    graph = moe.layer_graph(cfg, SHAPE, kind=kind)
    subsets = tag_sets(names)
    assert len(subsets) >= 2 ** 9
    fn = lambda x, p: rm.layer(x, p, cfg, kind)  # noqa: E731
    for saved in subsets:
        policy = checkpoint_policies.save_only_these_names(*saved)
        measured = kept_bytes(jax.checkpoint(fn, policy=policy), x, p)
        predicted = graph.evaluate_roles(roles_saved(names, saved)).kept_bytes
        assert predicted == measured, saved


@pytest.mark.parametrize("case", list(CASES))
def test_no_remat_bytes_match_jax(case):
    cfg, kind = CASES[case]
    x, p = inputs(cfg, kind)
    measured = kept_bytes(lambda x, p: rm.layer(x, p, cfg, kind), x, p)
    assert moe.layer_graph(cfg, SHAPE, kind=kind).no_remat_bytes() == pytest.approx(
        measured, rel=0.03)
