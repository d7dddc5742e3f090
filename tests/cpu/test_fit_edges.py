"""`fit` at the edges of what a backend says: a compile that runs out of memory beside
compiles that report memory, memory figures that are not numbers, a compile that fails for
another reason, a budget the caller gave to a per-layer fit, and the dry run when full remat
does not fit.

The step is a small scanned stack of two tagged matmuls (`h1`, then `h2` from it), AdamW-free
SGD inside the jitted step, the state donated. Every expected figure is XLA's own compile of
the policy in question; the backends that misbehave are wrappers around the real compile,
each named for what it simulates.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import neuron_remat as nr
from neuron_remat import _fit as F
from neuron_remat.policies import RegexPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo  # noqa: E402

LAYERS, HIDDEN, FFN, BATCH = 8, 64, 256, 128
MiB = 1 << 20
FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
          "alias_size_in_bytes")


def _layer(x, w):
    h = checkpoint_name(x @ w["a"], "h1")
    g = checkpoint_name(jnp.tanh(h) @ w["b"], "h2")
    return x + jnp.tanh(g) @ w["c"]


def make_step(policy):
    def loss(p, x):
        return jnp.mean(nr.scan_layers(_layer, p, x, policy) ** 2)

    def update(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 1e-2 * b, p, g)

    return jax.jit(update, donate_argnums=(0,))


S = jax.ShapeDtypeStruct
ARGS = ({"a": S((LAYERS, HIDDEN, FFN), jnp.float32), "b": S((LAYERS, FFN, FFN), jnp.float32),
         "c": S((LAYERS, FFN, HIDDEN), jnp.float32)}, S((BATCH, HIDDEN), jnp.float32))


def _xla_bytes(policy) -> int:
    m = make_step(policy).lower(*ARGS).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def _saves(policy) -> tuple[str, ...] | str | None:
    """The tags `policy` saves; None for no remat, "mix" for one policy per layer."""
    if isinstance(policy, (tuple, list)):
        return "mix"
    if policy is jax.checkpoint_policies.everything_saveable:
        return None
    if hasattr(policy, "saves"):  # what fit compiles
        return tuple(t for t in ("h1", "h2") if policy.saves(t))
    return tuple(t for t in ("h1", "h2") if t in policy.saveable_names)  # fit's trace


@pytest.fixture(scope="module")
def xla():
    """XLA's compiled bytes of full remat, each tag alone, both, and no remat."""
    from jax._src.ad_checkpoint import save_only_these_names

    sets = [(), ("h1",), ("h2",), ("h1", "h2")]
    out = {s: _xla_bytes(save_only_these_names(*s)) for s in sets}
    out[None] = _xla_bytes(jax.checkpoint_policies.everything_saveable)
    return out


def _device(limit: int) -> tuple[nr.DeviceSpec, int]:
    """A one-core device of 100 MiB and the reserve that leaves `limit` bytes."""
    return nr.parse_device("trn2.48xlarge:hbm=100MiB:cores=1", source="test"), 100 * MiB - limit


REAL = object()  # `_Counting`'s memory figures: XLA's own


class _Counting:
    """A step whose compiles are counted (`count[0]`) and, for the save sets in `refuse`,
    fail as XLA does when the program does not fit (simulated: RESOURCE_EXHAUSTED). With
    `memory`, every field of ``memory_analysis()`` is that value (simulated)."""

    def __init__(self, step, saved, count, refuse=(), memory=REAL):
        self._step, self._saved, self._count = step, saved, count
        self._refuse, self._memory = refuse, memory

    def __call__(self, *a):
        return self._step(*a)

    def trace(self, *a):
        return self._step.trace(*a)

    def lower(self, *a):
        lowered, outer = self._step.lower(*a), self

        class Lowered:
            def __getattr__(self, name):
                return getattr(lowered, name)

            def compile(self):
                outer._count[0] += 1
                if outer._saved in outer._refuse:
                    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                       "allocate 2000000000 bytes.")
                c = lowered.compile()
                if outer._memory is REAL:
                    return c
                return types.SimpleNamespace(
                    memory_analysis=lambda: types.SimpleNamespace(
                        **{f: outer._memory for f in FIELDS}),
                    cost_analysis=c.cost_analysis)

        return Lowered()


def _counting(count, **kw):
    return lambda policy: _Counting(make_step(policy), _saves(policy), count, **kw)


def test_an_out_of_memory_compile_beside_memory_figures_is_over_not_the_oracle(xla):
    """A backend that reports memory but refuses one program (simulated: saving both tags
    raises RESOURCE_EXHAUSTED) keeps reading figures: the plan states its policy's compile,
    not a prediction, and says nothing of a backend without figures."""
    limit = xla[()] + (xla[("h1", "h2")] - xla[()]) // 2
    device, reserve = _device(limit)
    count = [0]
    plan = nr.fit(_counting(count, refuse={("h1", "h2")}), *ARGS, device=device,
                  reserve=reserve, progress=lambda line: None)
    assert plan.compiled.measured
    assert plan.compiled.bytes == _xla_bytes(plan.policy) <= limit
    assert not any("no memory figures" in n for n in plan.notes)
    assert plan.compiled.compiles == count[0]


def test_no_remat_is_not_compiled_once_every_tag_came_out_over(xla):
    """No remat keeps more than saving every tag: once that compiled over the limit, no
    remat is not worth a compile."""
    assert xla[None] > xla[("h1", "h2")] > xla[()]
    limit = (xla[()] + xla[("h1", "h2")]) // 2
    device, reserve = _device(limit)
    plan = nr.fit(make_step, *ARGS, device=device, reserve=reserve,
                  progress=lambda line: None)
    compiled = [p.saved for p in plan.compiled.probes]
    assert ("h1", "h2") in compiled and None not in compiled
    assert plan.compiled.bytes == _xla_bytes(plan.policy) <= limit
    assert "but no remat, which keeps more than saving every tag" in plan.compiled.stop


def test_full_remat_out_of_memory_then_every_tag_fits_without_figures(xla):
    """With the compile as the oracle (simulated: no memory figures, and the compiler
    refuses full remat only, as where saving tags compiles smaller), every tag saved fits:
    only no remat recomputes less, it gets a compile, and the search says why it ended."""
    count = [0]

    def step(policy):
        saved = _saves(policy)
        return _Counting(make_step(policy), saved, count, refuse={()}, memory=float("nan"))

    device, reserve = _device(50 * MiB)
    plan = nr.fit(step, *ARGS, device=device, reserve=reserve, progress=lambda line: None)
    assert [p.saved for p in plan.compiled.probes] == [(), ("h1", "h2"), None]
    assert plan.saved_tags == ("h1", "h2") and plan.policy is \
        jax.checkpoint_policies.everything_saveable
    assert plan.compiled.stop and plan.notes[0] == f"search: {plan.compiled.stop}"


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), -1, "n/a"])
def test_memory_figures_that_are_not_sizes_make_the_compile_the_oracle(xla, value):
    """A memory_analysis() whose fields are not byte counts (simulated) is a backend
    without figures: fit plans with the compile as the oracle, it does not crash."""
    count = [0]
    device, reserve = _device(xla[("h1", "h2")] + MiB)
    plan = nr.fit(_counting(count, memory=value), *ARGS, device=device, reserve=reserve,
                  progress=lambda line: None)
    assert not plan.compiled.measured
    assert all(p.bytes == -1 for p in plan.compiled.probes)


def test_a_compile_that_fails_otherwise_names_the_compile(xla):
    class Broken(_Counting):
        def lower(self, *a):
            if self._saved == ("h1", "h2"):
                raise RuntimeError("INTERNAL: the compiler crashed\nmore detail")
            return super().lower(*a)

    device, reserve = _device(xla[None] + MiB)
    with pytest.raises(nr.CompileFailedError) as err:  # a ValueError: the step's, not ours
        nr.fit(lambda p: Broken(make_step(p), _saves(p), [0]), *ARGS, device=device,
               reserve=reserve, progress=lambda line: None)
    text = str(err.value)
    assert text == ("fit: compile 2 (save h1, h2), after full remat (full remat), failed with "
                    "RuntimeError: INTERNAL: the compiler crashed")
    assert isinstance(err.value, ValueError)


def test_a_budget_given_caps_the_per_layer_fit_too(xla):
    """``max_compiles`` is a hard cap over the uniform fit and its per-layer mix."""
    limit = (xla[("h1",)] + xla[("h1", "h2")]) // 2
    device, reserve = _device(limit)
    for cap in (3, 4, 5, 6):
        count = [0]
        plan = nr.fit(_counting(count), *ARGS, device=device, reserve=reserve, per_layer=True,
                      max_compiles=cap, progress=lambda line: None)
        assert count[0] <= cap, (cap, count[0])
        assert plan.compiled.compiles == count[0]


def test_the_per_layer_mix_saves_only_the_candidates(xla):
    """``candidates`` bounds the mix as it bounds the uniform set (between saving both
    tags and no remat, where a mix of `h2` and no remat would otherwise be tried)."""
    limit = xla[None] - (xla[None] - xla[("h1", "h2")]) // 8
    device, reserve = _device(limit)
    plan = nr.fit(make_step, *ARGS, device=device, reserve=reserve, per_layer=True,
                  candidates=["h1"], progress=lambda line: None)
    assert set(plan.saved_tags) <= {"h1"}
    for m in plan.layer_mix:
        assert set(m.tags) <= {"h1"}, plan.layer_mix
    for p in plan.layer_policies or ():
        assert not isinstance(p, RegexPolicy) or not p.saves("h2")


def test_a_make_step_that_takes_one_policy_keeps_the_uniform_plan(xla, caplog):
    """A per-layer fit whose `make_step` hands its policy straight to ``jax.checkpoint`` (a
    tuple of policies is not callable): the uniform plan stands, with a note and a warning
    saying what a mix needs. With `h1` the only candidate, a mix of it and no remat is
    tried (as in `test_the_per_layer_mix_saves_only_the_candidates`)."""
    limit = xla[None] - (xla[None] - xla[("h1", "h2")]) // 8

    def one_policy(policy):
        def layer(x, w):
            return jax.checkpoint(_layer, policy=policy)(x, w)

        def loss(p, x):
            return jnp.mean(jax.lax.scan(lambda h, w: (layer(h, w), None), x, p)[0] ** 2)

        return jax.jit(lambda p, x: jax.tree.map(lambda a, b: a - 1e-2 * b, p,
                                                 jax.grad(loss)(p, x)), donate_argnums=(0,))

    device, reserve = _device(limit)
    uniform = nr.fit(one_policy, *ARGS, device=device, reserve=reserve, candidates=["h1"],
                     progress=lambda line: None)
    with caplog.at_level("WARNING", logger="neuron_remat.fit"):
        plan = nr.fit(one_policy, *ARGS, device=device, reserve=reserve, per_layer=True,
                      candidates=["h1"], progress=lambda line: None)
    assert plan.saved_tags == uniform.saved_tags and plan.layer_policies is None
    assert "TypeError: 'tuple' object is not callable" in plan.notes[-1]
    assert "gets a tuple of 8 policies" in plan.notes[-1]
    assert any("the uniform plan stands" in r.getMessage() for r in caplog.records)


def test_a_uniform_plan_that_stands_keeps_its_figures(xla):
    """When no mix is adopted, ``per_layer=True`` returns the uniform plan as fit gave it:
    the same recompute, so `Plan.overhead` is `Plan.compiled.overhead`."""
    limit = (xla[("h1",)] + xla[("h1", "h2")]) // 2
    device, reserve = _device(limit)
    uniform = nr.fit(make_step, *ARGS, device=device, reserve=reserve,
                     progress=lambda line: None)
    mixed = nr.fit(make_step, *ARGS, device=device, reserve=reserve, per_layer=True,
                   progress=lambda line: None)
    assert mixed.layer_policies is None, "here no mix is adopted (the test's premise)"
    assert mixed.saved_tags == uniform.saved_tags
    assert mixed.recompute_flops_per_layer == uniform.recompute_flops_per_layer
    assert mixed.overhead == pytest.approx(mixed.compiled.overhead)


@pytest.mark.parametrize("option,value", [("max_sets", 0), ("max_sets", -3), ("max_sets", "2"),
                                          ("max_sets", 2.5), ("max_sets", True),
                                          ("candidates", 5), ("candidates", [1, 2]),
                                          ("per_layer", "no"), ("per_layer", 1)])
def test_bad_per_layer_options_are_one_line_before_any_compile(option, value):
    count = [0]
    device, reserve = _device(50 * MiB)
    options = {"per_layer": True, option: value}
    with pytest.raises(ValueError) as err:
        nr.fit(_counting(count), *ARGS, device=device, reserve=reserve, **options)
    assert str(err.value).startswith(f"{option}={value!r}: ") and "\n" not in str(err.value)
    assert count[0] == 0


def test_dry_run_says_full_remat_ran_out_of_memory(xla):
    """Under the simulated oracle a full remat over the limit is reported as such, and its
    error's figure (over the limit) places the predictions."""
    limit = xla[()] - 64 * 1024
    device, reserve = _device(limit)
    preview = F.fit_preview(zoo.oracle_make_step(make_step, limit), *ARGS, device=device,
                            reserve=reserve)
    assert preview.full_remat.out_of_memory
    text = preview.table()
    assert "full remat ran out of memory" in text and "compiled to" not in text
    full = [b for s, b, _ in preview.candidates if s == ()]
    assert full == [xla[()]]  # the simulation's error names the compiled bytes
    assert preview.tight is True  # over the limit: the rescue's budget applies


def test_a_tag_cheaper_to_redo_than_to_hold_is_not_a_candidate(caplog):
    """A tag on a bfloat16 cast of the softmax: its backward needs the float32 softmax,
    recomputed anyway, so saving the tag spares one convert per element (1 FLOP per 2 bytes
    kept, under the planner's 8 FLOP/B) and on XLA:CPU adds FLOPs. `fit` does not decide it;
    the projection (2 x 32 FLOPs per 4-byte element) stays."""
    from jax._src.ad_checkpoint import save_only_these_names

    from neuron_remat._step import _pool, step_graph

    lay, b, s, d = 4, 2, 64, 32

    def layer(x, w):
        h = checkpoint_name(x @ w["a"], "proj")
        scores = jnp.einsum("bsd,btd->bst", h, x)
        p = checkpoint_name(jax.nn.softmax(scores, -1).astype(jnp.bfloat16), "probs")
        return x + jnp.einsum("bst,btd->bsd", p.astype(jnp.float32), x) @ w["b"]

    def make(policy):
        def loss(w, x):
            f = jax.checkpoint(layer, policy=policy)
            return jnp.mean(jax.lax.scan(lambda c, wi: (f(c, wi), None), x, w)[0] ** 2)

        return jax.jit(lambda w, x: jax.tree.map(lambda a, g: a - 0.1 * g, w,
                                                 jax.grad(loss)(w, x)))

    args = ({"a": S((lay, d, d), jnp.float32), "b": S((lay, d, d), jnp.float32)},
            S((b, s, d), jnp.float32))
    assert _pool(step_graph(make, *args), None) == ("proj",)

    def flops(*saved):
        return make(save_only_these_names(*saved)).lower(*args).compile().cost_analysis()[
            "flops"]

    assert flops("proj", "probs") >= flops("proj")  # XLA: saving it saves nothing
    # named as a candidate, it is left undecided with one warning saying why
    with caplog.at_level("WARNING", logger="neuron_remat.fit"):
        nr.fit(make, *args, device=_device(64 * MiB)[0], reserve=36 * MiB,
               candidates=["probs"], progress=lambda line: None)
    assert any("candidates ['probs'] are not decided" in r.getMessage()
               for r in caplog.records)


def test_an_equinox_filter_jit_step_gives_its_memory_figures(xla):
    """``eqx.filter_jit(f).lower(...).compile()`` is Equinox's wrapper, JAX's executable in
    its ``.compiled``: fit reads that one's figures, not the oracle's."""
    eqx = pytest.importorskip("equinox")

    def make(policy):
        def loss(p, x):
            return jnp.mean(nr.scan_layers(_layer, p, x, policy) ** 2)

        @eqx.filter_jit
        def update(p, x):
            g = jax.grad(loss)(p, x)
            return jax.tree.map(lambda a, b: a - 1e-2 * b, p, g)

        return update

    args = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), ARGS)  # filter_jit traces
    device, reserve = _device(xla[("h1", "h2")] + 4 * MiB)                 # arrays only
    plan = nr.fit(make, *args, device=device, reserve=reserve, progress=lambda line: None)
    assert plan.compiled.measured
    inner = make(plan.policy).lower(*args).compile().compiled  # JAX's, read here
    m = inner.memory_analysis()
    assert plan.compiled.bytes == (m.argument_size_in_bytes + m.output_size_in_bytes
                                   + m.temp_size_in_bytes - m.alias_size_in_bytes)


def test_a_step_jitted_with_a_static_argument_is_traced_as_its_jit_traces_it(xla):
    """``jax.jit(step, static_argnums=2)`` with a Python float learning rate: fit traces
    it with the learning rate static, as its own compile does (before: every argument a
    tracer, and "Non-hashable static arguments" blamed on the user's step)."""
    def make(policy):
        def update(p, x, lr):
            g = jax.grad(lambda p: jnp.mean(nr.scan_layers(_layer, p, x, policy) ** 2))(p)
            return jax.tree.map(lambda a, b: a - lr * b, p, g)

        return jax.jit(update, static_argnums=2, donate_argnums=(0,))

    args = (*ARGS, 1e-2)
    device, reserve = _device(xla[("h1", "h2")] + 4 * MiB)
    plan = nr.fit(make, *args, device=device, reserve=reserve, progress=lambda line: None)
    m = make(plan.policy).lower(*args).compile().memory_analysis()
    assert plan.compiled.bytes == (m.argument_size_in_bytes + m.output_size_in_bytes
                                   + m.temp_size_in_bytes - m.alias_size_in_bytes)
    assert plan.saved_tags == ("h1", "h2")  # every tag fits there, as the fixture's step


def test_the_dry_run_says_whether_band_puts_full_remat_close_to_the_limit(xla):
    """--band sets the uncertainty the dry run's budget depends on: full remat (compiled
    here) 10% under the limit is within TIGHT (4) x a band of 0.5, not of 0.02 (the floor,
    2%, gives 8%)."""
    full = xla[()]
    device, reserve = _device(int(full * 1.10))
    for band, tight in ((0.02, False), (0.5, True)):
        pre = F.fit_preview(make_step, *ARGS, device=device, reserve=reserve, band=band)
        assert pre.full_remat.bytes == full
        assert pre.tight is tight and pre.to_dict()["tight"] is tight
        assert pre.to_dict()["step_flops"] == pre.step_flops > 0
        assert f"here full remat is {'' if tight else 'not '}that close" in pre.table()


def test_a_step_of_two_different_layers_says_its_per_layer_figures_are_averages(xla):
    """4 layers of one kind scanned, then 2 of another: the plan's per-layer figures are
    the step's over 6 layers, which no one layer keeps; the plan says so (a stack of one
    layer, this module's step, does not)."""
    def wide(x, w):
        return x + jnp.tanh(checkpoint_name(x @ w["a"], "h3")) @ w["c"]

    def make(policy):
        def loss(p, x):
            h = nr.scan_layers(_layer, p["narrow"], x, policy)
            return jnp.mean(nr.scan_layers(wide, p["wide"], h, policy) ** 2)

        return jax.jit(lambda p, x: jax.tree.map(lambda a, b: a - 1e-2 * b, p,
                                                 jax.grad(loss)(p, x)))

    narrow = {k: S((4, *v.shape[1:]), v.dtype) for k, v in ARGS[0].items()}
    wide_p = {"a": S((2, HIDDEN, 4 * FFN), jnp.float32), "c": S((2, 4 * FFN, HIDDEN), jnp.float32)}
    args = ({"narrow": narrow, "wide": wide_p}, ARGS[1])
    device, reserve = _device(60 * MiB)
    plan = nr.fit(make, *args, device=device, reserve=reserve, progress=lambda line: None)
    assert any("checkpoints 2 different layers (6 in all)" in n for n in plan.notes)
    one = nr.fit(make_step, *ARGS, device=device, reserve=reserve, progress=lambda line: None)
    assert not any("different layers" in n for n in one.notes)


def test_a_flax_nnx_jit_step_is_traced_through_make_jaxpr(xla):
    """``nnx.jit``'s wrapper has a ``trace`` whose result holds no jaxpr (not JAX's
    Traced): fit traces it as it did before reading ``jit(...).trace``."""
    nnx = pytest.importorskip("flax.nnx")

    def make(policy):
        def loss(p, x):
            return jnp.mean(nr.scan_layers(_layer, p, x, policy) ** 2)

        return nnx.jit(lambda p, x: jax.tree.map(lambda a, b: a - 1e-2 * b, p,
                                                 jax.grad(loss)(p, x)))

    graph = F.step_graph(make, *ARGS)
    assert set(graph.tags) == {"h1", "h2"} and graph.count == LAYERS


def test_layers_alike_but_for_the_number_in_their_tag_names_are_one_kind():
    """Unrolled layers tagged ``layers.{i}.h``: one kind of layer, however named."""
    def make(policy):
        def loss(w, x):
            for i in range(3):
                x = jax.checkpoint(lambda x, w, i=i: x + jnp.tanh(
                    checkpoint_name(x @ w, f"layers.{i}.h")) @ w, policy=policy)(x, w[i])
            return jnp.mean(x ** 2)

        return jax.jit(jax.grad(loss))

    graph = F.step_graph(make, S((3, 16, 16), jnp.float32), S((4, 16), jnp.float32))
    assert len(graph.layers) == 3 and graph.kinds() == 1


# --------------------------------------------------------------------------------------
# A value named twice (MaxText names a routed expert's projection `mlpwi_0` and
# `moe_mlpwi_0`, one checkpoint_name around the other).
# --------------------------------------------------------------------------------------


def _named_twice(x, w):
    h = checkpoint_name(checkpoint_name(x @ w["a"], "inner"), "outer")
    g = checkpoint_name(jnp.tanh(h) @ w["b"], "h2")
    return x + jnp.tanh(g) @ w["c"]


def test_a_value_named_twice_is_one_candidate(caplog):
    """JAX keeps the same residuals whichever of the two names a policy saves, or both
    (`saved_residuals`); `fit` decides the value once, under its first name, and says
    what the second is, rather than spending compiles on sets that differ only in
    which name they save."""
    import logging

    from jax._src.ad_checkpoint import save_only_these_names, saved_residuals

    def make(policy):
        def loss(p, x):
            return jnp.mean(nr.scan_layers(_named_twice, p, x, policy) ** 2)

        return jax.jit(lambda p, x: jax.tree.map(lambda a, b: a - 1e-2 * b, p,
                                                 jax.grad(loss)(p, x)), donate_argnums=(0,))

    w = {k: jnp.zeros(v.shape[1:], v.dtype) for k, v in ARGS[0].items()}
    x = jnp.zeros(ARGS[1].shape, ARGS[1].dtype)
    kept = {names: sorted((a.str_short(), d.split(" from")[0].replace("outer", "inner"))
                          for a, d in saved_residuals(jax.checkpoint(
                              _named_twice, policy=save_only_these_names(*names)), x, w))
            for names in [("inner",), ("outer",), ("inner", "outer")]}
    assert kept[("inner",)] == kept[("outer",)] == kept[("inner", "outer")], kept

    # between saving both values and no remat: the search must decide the first value
    every = _xla_bytes_of(make, save_only_these_names("inner", "h2"))
    none = _xla_bytes_of(make, jax.checkpoint_policies.everything_saveable)
    assert every < none
    device = nr.parse_device(f"trn2.48xlarge:hbm={(every + none) // 2}B:cores=1",
                             source="test")
    with caplog.at_level(logging.INFO, logger="neuron_remat"):
        plan = nr.fit(make, *ARGS, device=device, reserve=0, candidates=["inner", "outer",
                                                                          "h2"])
    assert "outer" not in plan.saved_tags and "inner" in plan.saved_tags, plan.saved_tags
    assert not any(p.saved and "outer" in p.saved for p in plan.compiled.probes)
    why = {d.tag: d.reason for d in plan.decisions}
    assert why["outer"] == "another name of inner's value: kept, as inner", why
    assert any("outer names the value inner names" in r.getMessage()
               for r in caplog.records)


def _xla_bytes_of(make, policy) -> int:
    m = make(policy).lower(*ARGS).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def _layer_with_a_cheap_tag(x, w):
    h = checkpoint_name(x @ w["a"], "h1")
    t = checkpoint_name(jnp.tanh(h), "act")  # elementwise: not worth deciding by the trace
    return x + (t * h) @ w["c"]


def _step_with_a_cheap_tag(policy):
    def loss(p, x):
        return jnp.mean(nr.scan_layers(_layer_with_a_cheap_tag, p, x, policy) ** 2)

    return jax.jit(lambda p, x: jax.tree.map(lambda a, b: a - 1e-2 * b, p,
                                             jax.grad(loss)(p, x)), donate_argnums=(0,))


def test_a_tag_outside_the_pool_is_compiled_alone_before_a_refusal():
    """`act` (a tanh's output) is outside fit's pool: saving it saves no FLOP the trace
    counts. Where full remat does not fit, `fit` compiles it alone (announced up front,
    and listed by the dry run) before it refuses; with ``candidates`` named, it does not."""
    args = ({"a": ARGS[0]["a"], "c": ARGS[0]["c"]}, ARGS[1])
    m = _step_with_a_cheap_tag(
        jax.checkpoint_policies.nothing_saveable).lower(*args).compile().memory_analysis()
    full = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)
    device, reserve = _device(full - MiB // 4)
    lines: list[str] = []
    with pytest.raises(nr.NoFitError):
        nr.fit(_step_with_a_cheap_tag, *args, device=device, reserve=reserve,
               progress=lines.append)
    assert any("search (save act)" in line for line in lines), lines
    assert any("outside the candidates (act)" in line for line in lines), lines
    preview = F.fit_preview(_step_with_a_cheap_tag, *args, device=device, reserve=reserve)
    assert preview.tags == ("h1",) and preview.spare == ("act",)
    lines.clear()
    with pytest.raises(nr.NoFitError):
        nr.fit(_step_with_a_cheap_tag, *args, device=device, reserve=reserve,
               candidates=["h1"], progress=lines.append)
    assert not any("act" in line for line in lines), lines
