"""`fit` takes the step's arguments in every form JAX's `jit` takes them: arrays and
ShapeDtypeStructs, typed and legacy PRNG keys, Python ints and bools, None and pytrees of
these. Each gives the plan the plain call (the same values closed over) gives; a keyword
meant for the step is refused in one line.

The expected plan is the plain call's; the expected figures are XLA's compile of the plan's
own policy, not anything `fit` computes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import neuron_remat as nr
from xla_figures import compiled_bytes

LAYERS, HIDDEN, FFN, TOKENS = 4, 32, 256, 64


def _layer(x, w):
    h = checkpoint_name(x @ w["up"], "up")
    a = checkpoint_name(jnp.tanh(h), "act")
    return x + a @ w["down"]


def _make_step(policy, *, extra: bool):
    layer = jax.checkpoint(_layer, policy=policy, prevent_cse=False)

    def loss(params, x):
        def body(carry, w):
            return layer(carry, w), None
        y, _ = jax.lax.scan(body, x, params)
        return jnp.mean(y * y)

    def update(params, x, scale):
        grads = jax.grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - scale * g, params, grads)

    if not extra:
        return jax.jit(lambda params, x: update(params, x, 1e-2), donate_argnums=(0,))

    def step(params, batch, key, step_count, flag, nothing):
        assert nothing is None
        noise = jax.random.normal(key, batch["x"].shape) * 0.0
        scale = jnp.where(flag, 1e-2, 1e-2) * (step_count + 1) / (step_count + 1)
        return update(params, batch["x"] + noise, scale)

    return jax.jit(step, donate_argnums=(0,))


def _params():
    shape = jax.ShapeDtypeStruct
    return {"up": shape((LAYERS, HIDDEN, FFN), jnp.float32),
            "down": shape((LAYERS, FFN, HIDDEN), jnp.float32)}


def _x():
    return jax.ShapeDtypeStruct((TOKENS, HIDDEN), jnp.float32)


def _device(hbm: int):
    return nr.parse_device(f"trn2:hbm={hbm}:cores=1", source="test")


def _compiled_bytes(make_step, args) -> int:
    return compiled_bytes(make_step.lower(*args).compile())


@pytest.fixture(scope="module")
def sizes():
    """Compiled bytes of full remat and no remat for the plain step (XLA's figures)."""
    plain = functools.partial(_make_step, extra=False)
    full = _compiled_bytes(plain(jax.checkpoint_policies.nothing_saveable), (_params(), _x()))
    none = _compiled_bytes(plain(jax.checkpoint_policies.everything_saveable),
                           (_params(), _x()))
    return full, none


@pytest.mark.parametrize("key_kind", ["typed", "legacy"])
def test_every_argument_form_gives_the_plain_calls_plan(sizes, key_kind):
    full, none = sizes
    assert none > full
    hbm = (full + none) // 2
    plain = nr.fit(functools.partial(_make_step, extra=False), _params(), _x(),
                   device=_device(hbm), reserve=0)
    key = jax.random.key(0) if key_kind == "typed" else jax.random.PRNGKey(0)
    batch = {"x": _x()}
    make = functools.partial(_make_step, extra=True)
    planned = nr.fit(make, _params(), batch, key, 3, True, None, device=_device(hbm),
                     reserve=0)
    assert planned.saved_tags == plain.saved_tags
    assert planned.compiled.no_remat == plain.compiled.no_remat
    # The plan's figures are its own policy's compile, whatever the argument forms.
    args = (_params(), batch, key, 3, True, None)
    assert planned.compiled.bytes == _compiled_bytes(make(planned.policy), args) <= hbm


def test_a_keyword_for_the_step_is_refused_in_one_line():
    with pytest.raises(TypeError, match=r"unknown options \['x'\]") as err:
        nr.fit(functools.partial(_make_step, extra=False), _params(), x=_x(),
               device=_device(1 << 30), reserve=0)
    assert "\n" not in str(err.value)
