"""Every argument form JAX accepts, for `traced_footprint` and `audit` (issue 19's class
for the functions that trace a user's function): positional or keyword, params-first or
activation-first, typed or legacy PRNG keys, integer arrays, Python ints, booleans, None
and other static Python values, pytrees of these. Each call gives the same answer as the
plain positional call, or is refused in one line. Hypothesis draws the forms; the expected
answer is the plain call's (itself checked against JAX's residuals in test_trace_matrix)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st
from jax.ad_checkpoint import checkpoint_name

import neuron_remat as nr

FOOTPRINT_EXAMPLES = 30
AUDIT_EXAMPLES = 10
NAMES = ("x", "key", "step", "flag", "extra")


def _core(p, x, key, step, flag, extra):
    del extra  # a static value the layer ignores
    w1, w2 = jax.tree.leaves(p)
    h = checkpoint_name(x @ w1, "h")
    if flag:  # a Python bool steering the layer: must stay static
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        h = jnp.where(keep, h, jnp.zeros_like(h))
    s = checkpoint_name(jnp.mean(h.astype(jnp.float32) ** 2, -1, keepdims=True), "stat")
    y = checkpoint_name((h * jax.lax.rsqrt(s + 1e-6).astype(h.dtype)) @ w2, "o")
    return x + y * jnp.asarray(step).astype(x.dtype)


def params_first(p, x, key, step, flag=True, extra=None):
    return _core(p, x, key, step, flag, extra)


def activation_first(x, p, key, step, flag=True, extra=None):
    return _core(p, x, key, step, flag, extra)


def _params(dtype, container):
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    w1 = (jax.random.normal(k1, (16, 32)) / 4).astype(dtype)
    w2 = (jax.random.normal(k2, (32, 16)) / 6).astype(dtype)
    return [{"w1": w1, "w2": w2}, (w1, w2), [w1, {"b": w2}], {"a": (w1,), "b": [w2]}][container]


def _key(kind):
    return jax.random.key(0) if kind == "typed" else jax.random.PRNGKey(0)


forms = st.fixed_dictionaries({
    "order": st.sampled_from(["params-first", "activation-first"]),
    "container": st.integers(0, 3),
    "key": st.sampled_from(["typed", "legacy"]),
    "step": st.sampled_from(["int32 array", "python int", "int8 array"]),
    "keywords": st.sets(st.sampled_from(NAMES)),
    "extra": st.sampled_from([None, "a string", 0.5, (None, 3), {"n": None}]),
    "flag": st.booleans(),
    "dtype": st.sampled_from(["float32", "bfloat16"]),
})


def _call(form):
    """(fn, args, kwargs) for `form`, and (fn, args) of the plain positional call."""
    dtype = jnp.dtype(form["dtype"])
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 16)).astype(dtype)
    p = _params(dtype, form["container"])
    key = _key(form["key"])
    step = {"int32 array": jnp.int32(3), "python int": 3, "int8 array": jnp.int8(3)}[
        form["step"]]
    values = {"x": x, "key": key, "step": step, "flag": form["flag"], "extra": form["extra"]}
    plain_values = {**values, "extra": None}
    if form["order"] == "params-first":
        fn, names = params_first, ("p", *NAMES)
    else:
        fn, names = activation_first, ("x", "p", "key", "step", "flag", "extra")
    values["p"] = p
    plain_values["p"] = _params(dtype, 0)
    cut = min([names.index(k) for k in form["keywords"] if k in names] or [len(names)])
    cut = max(cut, 1)  # the first argument stays positional
    args = tuple(values[n] for n in names[:cut])
    kwargs = {n: values[n] for n in names[cut:]}
    plain = tuple(plain_values[n] for n in names)
    return fn, args, kwargs, plain


def _answer(fp):
    return ({t: (c.bytes, c.recompute_flops, c.shape, c.dtype) for t, c in fp.items()},
            fp.always_kept_bytes)


@settings(max_examples=FOOTPRINT_EXAMPLES, deadline=None)
@given(forms)
def test_traced_footprint_answers_as_the_plain_call(form):
    fn, args, kwargs, plain = _call(form)
    got = nr.traced_footprint(fn, *args, **kwargs)
    want = nr.traced_footprint(fn, *plain[:4], form["flag"])
    assert _answer(got) == _answer(want)
    assert set(got) == {"h", "stat", "o"}
    assert got["h"].bytes > 0  # the tags are really counted (bfloat16 included)


@settings(max_examples=AUDIT_EXAMPLES, deadline=None)
@given(forms)
def test_audit_answers_as_the_plain_call(form):
    fn, args, kwargs, plain = _call(form)
    policy = nr.RegexPolicy(["h", "stat"])
    got = nr.audit(fn, *args, policy=policy, **kwargs)
    want = nr.audit(fn, *plain[:4], form["flag"], policy=policy)
    assert (got.saved_bytes, got.saved_param_bytes, got.activation_argnums) == (
        want.saved_bytes, want.saved_param_bytes, want.activation_argnums)
    assert [(t.name, t.kept_bytes, t.action) for t in got.tags] == [
        (t.name, t.kept_bytes, t.action) for t in want.tags]
    assert got.recompute_flops == want.recompute_flops


def _one_line(excinfo):
    text = str(excinfo.value)
    assert text and "\n" not in text, text
    return text


def test_refused_forms_say_why_in_one_line():
    x = jnp.ones((4, 16))
    p = _params(jnp.float32, 0)
    key, step = _key("typed"), jnp.int32(1)
    with pytest.raises(TypeError) as err:
        nr.traced_footprint(params_first, p, x, key, step, bogus=1)
    assert "cannot take these arguments" in _one_line(err) and "bogus" in str(err.value)
    with pytest.raises(TypeError) as err:
        nr.traced_footprint(params_first, p, x, key, step, activation_argnums="x")
    assert "activation_argnums must be an int" in _one_line(err)
    with pytest.raises(ValueError) as err:
        nr.traced_footprint(params_first, p, x, key, step, activation_argnums=(7,))
    assert "out of range for 4 positional arguments" in _one_line(err)
    with pytest.raises(TypeError) as err:
        nr.traced_footprint("not a function", x)
    assert "fn must be callable" in _one_line(err)
    # A function that fails on its own arguments is the user's error, named as such.
    from neuron_remat._audit import LayerError  # noqa: PLC0415

    with pytest.raises(LayerError) as err:
        nr.audit(lambda a: a @ jnp.ones((3, 3)), x, policy=nr.RegexPolicy(["h"]))
    assert "raised TypeError" in _one_line(err)


def test_keys_ints_and_bools_get_no_tangent():
    """The regression of issue 18: a typed key and a bfloat16 layer trace; integer and
    boolean arrays are inputs without tangents."""
    x = jnp.ones((4, 16), jnp.bfloat16)
    p = _params(jnp.bfloat16, 0)
    mask = jnp.ones((4, 16), bool)

    def f(p, x, key, step, mask):
        return jnp.where(mask, params_first(p, x, key, step), x)

    fp = nr.traced_footprint(f, p, x, jax.random.key(1), jnp.int32(2), mask)
    assert fp["h"].bytes == 4 * 32 * 2 and fp["h"].dtype == "bfloat16"
    report = nr.audit(f, p, x, jax.random.key(1), jnp.int32(2), mask,
                      policy=nr.RegexPolicy(["h"]))
    assert {t.name: t.kept_bytes for t in report.tags}["h"] == 4 * 32 * 2
