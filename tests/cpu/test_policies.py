"""RegexPolicy, presets and the audit, on real JAX tracing."""

import inspect
import json
import logging
import pickle
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import name_p, saved_residuals
from jax.ad_checkpoint import Offloadable, Recompute, Saveable, checkpoint_name, checkpoint_policies
from jax.extend.core import Primitive

from neuron_remat._audit import DeadPatternError, audit
from neuron_remat import policies as pol
import reference as ref
from neuron_remat.cli import main

# A small layer of the shape the presets are for (shared with test_jax_versions.py).
from small_layer import CFG, NAMES, layer, make_args  # noqa: E402


@pytest.fixture(scope="module")
def layer_args():
    return make_args()


# --- the policy object -----------------------------------------------------------------


def test_policy_decides_by_fullmatch_on_the_tag():
    p = pol.RegexPolicy([r".*[kqv]_proj", r".*linear1_[01]"])
    assert p(name_p, name="MultiheadAttention.q_proj") is Saveable
    assert p(name_p, name="TransformerFeedForwardLayer.linear1_1") is Saveable
    assert p(name_p, name="MultiheadAttention.o_proj") is Recompute
    assert p(name_p, name="MultiheadAttention.q_proj_extra") is Recompute  # fullmatch
    assert p(jax.lax.dot_general_p) is Recompute  # any other primitive


def test_primitive_is_compared_by_name_so_copies_match():
    copy = Primitive("name")
    assert copy is not name_p
    assert pol.RegexPolicy([".*q_proj"])(copy, name="a.q_proj") is Saveable


def test_save_wins_over_offload_and_offload_carries_src_dst():
    p = pol.RegexPolicy([".*q_proj"], [".*_proj"], offload_src="device",
                        offload_dst="pinned_host")
    assert p(name_p, name="x.q_proj") is Saveable
    assert p(name_p, name="x.k_proj") == Offloadable(src="device", dst="pinned_host")
    assert p.action("x.v_proj") == "offload" and p.action("x.context") == "recompute"
    assert p.matching("x.q_proj") == (("save", ".*q_proj"), ("offload", ".*_proj"))


def test_list_and_string_forms_are_one_alternation_and_decisions_are_cached():
    listed = pol.RegexPolicy([".*q_proj", ".*k_proj"])
    assert listed.save_regex == ".*q_proj|.*k_proj"
    assert pol.RegexPolicy(".*q_proj").save == (".*q_proj",)
    assert pol.RegexPolicy(re.compile(".*Q_PROJ", re.IGNORECASE)).action("a.q_proj") == "save"
    listed(name_p, name="a.q_proj")
    assert listed._decisions == {"a.q_proj": Saveable}


def test_top_level_alternatives_become_separate_patterns():
    assert pol.RegexPolicy(".*[kqv]_proj|.*linear1_[01]") == pol.preset("trn2-fuji-70b")
    assert pol.RegexPolicy(r"(a\.x|b)").save == (r"a\.x", "b")  # one group around it all
    kept_whole = [r".*([qkvo]_proj|context)", r"(a|b)c", r"[|]x", r"a\|b", r"(a)\1|b"]
    for pattern in kept_whole:
        assert pol.RegexPolicy(pattern).save == (pattern,)
    flagged = pol.RegexPolicy(r"(?i)A|B")  # global flags become scoped, kept whole
    assert flagged.save == ("(?i:A|B)",) and flagged.action("b") == "save"
    assert pol.RegexPolicy(r"[|]x|y").save == (r"[|]x", "y")


def test_audit_finds_the_dead_branches_of_one_long_regex(layer_args):
    # The single-string pattern first proposed in axlearn PR #898's review: two of its four
    # branches name tags that no layer emits.
    x, params = layer_args
    pr_pattern = (r"(TransformerAttentionLayer\.residual_add|.*\.?(k|q|v)_proj"
                  r"|.*\.?linear1_[01]|TransformerFeedForwardLayer\.mlp_residual)")
    report = audit(layer, x, params, policy=pol.RegexPolicy(pr_pattern))
    assert report.dead_patterns == (r"TransformerAttentionLayer\.residual_add",
                                    r"TransformerFeedForwardLayer\.mlp_residual")
    saved = {t.name for t in report.tags if t.action == "save"}
    assert saved == {NAMES[r] for r in ("q_proj", "k_proj", "v_proj", "linear1_0", "linear1_1")}


def test_signature_is_axlearns():
    sig = inspect.signature(pol.save_and_offload_only_these_names_regex)
    assert list(sig.parameters) == ["names_which_can_be_saved", "names_which_can_be_offloaded",
                                    "offload_src", "offload_dst"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in sig.parameters.values())
    # axlearn's golden TRN2 config, unchanged:
    p = pol.save_and_offload_only_these_names_regex(
        names_which_can_be_saved=".*[kqv]_proj|.*linear1_[01]",
        names_which_can_be_offloaded=None, offload_src=None, offload_dst=None)
    assert isinstance(p, pol.RegexPolicy)
    assert p.action("GroupedQueryAttention.k_proj") == "save"
    assert p.action("TransformerFeedForwardLayer.linear2") == "recompute"
    # An empty or None pattern turns its branch off, as in axlearn.
    off = pol.save_and_offload_only_these_names_regex(
        names_which_can_be_saved="", names_which_can_be_offloaded=None,
        offload_src="device", offload_dst="pinned_host")
    assert off.save == () and off.offload == () and off.offload_dst is None


# --- bad input -------------------------------------------------------------------------


def test_invalid_regex_names_the_pattern_and_the_error():
    with pytest.raises(ValueError, match=r"invalid regex '\.\*\[kqv_proj' in save patterns: "
                                         "unterminated character set"):
        pol.RegexPolicy([".*[kqv_proj"])


@pytest.mark.parametrize("pattern", [".*", "(x)?.*", ".+", "(.*)", ".*|q_proj", "[^\n]*"])
def test_match_everything_is_rejected_unless_allowed(pattern):
    with pytest.raises(ValueError, match="matches every tag"):
        pol.RegexPolicy([pattern])
    assert pol.RegexPolicy([pattern], allow_everything=True).action("anything") == "save"


def test_an_alternation_that_together_matches_everything_is_rejected():
    with pytest.raises(ValueError, match="matches every tag"):
        pol.RegexPolicy([r"[a-m].*", r"[^a-m].*"])


def test_offload_needs_src_and_dst():
    with pytest.raises(ValueError, match=r"offload patterns \['\.\*q_proj'\] need offload_src"):
        pol.RegexPolicy(offload=[".*q_proj"])


def test_offload_is_refused_on_neuron_unless_allowed(monkeypatch):
    monkeypatch.setenv("NEURON_REMAT_DEVICE", "trn2.48xlarge")
    with pytest.raises(ValueError, match="Neuron compiler does not document host offload"):
        pol.RegexPolicy(offload=[".*q_proj"], offload_src="device", offload_dst="pinned_host")
    ok = pol.RegexPolicy(offload=[".*q_proj"], offload_src="device", offload_dst="pinned_host",
                         allow_offload_on_neuron=True)
    assert ok.action("a.q_proj") == "offload"


def test_non_string_pattern_is_a_type_error():
    with pytest.raises(TypeError, match=r"str or a compiled str pattern \(re.Pattern\[str\]\); got int"):
        pol.RegexPolicy([3])  # type: ignore[list-item]


# --- equality, hashing and the jit cache -----------------------------------------------


def test_equal_patterns_are_equal_hashable_policies():
    a = pol.RegexPolicy([".*q_proj", ".*k_proj"])
    b = pol.RegexPolicy((".*q_proj", ".*k_proj"), allow_everything=True)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    # The order never changes a decision, so it changes neither equality nor the hash.
    assert a == pol.RegexPolicy([".*k_proj", ".*q_proj"])
    assert hash(a) == hash(pol.RegexPolicy({".*k_proj", ".*q_proj"}))
    assert a != pol.RegexPolicy([".*k_proj"])
    assert pickle.loads(pickle.dumps(a)) == a
    assert pickle.loads(pickle.dumps(a)).action("x.q_proj") == "save"


def test_an_equal_policy_hits_the_jit_cache(layer_args):
    traces = []

    def step(x, params, policy):
        traces.append(policy)
        return jnp.sum(jax.grad(lambda x: jnp.sum(jax.checkpoint(layer, policy=policy)(
            x, params)))(x))

    jitted = jax.jit(step, static_argnames="policy")
    x, params = layer_args
    first = jitted(x, params, pol.RegexPolicy([".*[kqv]_proj"]))
    second = jitted(x, params, pol.RegexPolicy([".*[kqv]_proj"]))  # a new, equal object
    assert len(traces) == 1
    np.testing.assert_array_equal(first, second)
    jitted(x, params, pol.RegexPolicy([".*o_proj"]))
    assert len(traces) == 2


# --- presets ---------------------------------------------------------------------------


def test_presets_are_built_from_named_constants():
    assert set(pol.PRESETS) >= {"trn2-fuji-70b", "native-attention", "qkv-proj",
                                "feed-forward", "full", "none"}
    assert pol.PRESETS["trn2-fuji-70b"].policy.save_regex == ".*[kqv]_proj|.*linear1_[01]"
    assert pol.PRESETS["native-attention"].policy.save == (pol.NATIVE_ATTENTION,)
    assert pol.PRESETS["feed-forward"].policy.save == (pol.LINEAR1, pol.LINEAR2)
    assert pol.PRESETS["full"].policy.save == ()
    assert all(p.reason for p in pol.PRESETS.values())
    combined = pol.preset("qkv-proj") | pol.RegexPolicy([pol.LINEAR1])
    assert combined == pol.preset("trn2-fuji-70b")
    with pytest.raises(ValueError, match="unknown preset 'fastest'; valid: trn2-fuji-70b"):
        pol.preset("fastest")


def _dots(fn, *args):
    """dot_generals in the linearized program, counted as axlearn's test does."""
    _, linear = jax.linearize(fn, *args)
    return str(linear).count(" dot_general")


def test_trn2_preset_recomputes_five_fewer_dots_than_full_remat(layer_args):
    # Full remat recomputes 8 of the layer's 9 matmuls in the backward: q, k, v, the
    # scores, probs @ v, o, linear1_0 and linear1_1 (linear2's output is only added to the
    # residual stream, so nothing needs it recomputed). Saving q, k, v, linear1_0 and
    # linear1_1 removes exactly those 5; the scores, probs @ v and o are still redone
    # (o because the second norm reads x + o).
    x, params = layer_args
    full = _dots(jax.checkpoint(layer), x, params)
    fuji = _dots(jax.checkpoint(layer, policy=pol.preset("trn2-fuji-70b")), x, params)
    assert full - fuji == 5
    assert full - _dots(layer, x, params) == 8


def test_native_attention_recomputes_five_fewer_dots(layer_args):
    # Saving q, k, v, context and o removes their 5 matmuls (probs @ v is context's); the
    # scores, linear1_0 and linear1_1 are still redone. No flash attention here.
    x, params = layer_args
    full = _dots(jax.checkpoint(layer), x, params)
    native = _dots(jax.checkpoint(layer, policy=pol.preset("native-attention")), x, params)
    assert full - native == 5
    report = audit(layer, x, params, policy=pol.preset("native-attention"))
    assert (report.full_remat_dots, report.recomputed_dots) == (8, 3)


@pytest.mark.parametrize("name", list(pol.PRESETS))
def test_preset_saves_what_literal_names_save(layer_args, name):
    x, params = layer_args
    policy = pol.preset(name)
    literal = [NAMES[r] for r in ref.PRESET_ROLES[name]]  # written by hand
    # JAX's own names policy, which both remat implementations honour (remat3 ignores the
    # closure save_and_offload_only_these_names returns).
    jax_policy = checkpoint_policies.save_only_these_names(*literal)

    def kept(p):
        return [(a.str_short(), src) for a, src in
                saved_residuals(jax.checkpoint(layer, policy=p), x, params)]

    assert kept(policy) == kept(jax_policy)


@pytest.mark.parametrize("name", list(pol.PRESETS))
def test_gradients_under_every_preset_equal_no_remat(layer_args, name):
    x, params = layer_args

    def loss(f):
        return lambda x, p: jnp.sum(jnp.tanh(f(x, p)))

    want = jax.grad(loss(layer), argnums=(0, 1))(x, params)
    got = jax.grad(loss(jax.checkpoint(layer, policy=pol.preset(name))), argnums=(0, 1))(
        x, params)
    # float32: JAX 0.7's XLA orders the recomputed sums differently (single elements move
    # by ~2e-5 relative there).
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# --- the audit -------------------------------------------------------------------------


def test_audit_finds_dead_patterns_and_overlaps(layer_args):
    x, params = layer_args
    policy = pol.RegexPolicy([r".*[kqv]_proj", r".*q_proj", r".*linear2_[01]",
                              r"TransformerAttentionLayer\.residual_add"])
    report = audit(layer, x, params, policy=policy)
    assert report.dead_patterns == (r".*linear2_[01]", r"TransformerAttentionLayer\.residual_add")
    assert report.overlaps == (("MultiheadAttention.q_proj", (r".*[kqv]_proj", r".*q_proj")),)
    by_name = {t.name: t for t in report.tags}
    q = by_name["MultiheadAttention.q_proj"]
    assert (q.action, q.pattern, q.also_matched) == ("save", r".*[kqv]_proj", (r".*q_proj",))
    assert q.shape == (2, 8, 4, 8) and q.dtype == "float32" and q.bytes == 2 * 8 * 4 * 8 * 4
    assert q.kept_bytes == q.bytes
    assert by_name["TransformerFeedForwardLayer.linear2"].action == "recompute"
    assert list(by_name) == list(NAMES.values())  # every tag, in program order
    with pytest.raises(DeadPatternError, match=r"linear2_\[01\]"):
        audit(layer, x, params, policy=policy, strict=True)


def test_audit_residual_split_and_rendering(layer_args):
    x, params = layer_args
    report = audit(layer, x, params, policy=pol.preset("trn2-fuji-70b"))
    b, s, h = x.shape
    tags = b * s * (4 * 8 + 2 * 2 * 8 + 2 * 64) * 4  # q, k, v, linear1_0, linear1_1
    assert report.saved_tag_bytes == tags
    weights = sum(v.size * 4 for v in jax.tree.leaves(params))
    assert report.activation_argnums == (0,)  # x matches the output; params are state
    assert report.saved_input_bytes == x.size * 4 and report.saved_param_bytes == weights
    assert report.saved_bytes == tags + x.size * 4 + report.saved_other_bytes
    assert report.recomputed_dots == 3 and report.recompute_flops > 0
    data = json.loads(report.to_json())
    assert data["dead_patterns"] == [] and data["policy"]["save"] == list(
        pol.preset("trn2-fuji-70b").save)
    table = report.table()
    assert "MultiheadAttention.k_proj" in table and "dot_generals recomputed" in table


def test_audit_counts_tags_inside_scan():
    cfg = CFG
    params = ref.init_stack(jax.random.PRNGKey(0), cfg, 3)
    x = jnp.ones((1, 4, cfg.hidden))
    report = audit(lambda x, p: ref.stack(x, p, cfg, policy="none"), x, params,
                       policy=pol.preset("qkv-proj"))
    assert {t.count for t in report.tags} == {3}
    assert report.inner_checkpoints == 0


def test_audit_counts_offloaded_tags_in_host_memory_not_on_the_device():
    """An offloading policy: JAX keeps the tag's value in host memory (``saved_residuals``
    lists it as ``float32<host>``, output of device_put); audit puts it with its tag, as
    offloaded, and out of the device's kept bytes (before: 'other', on the device)."""
    from jax._src.ad_checkpoint import saved_residuals

    def layer(x, w):
        h = checkpoint_name(x @ w, "up")
        return jnp.sin(checkpoint_name(jnp.tanh(h) @ w, "down")) @ w

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    policy = pol.RegexPolicy(["down"], ["up"], offload_src="device", offload_dst="pinned_host")
    report = audit(layer, x, w, policy=policy)
    listed = saved_residuals(jax.checkpoint(layer, policy=policy), x, w)
    host = sum(a.size * a.dtype.itemsize for a, _ in listed if "<host>" in str(a))
    device = sum(a.size * a.dtype.itemsize for a, why in listed
                 if "<host>" not in str(a) and "argument w" not in why)
    if not host:
        pytest.skip("this JAX keeps no residual in host memory for a RegexPolicy (jax_remat3 "
                    "honours JAX's own policy types only)")
    by = {t.name: t for t in report.tags}
    assert host == by["up"].offloaded_bytes == report.saved_host_bytes == 4 * 8 * 4
    assert by["up"].kept_bytes == 0 and by["down"].kept_bytes == 4 * 8 * 4
    assert report.saved_bytes == device and report.saved_other_bytes == 0


def test_audit_warns_of_a_checkpoint_already_inside(caplog):
    """A whole model with nn.remat inside: the audited policy wraps the inner checkpoint,
    whose own policy decides what it keeps; audit says so (before: a negative recompute,
    silently)."""
    def layer(x, w):
        return jnp.sin(checkpoint_name(x @ w, "up")) @ w

    inner = jax.checkpoint(layer)  # saves nothing, its own policy
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    with caplog.at_level(logging.WARNING, logger="neuron_remat"):
        report = audit(lambda x, w: inner(inner(x, w), w), x, w,
                       policy=pol.RegexPolicy(["up"]))
    assert report.inner_checkpoints == 2 and "WARNING: the function already holds 2" in \
        report.table() and report.to_dict()["inner_checkpoints"] == 2
    assert sum("already holds" in r.getMessage() for r in caplog.records) == 1


# --- the CLI ---------------------------------------------------------------------------


def test_cli_presets_json(capsys):
    assert main(["presets", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["trn2-fuji-70b"]["save"] == [r".*[kqv]_proj", r".*linear1_[01]"]


def test_cli_json_is_alone_on_stdout_when_user_code_prints(tmp_path, monkeypatch, capfd):
    """A library that prints while it is imported, built and traced (MaxText prints
    diagnostics), and a child process writing to descriptor 1 (a compiler might): with
    --json that goes to stderr, and stdout parses."""
    (tmp_path / "chatty.py").write_text(textwrap.dedent("""
        import os
        import jax, jax.numpy as jnp
        from jax.ad_checkpoint import checkpoint_name
        print("[NO-OP] importing chatty")

        def make():
            print("[NO-OP] building the layer")
            os.system("echo '[NO-OP] a child process'")
            def f(x, w):
                print("[NO-OP] tracing")
                h = checkpoint_name(x @ w, "Mlp.linear2")
                return jnp.sum(jnp.sin(h) @ w)
            return f, (jnp.ones((4, 4)), jnp.ones((4, 4)))

        def make_step():
            print("[NO-OP] building the step")
            def make_step(policy):
                body = jax.checkpoint(lambda x, w: jnp.sin(checkpoint_name(x @ w, "h")) @ w,
                                      policy=policy)
                def loss(w, x):
                    print("[NO-OP] tracing the step")
                    c, _ = jax.lax.scan(lambda c, _: (body(c, w), None), x, None, length=2)
                    return jnp.sum(c)
                return jax.jit(jax.value_and_grad(loss))
            return make_step, (jnp.ones((8, 8)), jnp.ones((4, 8)))
    """))
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "chatty:make", "--save", "Mlp.linear2", "--json"]) == 0
    out = capfd.readouterr()
    assert json.loads(out.out)["tags"][0]["name"] == "Mlp.linear2"
    assert "[NO-OP] tracing" in out.err and "[NO-OP]" not in out.out
    assert "[NO-OP] a child process" in out.err
    assert main(["fit", "chatty:make_step", "--dry-run", "--js", "--device",  # abbreviated
                 "trn2.48xlarge:hbm=1GiB:cores=1"]) == 0
    out = capfd.readouterr()
    assert json.loads(out.out)["candidates"] and "[NO-OP] tracing the step" in out.err


def test_cli_audit_of_user_code(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_layers.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp
        from jax.ad_checkpoint import checkpoint_name

        def make():
            def f(x, w):
                h = checkpoint_name(x @ w, "Mlp.linear2")
                return jnp.sum(jnp.sin(h) @ w)
            return f, (jnp.ones((4, 4)), jnp.ones((4, 4)))
    """))
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "my_layers:make", "--save", r".*linear2_[01]", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dead_patterns"] == [r".*linear2_[01]"]
    assert data["tags"][0]["name"] == "Mlp.linear2" and data["tags"][0]["action"] == "recompute"
    assert main(["audit", "my_layers:make", "--policy", "feed-forward", "--strict"]) == 2
    assert "DEAD PATTERN" in capsys.readouterr().out
    assert main(["audit", "my_layers", "--policy", "full"]) == 2
    assert "MODULE:FUNCTION" in capsys.readouterr().err
