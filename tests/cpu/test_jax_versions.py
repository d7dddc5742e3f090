"""The same answers on every JAX the Neuron SDK supports (0.7 to 0.10), under both of
JAX's remat implementations (``jax_remat3`` where it exists), and a warning where JAX
would ignore a policy.

CI runs this file on JAX 0.7.2, 0.8.3, the default JAX and Python 3.12's newest; each test
sets the implementation it runs under (`remat`), so CI's ``JAX_REMAT3=true`` run leaves
this file out. The figures below are what all of them measure (benchmarks/jax_versions.py
prints them).
"""

import ast
import contextlib
import dataclasses
import importlib
import logging
import pathlib
import pickle

import jax
import jax.numpy as jnp
import pytest
from jax._src import ad_checkpoint as jax_remat
from jax._src.ad_checkpoint import saved_residuals

import neuron_remat
from neuron_remat import _jaxpr, _trace, models, planner, plugin
from neuron_remat import policies as pol
import reference as ref
from neuron_remat._audit import audit

from small_layer import NAMES, layer, make_args  # noqa: E402
STACK = models.TransformerConfig(hidden=128, heads=8, kv_heads=2, ffn=256, layers=4,
                                 vocab=512, name="test-stack")
TRN2_SAVED = {NAMES[r]: b for r, b in (("q_proj", 2048), ("k_proj", 1024), ("v_proj", 1024),
                                       ("linear1_0", 4096), ("linear1_1", 4096))}
HAS_REMAT3 = hasattr(jax.config, "jax_remat3")
IMPLS = ["remat2", "remat3"] if HAS_REMAT3 else ["remat2"]


@contextlib.contextmanager
def remat(impl):
    """Run under JAX's `impl` remat implementation (jax.checkpoint reads the flag when it
    wraps, checkpoint_name when it traces: both happen inside)."""
    if not HAS_REMAT3:
        assert impl == "remat2"
        yield
        return
    old = jax.config.jax_remat3
    jax.config.update("jax_remat3", impl == "remat3")
    try:
        yield
    finally:
        jax.config.update("jax_remat3", old)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    pol._WARNED.clear()
    yield
    pol._WARNED.clear()


@pytest.fixture(scope="module")
def layer_args():
    return make_args()


def _tags_kept(fn, args):
    return {r.name: r.bytes for r in _jaxpr.residuals(fn, args) if r.kind == "tag"}


# --- the same figures everywhere -----------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_audit_reports_the_same_bytes(layer_args, impl):
    # JAX 0.7/0.8 describe a saved tag as "output of reduce_precision" (and linear1_0 as
    # the output of the jitted silu that reads it); the residuals are read from the VJP's
    # structure, so every version reports the bytes kept per tag.
    with remat(impl):
        report = audit(layer, *layer_args, policy=pol.preset("trn2-fuji-70b"))
    assert {t.name: t.kept_bytes for t in report.tags if t.kept_bytes} == TRN2_SAVED
    # The layer input (2048 B) is an activation; the parameters JAX also keeps (37120 B) are
    # model state, counted apart.
    assert (report.saved_tag_bytes, report.saved_input_bytes, report.saved_other_bytes,
            report.saved_param_bytes) == (12288, 2048, 0, 37120)
    assert (report.recomputed_dots, report.full_remat_dots) == (3, 8)


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_footprint_is_the_same(layer_args, impl):
    with remat(impl):
        fp = _trace.traced_footprint(layer, *layer_args)
    assert fp.always_kept_bytes == 2048
    assert [k for k, v in fp.items() if v.always_kept] == [NAMES["input"]]
    assert {k: v.bytes for k, v in fp.items()} == {
        NAMES["input"]: 2048, **TRN2_SAVED, NAMES["context"]: 2048, NAMES["o_proj"]: 2048,
        NAMES["linear2"]: 0}
    # Each matmul's FLOPs, less the rounding JAX adds to every element it saves (XLA counts
    # that reduce_precision as one FLOP per element).
    assert {k: v.recompute_flops for k, v in fp.items()} == {
        NAMES["input"]: 0, NAMES["q_proj"]: 32768 - 512, NAMES["k_proj"]: 16384 - 256,
        NAMES["v_proj"]: 16384 - 256, NAMES["context"]: 8192 - 512,
        NAMES["o_proj"]: 32768 - 512, NAMES["linear1_0"]: 65536 - 1024,
        NAMES["linear1_1"]: 65536 - 1024, NAMES["linear2"]: 0}
    # XLA's count of the layer's recompute in a scan of two (JAX 0.7.2, 0.8.3 and 0.10.2):
    # its causal mask adds 0 to an 8 x 8 iota, which XLA's simplifier removes
    assert fp.evaluate(()) == (2048, 258656)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_plan_from_the_traced_footprint_is_the_same(layer_args, impl):
    with remat(impl):
        fp = _trace.traced_footprint(layer, *layer_args)
    chosen = planner.plan_footprint(footprint=fp, budget_bytes=2048 + 8192, min_flops_per_byte=0)
    assert set(chosen.saved_tags) == {NAMES["linear1_0"], NAMES["linear1_1"]}
    assert chosen.recompute_flops_per_layer == 129632  # XLA's count, as above


def _compiled_flops(policy, impl):
    params = ref.init_stack(jax.random.PRNGKey(0), STACK, 2)
    x = jnp.ones((2, 64, STACK.hidden))

    def loss(x, p):
        return jnp.sum(ref.stack(x, p, STACK, policy=policy, scan=True))

    with remat(impl):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile()
    return compiled.cost_analysis()["flops"]


@pytest.mark.parametrize("impl", IMPLS)
def test_trn2_preset_compiles_like_its_tag_names_not_like_full_remat(impl):
    # Under remat3 a plain callable policy is full remat (154.48 M FLOPs here); the
    # RegexPolicy compiles exactly as JAX's own save_only_these_names of the same tags.
    names = [n for n in ref.tag_names(STACK).values()
             if pol.preset("trn2-fuji-70b").action(n) == "save"]
    trn2 = _compiled_flops(pol.preset("trn2-fuji-70b"), impl)
    assert trn2 == _compiled_flops(jax.checkpoint_policies.save_only_these_names(*names), impl)
    full = _compiled_flops(None, impl)
    assert full - trn2 > 0.1 * full


# --- remat3 specifics ----------------------------------------------------------------


def test_regex_policy_is_a_policy_type_remat3_recognises():
    policy = pol.preset("trn2-fuji-70b")
    if hasattr(jax_remat, "SaveOnlyTheseNames"):
        assert isinstance(policy, jax_remat.SaveOnlyTheseNames)
    assert NAMES["q_proj"] in policy.saveable_names
    assert NAMES["o_proj"] not in policy.saveable_names and 3 not in policy.saveable_names
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.save = ()
    again = pol.RegexPolicy([pol.QKV_PROJ, pol.LINEAR1])
    assert again == policy and hash(again) == hash(policy)
    assert pol.RegexPolicy([pol.QKV_PROJ]) != policy
    copy = pickle.loads(pickle.dumps(policy))
    assert copy == policy and NAMES["k_proj"] in copy.saveable_names


@pytest.mark.parametrize("impl", IMPLS)
def test_offload_under_each_implementation(layer_args, impl, caplog):
    # The original remat moves what the offload patterns match to the host. JAX 0.10's
    # remat3 has no offload: there it is recomputed (never kept on the device), and the
    # policy says so once. JAX 0.12's remat3 offloads as the original does, and nothing is
    # said. Which of the two this JAX does is read from its own residuals.
    policy = pol.RegexPolicy([".*q_proj"], [".*k_proj"], offload_src="device",
                             offload_dst="pinned_host")
    with remat(impl), caplog.at_level(logging.WARNING, "neuron_remat.policies"):
        res = [r for r in _jaxpr.residuals(jax.checkpoint(layer, policy=policy), layer_args)
               if r.kind != "argument"]
        first = pol.warn_if_ignored(policy)
        pol.warn_if_ignored(policy)
    assert [(r.kind, r.name) for r in res if r.kind == "tag" and not r.host] == \
        [("tag", NAMES["q_proj"])]
    offloaded = [r for r in res if r.host]  # in host memory, a device_put of the tag
    warned = [r for r in caplog.records if "no offload" in r.getMessage()]
    if impl == "remat3" and not offloaded:  # this JAX's remat3 does not offload
        assert first is not None and len(warned) == 1
        assert "recomputed" in first and "JAX_REMAT3=false" in first
    else:
        assert [(r.kind, r.name, r.bytes) for r in offloaded] == [("tag", NAMES["k_proj"], 1024)]
        assert first is None and warned == []


def _kept_by(policy, impl):
    """What JAX keeps for a tagged matmul under `policy` with implementation `impl`."""
    def f(x, w):
        y = jax.ad_checkpoint.checkpoint_name(jnp.sin(x @ w), "a")
        return jnp.sum(jnp.sin(y @ w))

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    with remat(impl):
        return sorted(d for _, d in saved_residuals(jax.checkpoint(f, policy=policy), x, w)
                      if not d.startswith("from the argument"))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_policy_jax_would_ignore_is_warned_about_once(impl, caplog):
    """A policy is warned about exactly when JAX's remat under `impl` treats it as full
    remat (JAX 0.10's remat3 ignores closures; 0.12's calls them), once per kind."""
    cp = jax.checkpoint_policies
    candidates = [cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names("a")),
                  cp.save_and_offload_only_these_names(
                      names_which_can_be_saved=["a"], names_which_can_be_offloaded=[],
                      offload_src="device", offload_dst="pinned_host"),
                  None, pol.preset("trn2-fuji-70b"), cp.everything_saveable,
                  cp.nothing_saveable, cp.save_only_these_names("a"), cp.dots_saveable,
                  cp.dots_with_no_batch_dims_saveable]
    # Ignored: a policy that keeps something under the original remat keeps no more than
    # full remat under `impl`.
    full = {i: _kept_by(cp.nothing_saveable, i) for i in ("remat2", impl)}
    ignored = [p is not None and _kept_by(p, "remat2") != full["remat2"]
               and _kept_by(p, impl) == full[impl] for p in candidates]
    with remat(impl), caplog.at_level(logging.WARNING, "neuron_remat.policies"):
        texts = [pol.warn_if_ignored(p) for p in candidates + candidates]
    n = len(candidates)
    assert [t is not None for t in texts] == ignored + ignored
    assert all("full remat" in t and "RegexPolicy" in t for t in texts if t is not None)
    kinds = {getattr(p, "__qualname__", type(p).__qualname__)
             for p, i in zip(candidates, ignored) if i}
    assert len(caplog.records) == len(kinds) <= n  # once per kind of policy


@pytest.mark.parametrize("impl", IMPLS)
def test_the_deferred_adapter_policy_is_honoured(layer_args, impl, caplog):
    # plugin.checkpoint hands JAX a DeferredPolicy; off Neuron no provider answers and the
    # default stands. Under remat3 it resolves when JAX first asks about a tag.
    trn2 = pol.preset("trn2-fuji-70b")
    with remat(impl):
        kept = _tags_kept(plugin.checkpoint(layer, default=trn2), layer_args)
        assert kept == TRN2_SAVED
        by_name = lambda prim, *_, **p: p.get("name") == NAMES["q_proj"]  # noqa: E731
        with caplog.at_level(logging.WARNING, "neuron_remat.policies"):
            kept = _tags_kept(plugin.checkpoint(layer, default=by_name), layer_args)
    assert kept == {NAMES["q_proj"]: 2048}
    notes = [r.getMessage() for r in caplog.records]
    # Warned exactly where this JAX's remat would treat a plain closure as full remat
    # (JAX 0.10's remat3; 0.12's asks it), read from JAX's residuals.
    closure = lambda prim, *_, **p: p.get("name") == "a"  # noqa: E731
    ignores = _kept_by(closure, impl) == _kept_by(jax.checkpoint_policies.nothing_saveable, impl)
    assert (len(notes) == 1 and "keeps its decisions on tags" in notes[0]) == ignores


# --- imports ---------------------------------------------------------------------------


def test_everything_imported_from_jax_exists():
    # Every `from jax... import name` in the package resolves on the running JAX.
    missing = []
    root = pathlib.Path(neuron_remat.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.name}: {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "jax":
                        importlib.import_module(alias.name)
    assert missing == [], f"JAX {jax.__version__}"


@pytest.mark.parametrize("impl", IMPLS)
def test_fit_chooses_the_same_set(impl, monkeypatch):
    # fit reads the step's layers from a trace under JAX's original remat (remat3 inlines the
    # layer's backward and drops its tags) and compiles its probes under the implementation
    # the host runs: the same set on every JAX and remat implementation.
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from examples import fit_demo

    import neuron_remat as nr

    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge:hbm=60MiB:cores=1")
    make_step, args = fit_demo.small_factory()
    with remat(impl):
        chosen = nr.fit(make_step, *args, reserve=0)
    assert chosen.saved_tags == ("q_proj", "k_proj", "context", "o_proj", "linear1_0",
                                 "linear1_1")
    assert chosen.compiled.bytes <= chosen.compiled.limit_bytes == 60 << 20
