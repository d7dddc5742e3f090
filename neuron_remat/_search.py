"""`fit`'s compile-checked search: what to compile next, and when to stop.

`_Search` is pure: its `measure` compiles one candidate save set (`_Candidate`: the bytes it
keeps and reads, the FLOPs it recomputes, from `_step.StepGraph`). What it believes about
the compiled bytes is `_belief`'s: `_Model` calibrates ``bytes(S) = fixed + scale x kept(S)
+ slope x read(S)`` on the compiles; the misses are one unknown effect per saved tag
(`_Search._tag_effect`, on `_belief`'s updates, with this module's prior). The search
bisects the predicted frontier from its middle (with a backend that reports no memory
figures, the compile as the oracle) and walks the compiles left by expected gain; it rescues
a full remat that does not fit or fits tightly (`TIGHT`) by exploring each tag first.
`fit`'s module docstring tells the whole procedure; each constant below says how it was
chosen.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._belief import _condition_on_outcomes, _marks, _Model, _observe, _phi
from ._compile import _Compiled
from ._format import fmt_bytes
from ._step import StepGraph

NO_REMAT = "no remat"


# The search's constants, tuned on the zoo's "train" steps only (tests/cpu/zoo.py:
# gqa4-adamw, wide-ffn-sgd-bf16, long-seq, and since TIGHT's last choice rope-gqa2-bf16 and
# moe8-rope-sgd); benchmarks/fit_sweep.py reports the held-out steps apart.
DEFAULT_BAND = 0.02
"""The uncertainty of a prediction before any miss is seen, as a share of full remat's
compiled bytes (``band=``)."""
WIDEN = 1.5
"""After a miss (a compile off its prediction by more than the uncertainty) the
uncertainty becomes the larger of that miss and this multiple of itself."""
NARROW = 0.7
"""After a hit the uncertainty shrinks by this factor (down to `FLOOR`)."""
FLOOR = 0.02
"""The least uncertainty, as a share of full remat's compiled bytes."""
PLAUSIBLE = 0.08
"""A set is worth a compile only when its chance to fit (normal errors of the
uncertainty's size) is at least this."""
LONG_SHOT = 0.03
"""Where no set that recomputes less is `PLAUSIBLE` and compiles are left, the walk does not
stop: it compiles the set of greatest expected gain among those at least this likely to
fit (never the last compile while nothing better than full remat fits: `LIKELY` holds
there; no least chance at all while no compile has given a figure: `_Search._long_shot`).
Where the compiled bytes stray further from the model than its prior allows, a
set predicted well over the limit can fit: among 8100 searches on synthetic tables with
per-set noise of up to 2, 3 or 4 MiB (`test_fit_zoo._synthetic`: 4 to 6 tags, 60 seeds,
5 limits, the three modes) this changed the plan at 14, each to the brute force's best,
and made none worse; with noise of up to 1 MiB it changed none of 8100.

Chosen on the zoo's train steps: moe8-rope-sgd's largest gap with the oracle went from
8.81 to 7.95 points (out-of-memory figures) and to 8.09 (none); nothing else moved. At
0.01 the oracle's share within 0.5 points on moe8-rope-sgd rose from 96% to 97% but
long-seq's share within the compile cap with memory figures fell from 98% to 97%; at 0
also gqa4-adamw's with the oracle, from 94% to 92%. `PLAUSIBLE` itself at 0.03 took
gqa4-adamw's oracle sweep from 99% within 0.5 points and 0.73 at most to 97% and 1.45."""
LIKELY = 0.5
"""When the walk picks the last compile of the budget by expected gain, it picks among the
sets at least this likely to fit, if there is one: no compile follows to mend a miss. While
nothing better than full remat fits, a set less likely than this gets no last compile at
all. (A stalled walk's bisection of the frontier picks as before.)

Chosen on the zoo's train steps (before, the last compile went by chance x recompute saved
alone, as the others do): on gqa4-adamw's sweep (memory_analysis) the sizes within 0.5
points of the best went from 95% to 96%; with the compile as the oracle, and on
wide-ffn-sgd-bf16 and long-seq, nothing moved. At 0.7, 95%. Holding the bisection's pick
to it too cost gqa4-adamw's oracle sweep a miss of 2.27 points."""
TAG_SD = 0.02
"""The spread of one tag's effect on the compiled bytes beyond the model, as a share of
full remat's compiled bytes."""
ALIKE = 0.5
"""The correlation of two tags' effects when the trace cannot tell them apart: saving
either alone keeps the same bytes, leaves the same reads to recompute and saves the same
FLOPs (a K and V projection under GQA, the two halves of a gated FFN, a Q and an output
projection without rotary embedding). The compiler tends to lay out alike buffers alike,
so a miss seen on one moves the other's prediction (`_Search._alike`); a set that saves
both is less sure than two unrelated tags (prior variance (2 + 2 x ALIKE) x TAG_SD^2, not
2 x TAG_SD^2). Valid in [0, 1).

Chosen on the zoo's train steps (0 is one independent effect per tag): on gqa4-adamw's
sweep, memory_analysis, the largest gap went from 1.45 to 0.73 points and the sizes within
0.5 points stayed at 95%; with the compile as the oracle, 96% to 98% within 0.5 points.
At 0.8 the memory sweep fell to 94%; wide-ffn-sgd-bf16 and long-seq did not move."""
TIGHT = 4.0
"""Full remat fits "tightly" when the limit is less than this multiple of the starting
uncertainty above it: there the model cannot rank the sets (one tag's packing moves the
figure by more than the room), and the search explores as when full remat does not fit
(`_Search._rescue`), with that budget.

Chosen on the zoo's train steps. First on gqa4-adamw's sweep (memory_analysis): the sizes
within 0.5 points of the best go from 90% (no tight path) to 93% at 2 and 95% at 3, the
largest gap from 3.63 to 1.45 points; the sizes within 6 compiles from 93% to 91% at 3.
Then, with rope-gqa2-bf16 and moe8-rope-sgd added to the train steps, 3 became 4: on
rope-gqa2-bf16 (memory_analysis) the largest gap fell from 6.88 to 1.18 points (full remat
returned at 8.88 MiB, 0.56 MiB above it, where saving one tag alone compiles smaller);
with the oracle gqa4-adamw's from 1.45 to 0.73 and its share within 0.5 points rose from 98%
to 99%. The price is compiles: gqa4-adamw's sizes within the cap went from 91% to 90%
(memory_analysis) and from 97% to 94% (oracle), the other train steps' by a point at most.
At 5 gqa4-adamw's memory_analysis share fell to 88%, under the issue's 90%. Chosen again
once the model read bytes as the backend stores them (`_Candidate.stored`): 4 stays. At 3
gqa4-adamw's largest gap with the oracle is 1.45 points (0.73 at 4) and rope-gqa2-bf16's
share within 0.5 points with memory_analysis 98% (99%); at 5 gqa4-adamw is within the cap
at 88% of sizes with memory_analysis (90%)."""
SET_SD = 0.004
"""The spread of one save set's compiled bytes beyond its tags' effects (same unit)."""
NO_REMAT_SPREAD = 1.5
"""No remat keeps untagged values too: its uncertainty is this multiple..."""
UNTAGGED = 0.25
"""... plus this share of what it keeps beyond the least-recompute save set."""
FOLLOW = 0.35
"""Memory follows the kept bytes when no remat compiles at least this share of its extra
kept bytes above full remat (an unrolled Python loop on XLA:CPU: about 0.13)."""
FLAT_SPAN = 0.1
"""Two save sets' compiled figures (with the compile as the oracle, out-of-memory errors')
test `FOLLOW` only when their kept bytes differ by at least this share of the limit."""


def _oracle_cap(n_front: int) -> int:
    """Compiles of the oracle's bisection of a frontier of `n_front` sets (at most
    log2(n_front) + 3): full remat, then halving the others, which takes at most
    ceil(log2(n_front)); one compile or more is left at most sizes, for the walk beside
    the frontier.

    The bisection starts at the frontier's middle. It started at its top (the least
    recompute: where that fits, nothing is better), which on the zoo's train steps spent a
    compile at most sizes to learn what the others would have: starting in the middle,
    moe8-rope-sgd went from 96% of sizes within 0.5 points and 7.95 at most to 99% and
    2.15 with the oracle's figures, and from 93% and 8.09 to 96% and 2.15 without;
    rope-gqa2-bf16 with figures from 99% and 1.18 to 100% and 0; gqa4-adamw with figures
    from 99% and 0.73 to 98% and 0.82 (on a machine whose BLAS broke one tie the other
    way: 99% and 0.73 since `CHANCE_DIGITS`), without from 92% and 2.91 to 93% and 3.00."""
    return 1 + (n_front > 1) + math.ceil(math.log2(max(n_front - 1, 1)))


def _max_compiles(n_tags: int) -> int:
    return 6 if n_tags <= 8 else 6 + (n_tags - 8) // 2


def _stretch(n_tags: int, budget_given: bool = False) -> int:
    """The compiles beyond the budget where full remat does not fit or is close to the
    limit (`TIGHT`): one per tag, for each tag alone (`_Search._rescue`); none beyond a
    budget the caller gave (``max_compiles``: a hard cap)."""
    return 0 if budget_given else n_tags


@dataclass(frozen=True)
class _Candidate:
    """One save set: the bytes JAX keeps (`kept`: the plan states them), the bytes the
    backend stores for them (`stored`, `_step.STORED_ITEMSIZE`; what the model of the
    compiled bytes reads, `kept` when not given), the bytes one layer's backward reads
    that the set recomputes (as stored), and its recompute FLOPs."""

    saved: tuple[str, ...] | None  # None: no remat
    kept: int
    read: int
    recompute: int
    stored: int = -1

    def __post_init__(self) -> None:
        if self.stored < 0:
            object.__setattr__(self, "stored", self.kept)


def _candidates(graph: StepGraph, tags: Sequence[str], no_remat: bool = True
                ) -> list[_Candidate]:
    """Every subset of `tags` and no remat, least recompute first. Sets with equal kept
    bytes and recompute stay apart: XLA may lay them out differently."""
    found = [_candidate(graph, subset) for r in range(len(tags) + 1)
             for subset in itertools.combinations(tags, r)]
    if no_remat:
        found.append(_Candidate(None, graph.no_remat_kept_bytes(), 0, 0,
                                graph.no_remat_kept_bytes(stored=True)))
    return sorted(found, key=_order)


def _candidate(graph: StepGraph, saved: tuple[str, ...]) -> _Candidate:
    """The save set `saved` as the step graph figures it."""
    return _Candidate(saved, graph.kept_bytes(saved), graph.read_bytes(saved),
                      graph.recompute_flops(saved), graph.stored_bytes(saved))


def _order(c: _Candidate) -> tuple[Any, ...]:
    """The candidates' order: least recompute first, then fewest bytes kept; no remat
    before a save set that ties with it."""
    return (c.recompute, c.kept, len(c.saved or ()) - (c.saved is None) * 1000, c.saved or ())


def _frontier(cands: Sequence[_Candidate], predict: Callable[[_Candidate], float] | None = None
              ) -> list[_Candidate]:
    """The Pareto sets by predicted bytes and recompute (none predicted smaller with no
    more recompute), least recompute first, so most bytes first; full remat always last
    (the set known to fit when a search starts)."""
    pred = predict or (lambda c: c.stored + c.read)
    out: list[_Candidate] = []
    least = math.inf
    for c in sorted(cands, key=lambda c: (c.recompute, pred(c))):
        if pred(c) < least:
            out.append(c)
            least = pred(c)
    full = next(c for c in cands if c.saved == ())
    if full in out:
        out.remove(full)
    return [*out, full]


CHANCE_DIGITS = 9
"""A chance to fit is rounded to this many decimals, so that the search decides the same on
every machine. Sets the trace cannot tell apart (a K and a V projection under GQA) have
the same chance in exact arithmetic, but the linear algebra behind it (`_Model.calibrate`,
`_Search._effects`) is computed by whichever BLAS kernels the CPU selects, and differs
in the last bits: unrounded, such a tie went to one set or the other by the machine
(gqa4-adamw's sweep with the oracle: 98% of sizes within 0.5 points and 0.82 at most
with OpenBLAS's Sandybridge kernels, 99% and 0.73 with its Haswell ones). Rounded, a tie
is a tie and goes to the first set in the candidates' order."""


class _PolicyIgnored(Exception):
    pass


@dataclass
class _Search:
    """The compile-checked search (pure: `measure` compiles)."""

    candidates: list[_Candidate]
    measure: Callable[[_Candidate, int | None], _Compiled]
    limit: int
    max_compiles: int
    band: float = DEFAULT_BAND
    stretch: int = 0
    log: Callable[[str], None] = lambda line: None
    compiled: dict[Any, _Compiled] = dataclasses.field(default_factory=dict)
    order: list[Any] = dataclasses.field(default_factory=list)
    model: _Model | None = None
    sigma: float = 0.0
    oracle: bool = False
    budget_given: bool = False  # max_compiles is the user's: the oracle's cap gives way to it
    stop: str = ""
    noticed: str = ""
    spare: list[_Candidate] = dataclasses.field(default_factory=list)
    """Sets of one tag outside `candidates` (tags the trace says are not worth deciding):
    each compiled once where the rescue explores (after every tag, one compile more each),
    and before the search would end with nothing that fits (`_last_resort`); one that fits
    joins the candidates with the sets beside it (`_adopt`)."""
    beside: Callable[[str], list[_Candidate]] | None = None
    """For a spare tag, the save sets that hold it beside the candidates' tags (`_fit`
    builds them from the step's graph): where the tag alone fits, the walk goes on among
    them."""

    def __post_init__(self) -> None:
        self._by = {c.saved: c for c in self.candidates}
        self._by.update({c.saved: c for c in self.spare if c.saved not in self._by})
        self._floor = 1.0
        self._scale = 1.0  # full remat's compiled bytes, once known
        self._corr: tuple[list[str], np.ndarray] | None = None  # `_alike`, once built

    # ---- bookkeeping -----------------------------------------------------------------

    @property
    def used(self) -> int:
        return len(self.order)

    @property
    def _every(self) -> _Candidate | None:
        """The least-recompute save set (every useful tag saved)."""
        return next((c for c in self.candidates if c.saved is not None), None)

    def _measure(self, c: _Candidate) -> _Compiled:
        predicted = self.predict(c) if self.model is not None and not self.oracle else None
        got = self.measure(c, predicted)
        self.compiled[c.saved] = got
        self.order.append(c.saved)
        figure = self._figure(got)
        if figure is not None and predicted is not None and self._known(c.saved) \
                and c.saved is not None:
            # a save set's miss is the model's: a spare set's is its tag's, and no remat's
            # its untagged values' (`predict` corrects it by its own compile; `chance` gives
            # it its own spread). Counted, no remat's miss put MaxText's mixtral at 30 MiB
            # of uncertainty where the save sets' misses were 1: every chance read even,
            # and the rescue went by predicted bytes, 27.89 points over the best at most
            miss = abs(figure - predicted)
            if miss > self.sigma:
                self.sigma = max(miss, WIDEN * self.sigma)
            else:
                self.sigma = max(NARROW * self.sigma, self._floor)
        if self._figure(got) is not None and self.points():
            self.model = _Model.calibrate(self.points())
        if c in self.spare and not got.over(self.limit):
            self._adopt(c)
        return got

    def _compile_spare(self, cap: float) -> None:
        """Compile each `spare` set not compiled yet, least kept first, while fewer than
        `cap` compiles are spent; one that fits joins the candidates (`_adopt`)."""
        for c in sorted(self.spare, key=lambda c: (c.stored, c.saved)):
            if self.used < cap and c.saved not in self.compiled:
                self._measure(c)

    def _adopt(self, c: _Candidate) -> None:
        """A `spare` set (a tag outside the candidates, alone) fits: it and the sets that
        hold its tag beside the candidates' tags (`beside`) become candidates; its effect
        on the compiled bytes is one more tag's (`_tag_effect`), read from its compile."""
        more = [] if self.beside is None else [
            d for d in self.beside(c.saved[0]) if d.saved not in self._by]
        self.candidates = sorted([*self.candidates, c, *more], key=_order)
        self._by.update({d.saved: d for d in more})
        self._corr, self._gp_key = None, None

    def _figure(self, r: _Compiled) -> int | None:
        """A compile's bytes: memory_analysis()'s, or the figure an out-of-memory error
        gave when it is over the limit (a smaller one is some allocation, not the
        program's total)."""
        if r.bytes is not None:
            return r.bytes
        if r.oom and r.reported is not None and r.reported > self.limit:
            return r.reported
        return None

    def points(self) -> list[tuple[int, int, int]]:
        """(compiled bytes, stored, read) of the compiled candidates with a figure; a
        `spare` set not adopted stays out (its tag's effect is what made it spare)."""
        return [(b, self._by[s].stored, self._by[s].read) for s, r in self.compiled.items()
                if s is not None and self._known(s) and (b := self._figure(r)) is not None]

    @property
    def _calibrated(self) -> bool:
        """Whether some compile gave a figure (`points`). Without one the model is
        uncalibrated: its chances rank the sets, but no figure stands behind them
        (`_long_shot`, `unexplored`, the rescue's `_fewest_tags_most_saved`)."""
        return bool(self.points())

    def _known(self, saved: Any) -> bool:
        """Whether `saved` is a candidate (spare sets become candidates once adopted)."""
        return not self.spare or any(c.saved == saved for c in self.candidates)

    def fits(self, saved: Any) -> bool:
        r = self.compiled.get(saved)
        return r is not None and not r.over(self.limit)

    def best(self) -> _Candidate | None:
        return next((c for c in self.candidates if self.fits(c.saved)), None)

    def predict(self, c: _Candidate) -> int:
        """The model's figure plus the saved tags' share of the misses seen (`_tag_effect`).
        No remat is corrected by its own compile only."""
        assert self.model is not None
        base = self.model.predict(c.stored, c.read)
        if c.saved is None:
            got = self.compiled.get(None)
            if got is not None and got.bytes is not None:
                return got.bytes
            return base
        return base + int(round(self._tag_effect(c.saved)[0]))

    def _tag_effect(self, saved: tuple[str, ...]) -> tuple[float, float]:
        """What the saved tags add beyond the model, and its variance: the model's misses
        on the compiled save sets, read as a sum of one unknown effect per saved tag (each
        normal, sd `TAG_SD` of full remat's bytes, `ALIKE`-correlated between tags the
        trace cannot tell apart) plus noise (sd `SET_SD`). XLA's buffer packing moves
        with particular tags (saving one may compile smaller than saving none); a set
        that shares most of its tags with compiled sets is predicted from them, and one
        made of tags never compiled, nor alike to one compiled, keeps the tags' whole
        uncertainty.

        With the compile as the oracle, a compile that fits gives no figure, only that its
        set is within the limit (and without the errors' figures, one that does not, only
        that it is over): the belief read from the figures is conditioned on those
        outcomes (`_condition_on_outcomes`), so that a set that fit though its tags were
        read as large moves their effects down, and one over the limit moves them up.
        (Before, a set that fit entered as a figure at the limit where the figures put it
        over, and one over without a figure not at all: chosen on the zoo's train steps
        with the oracle, the largest miss went from 2.15 to 1.29 points on moe8-rope-sgd,
        0.73 to 1.45 on gqa4-adamw and 0 to 1.18 on rope-gqa2-bf16, the sizes within 0.5
        points from 99% to 98%, 99% and 99%; without figures gqa4-adamw's largest miss
        from 3.00 to 1.45, moe8-rope-sgd's share within 0.5 points from 97% to 96%. The
        outcomes' noise widened by the search's uncertainty, a quarter of its variance or
        all of it, gave 99% and 98% within 0.5 points on moe8-rope-sgd and rope-gqa2-bf16,
        or 100% and 96% with a largest miss of 2.37 points on rope-gqa2-bf16.)"""
        assert self.model is not None
        key = (len(self.compiled), id(self.model))
        if getattr(self, "_gp_key", None) != key:
            rows = [(s, b - self.model.predict(self._by[s].stored, self._by[s].read))
                    for s, got in self.compiled.items()
                    if s is not None and self._known(s) and (b := self._figure(got)) is not None]
            self._gp = self._effects(rows)
            outcomes = [(s, got.over(self.limit)) for s, got in self.compiled.items()
                        if s and self._known(s) and self._figure(got) is None]
            if outcomes:
                tags, mean, cov, eps2 = self._gp
                mean, cov = _condition_on_outcomes(
                    mean, cov, _marks(tags, [s for s, _ in outcomes]),
                    np.array([self.limit - self.model.predict(self._by[s].stored,
                                                              self._by[s].read)
                              for s, _ in outcomes], float),
                    np.array([o for _, o in outcomes]), eps2)
                self._gp = (tags, mean, cov, eps2)
            self._gp_key = key
        return self._effect(saved)

    def _effects(self, rows: Sequence[tuple[tuple[str, ...], float]]
                 ) -> tuple[list[str], np.ndarray, np.ndarray, float]:
        """The per-tag effects' posterior from (save set, miss) rows: the tags, the mean
        and covariance of their effects, and the noise variance of one set."""
        tags, corr = self._alike()
        x = _marks(tags, [s for s, _ in rows])
        y = np.array([r for _, r in rows], float)
        eps2 = (SET_SD * self._scale) ** 2
        return (tags, *_observe((TAG_SD * self._scale) ** 2 * corr, x, y, eps2), eps2)

    def _effect(self, saved: tuple[str, ...]) -> tuple[float, float]:
        """The summed effect of `saved`'s tags under the belief `_tag_effect` holds, and
        its variance (one set's noise included)."""
        tags, mean, cov, eps2 = self._gp
        v = _marks(tags, [saved])[0]
        return float(v @ mean), max(float(v @ cov @ v), 0.0) + eps2

    def _alike(self) -> tuple[list[str], np.ndarray]:
        """The tags (sorted) and the prior correlation of their effects: `ALIKE` between
        two tags whose sets of one (each saved alone) keep, read and recompute exactly the
        same as each other, 0 between others. A tag whose saving alone changes none of
        these (it pays off only beside others) is alike to none: the sets of one cannot
        tell such tags apart, larger sets may. Being alike is an equivalence, so the
        matrix is a block of equal correlations per class: positive definite for
        0 <= `ALIKE` < 1."""
        if self._corr is None:
            tags = sorted({t for c in self.candidates if c.saved for t in c.saved})
            full = self._by[()]
            trace = {}
            for t in tags:
                c = self._by.get((t,))
                f = None if c is None else (c.kept - full.kept, c.read - full.read,
                                            full.recompute - c.recompute)
                if f is not None and any(f):
                    trace[t] = f
            corr = np.eye(len(tags))
            for i, a in enumerate(tags):
                for j, b in enumerate(tags):
                    if i != j and a in trace and trace.get(b) == trace[a]:
                        corr[i, j] = ALIKE
            self._corr = (tags, corr)
        return self._corr

    def chance(self, c: _Candidate) -> float:
        """The chance `c` compiles within the limit: errors normal, with the search's
        uncertainty (widened after a miss, narrowed after a hit) and the set's own (its
        tags' effects, `_tag_effect`)."""
        spread = self.sigma
        if c.saved is None and None not in self.compiled:
            # what no remat keeps beyond the tags (norms, softmaxes, activations) the
            # compiler often fuses away: uncertain in proportion
            assert self.model is not None
            spread = NO_REMAT_SPREAD * self.sigma + UNTAGGED * self.model.scale * max(
                c.stored - self.candidates[0 if self.candidates[0].saved is not None
                                          else 1].stored, 0)
        elif c.saved is not None:
            spread = math.sqrt(spread ** 2 + self._tag_effect(c.saved)[1])
        return round(_phi((self.limit - self.predict(c)) / max(spread, 1.0)), CHANCE_DIGITS)

    # ---- the search ------------------------------------------------------------------

    def run(self) -> _Candidate | None:
        """The least-recompute candidate whose compile fit (None when none did: then, as
        a last resort, a `spare` set that fits); `stop` says why the search ended."""
        best = self._run()
        return best if best is not None or self.noticed else self._last_resort()

    def _last_resort(self) -> _Candidate | None:
        """Nothing compiled fits: compile the `spare` sets (each tag outside the
        candidates alone, least kept first), one each, within a budget the caller gave,
        and where one fits, walk on among the sets that hold it beside the candidates' tags
        (`beside`); the least-recompute set that fits, None when no spare set does. Such a
        tag keeps little and saves little work by the trace's count, but its saving can
        spare the backward a large recompute workspace the trace does not see: axlearn's
        ``TopKGating.gate_assignment`` (the top-k indices) compiles 2.61 MiB under full
        remat on XLA:CPU (75.43 MiB) with Fuji's layer and a mixture of experts."""
        todo = [c for c in self.spare if c.saved not in self.compiled]
        if not todo or (self.budget_given and self.used >= self.max_compiles):
            return None
        why = self.stop
        self.log(f"fit: nothing compiled fits; as a last resort, each of the {len(todo)} "
                 "tags outside the candidates alone (the trace says they save little, but "
                 "their saving may spare the backward a workspace)")
        self._compile_spare(self.max_compiles if self.budget_given else math.inf)
        fitted = [c for c in todo if self.fits(c.saved)]
        if not fitted:
            self.stop = (f"{why}; no tag outside the candidates, saved alone, fits either"
                         if all(c.saved in self.compiled for c in todo) else
                         f"{why}; the budget of {self.max_compiles} compiles is spent")
            return None
        best = min(fitted, key=lambda c: (c.recompute, c.stored))
        self.stop = (f"{why}; as a last resort, {_what(best.saved)}, a tag outside the "
                     "candidates, fits")
        if self.beside is None or (self.budget_given and self.used >= self.max_compiles):
            return best
        # walk on among the sets that hold it (`_adopt` made them candidates): one compile
        # more per tag of those sets, as the rescue's stretch (a caller's budget holds)
        if not self.budget_given:
            self.max_compiles = self.used + len(self._alike()[0])
        found = self._walk()
        kept = self.stop
        if found is not None and found is not best:
            best = found
        self.stop = (f"{why}; as a last resort, {_what(best.saved)} fits (a tag outside "
                     f"the candidates, then the sets beside it: {kept})")
        return best

    def _run(self) -> _Candidate | None:
        full = self._by[()]
        first = self._measure(full)
        self._floor = FLOOR * (first.bytes or first.reported or self.limit)
        self._scale = float(first.bytes or first.reported or self.limit)
        self.sigma = max(self.band * (first.bytes or self.limit), self._floor)
        if first.bytes is None and not first.oom:
            self.oracle = True
            return self._bisect()
        if first.over(self.limit):
            return self._rescue()
        if first.bytes is not None and self.limit - first.bytes < TIGHT * self.sigma:
            self.log(f"fit: full remat fits with {fmt_bytes(self.limit - first.bytes)} to "
                     f"spare, less than {TIGHT:g} x the uncertainty "
                     f"({fmt_bytes(int(self.sigma))}): exploring each tag as when it does "
                     f"not fit (at most {self.max_compiles + self.stretch} compiles)")
            return self._rescue()
        return self._bisect()

    def _follows(self, full: _Candidate, every: _Candidate) -> bool:
        """Whether the compiled bytes follow the kept bytes (`noticed` says why not); True
        when the compile of every tag gave no figure to tell (out of memory, none given)."""
        figure = self._figure(self.compiled[every.saved])
        if figure is None:
            return True
        grew = figure - self.compiled[()].bytes  # type: ignore[operator]
        if grew >= 0.5 * (every.stored - full.stored):
            return True
        nr = self._by.get(None)
        if nr is None or self.used >= self.max_compiles:
            return True
        got = self._measure(nr)
        if got.bytes is None:
            return True
        extra = nr.stored - full.stored
        if extra > 0 and got.bytes - self.compiled[()].bytes < FOLLOW * extra:
            self._not_following(
                f"no remat keeps {fmt_bytes(extra)} more than full remat but compiles "
                f"{fmt_bytes(got.bytes - self.compiled[()].bytes)} larger, and saving every "
                f"tag {fmt_bytes(grew)}")
            return False
        return True

    def _no_remat_follows(self, first: int, total: int) -> bool:
        """Whether no remat, compiled (within `total` compiles), grows from full remat's
        figure `first` by at least `FOLLOW` of what it keeps more. Saving every tag can
        grow little for another reason than a compiler that ignores the policy: a tag
        whose saving spares the backward a large recompute workspace (MaxText's MoE on
        XLA:CPU: saving the experts' output compiles 4 MiB under full remat) offsets
        what the others keep. No remat keeps the most and recomputes nothing: when it
        grows, the memory follows the kept bytes. False when it cannot be compiled or
        gives no figure (the search then reads the flat evidence as it stands)."""
        nr = self._by.get(None)
        if nr is None or (None not in self.compiled and self.used >= total):
            return False
        got = self.compiled.get(None) or self._measure(nr)
        figure, extra = self._figure(got), nr.stored - self._by[()].stored
        return figure is not None and extra > 0 and figure - first >= FOLLOW * extra

    def _not_following(self, evidence: str) -> None:
        """Stop: the compiled memory does not follow the kept bytes (`evidence` says how)."""
        self.noticed = (
            f"the compiled step's memory does not follow the kept residuals: {evidence} (the "
            "compiler schedules the layers its own way, as XLA:CPU does an unrolled Python "
            "loop); the search was not run on: the plan is the least-recompute of the "
            "compiled sets that fit")
        self.stop = "memory does not follow the kept bytes"
        self.log(f"fit: {self.noticed}")

    def _walk(self) -> _Candidate | None:
        walk_overs = 0
        while True:
            best = self.best()
            if best is None:
                self.stop = "nothing compiled fits"
                return None
            if best is self.candidates[0]:
                self.stop = "the best compiled set fits and nothing recomputes less"
                return best
            if self.used >= self.max_compiles:
                self.stop = f"the budget of {self.max_compiles} compiles is spent"
                return best
            better = [c for c in self.candidates
                      if c.saved not in self.compiled and c.recompute < best.recompute]
            if not better:
                self.stop = "every set that recomputes less was compiled"
                return best
            if better == [self.candidates[0]] and better[0].saved is None:
                if self._every is not None and not self.fits(self._every.saved):
                    self.stop = ("every set that recomputes less was compiled but no remat, "
                                 "which keeps more than saving every tag, over the limit")
                    return best
                # the least-recompute save set fits: only no remat is better, and one
                # compile says whether it fits (its own prediction is the least sure)
                got = self._measure(better[0])
                continue
            last = self.used == self.max_compiles - 1
            cautious = last and best.saved == ()
            choice = None
            if walk_overs >= 2:  # the walk stalls: bisect the predicted frontier
                choice = self._frontier_midpoint(better)
                if choice is not None and cautious and self.chance(choice) < LIKELY:
                    choice = None
            if choice is None:
                scored = self._scored(best, better, PLAUSIBLE, cautious)
                if not scored and not cautious:  # compiles left: the best long shot
                    scored = self._scored(best, better, self._long_shot(), cautious)
                if not scored:
                    self.stop = self._no_long_shot(cautious)
                    return best
                if last:  # no compile follows to mend a miss: a likely fit, if any
                    scored = [s for s in scored if s[1] >= LIKELY] or scored
                choice = max(scored, key=lambda s: s[:3])[3]
            got = self._measure(choice)
            walk_overs = walk_overs + 1 if got.over(self.limit) else 0

    def _no_long_shot(self, cautious: bool) -> str:
        """Why the walk stopped with compiles left: no set that recomputes less than the
        best compiled one is worth one (`_scored`, at `_long_shot`'s chance)."""
        if cautious:
            return (f"no set that recomputes less than the best compiled one is {LIKELY:.0%} "
                    f"likely or more to fit (uncertainty {fmt_bytes(int(self.sigma))}, the "
                    "last compile kept for a likely fit)")
        if self._long_shot() > 0:
            return (f"no set that recomputes less than the best compiled one is "
                    f"{LONG_SHOT:.0%} likely or more to fit (uncertainty "
                    f"{fmt_bytes(int(self.sigma))})")
        return ("every set that recomputes less than the best compiled one holds every tag "
                "of a set that ran out of memory")

    def _long_shot(self) -> float:
        """The least chance to fit of a set the walk compiles where none is `PLAUSIBLE`:
        `LONG_SHOT`, or none at all while no compile has given a figure (the compile as
        the oracle, each error bare). There the chances come from a model no figure
        calibrated, its per-byte scale and workspace slope at their prior and its
        intercept placed by which sets fit (`_model_by_outcomes`) or raised to put full
        remat over the limit (`_rescue`): they rank the sets, but do not say that the
        budget stated up front is better left unspent. linen-gpt2 at 18.77 MiB,
        without figures: full remat, every tag and `merged_heads` ran out of memory,
        `c_proj` fit, and the walk stopped after 4 of its 10 compiles, every set that
        recomputes less put under 3%; `c_proj, c_fc` fits (8.91 points less recompute).
        On the zoo's train steps this moved nothing in any mode."""
        return LONG_SHOT if self._calibrated else 0.0

    def _scored(self, best: _Candidate, better: Sequence[_Candidate], least: float,
                cautious: bool) -> list[tuple[float, float, int, _Candidate]]:
        """The save sets of `better` at least `least` likely to fit (`LIKELY` where the
        compile is `cautious`), each with its expected gain (chance x recompute saved
        against `best`), its chance and its recompute negated, for `max`. A set holding
        every tag of one that ran out of memory with no figure is left out: it keeps more,
        and no figure told the model by how much the smaller one was over (chosen on the
        zoo's train steps with the oracle and no figures: rope-gqa2-bf16 within 0.5 points
        at 96% -> 98% of sizes, largest miss 2.37 -> 1.18; moe8-rope-sgd 96% -> 97%, 2.15
        -> 1.79; the others unchanged, nothing moved with figures)."""
        scored = []
        over = [set(s) for s, r in self.compiled.items()
                if s and r.over(self.limit) and self._figure(r) is None]
        for c in better:
            if c.saved is None:  # no remat: only once the least-recompute set fits
                continue
            if any(o <= set(c.saved) for o in over):
                continue
            p = self.chance(c)
            if p < least or (cautious and p < LIKELY):
                continue
            scored.append((p * (best.recompute - c.recompute), p, -c.recompute, c))
        return scored

    def unexplored(self) -> list[tuple[_Candidate, float]]:
        """Once the search has ended: the save sets it did not compile that recompute less
        than the best one that fit and that its model gives at least `PLAUSIBLE` chance
        to fit, each with that chance, greatest expected gain first (what a larger budget
        would compile next). Empty where no compile gave a figure (the chances then come
        from an uncalibrated model), where nothing fit or where memory does not follow
        the kept bytes."""
        best = self.best()
        if best is None or self.model is None or self.noticed or not self._calibrated:
            return []
        better = [c for c in self.candidates
                  if c.saved not in self.compiled and c.recompute < best.recompute]
        scored = sorted(self._scored(best, better, PLAUSIBLE, False),
                        key=lambda s: s[:3], reverse=True)
        return [(c, p) for _, p, _, c in scored]

    def _frontier_midpoint(self, better: Sequence[_Candidate]) -> _Candidate | None:
        front = _frontier(self.candidates, self.predict)
        idx = {c.saved: i for i, c in enumerate(front)}
        lo = min((idx[s] for s in self.compiled if s in idx and self.fits(s)),
                 default=len(front) - 1)
        hi = max((idx[s] for s in self.compiled if s in idx and not self.fits(s)
                  and idx[s] < lo), default=-1)
        todo = {c.saved for c in better}
        between = [i for i in range(hi + 1, lo) if front[i].saved in todo]
        if not between:
            return None
        mid = (hi + lo) / 2
        return front[min(between, key=lambda i: (abs(i - mid), i))]

    def _bisect(self) -> _Candidate | None:
        """Bisect the predicted frontier from its middle (see `_oracle_cap`), each compile
        saying whether its set fits; once figures have calibrated the model, each next set
        is the least-recompute one between the nearest fit and the nearest over (with
        memory figures, the frontier's top while none came out over) that the model puts
        within the limit (`_oracle_next`); with the oracle the middle until one came out
        over (a set that fits gives no figure). With memory figures this is the
        search wherever full remat fits with room (`TIGHT`), within `max_compiles`; with
        the compile as the oracle (no memory figures: fits or runs out of memory) within
        `_oracle_cap`, unless the caller gave a budget.

        Every figure is kept (with the oracle, an out-of-memory error's): where the two
        compiled sets furthest apart in kept bytes (at least `FLAT_SPAN` of the limit)
        differ in their figures by less than `FOLLOW` of that, the compiled memory may not
        follow the kept residuals, and once the frontier's top (the set that keeps the
        most) says so too, the search stops there (`_flat_best`); where the top fits,
        nothing recomputes less. When the bisection converges with compiles left and
        figures calibrated the model, the rest go to `_walk`: sets beside the predicted
        frontier that the figures say may fit. With the oracle, where that model puts full
        remat within `TIGHT` x the uncertainty of the limit (`_tight_by_figures`), at
        convergence or once the budget is spent (fit's own, not the caller's), there are
        `stretch` compiles more, each tag alone first while nothing better than full remat
        fits (`_stretch_by_figures`), as `_rescue` has with memory figures there. Where the
        errors gave no figures, a converged bisection with compiles left walks on a model
        placed by which sets fit (`_model_by_outcomes`).

        With memory figures the search compiled every tag saved second, then walked by
        expected gain. Bisecting first was chosen on the zoo's train steps (memory figures,
        the cached brute force): within 0.5 points of the best at 99% of sizes on gqa4-adamw
        (97% before) and 98% on moe8-rope-sgd (94%, largest miss 8.81 -> 8.09 points, in the
        rescue), 98% on rope-gqa2-bf16 (99%; its largest miss 1.18 -> 2.37: after 6
        compiles, a gated FFN's two alike halves that compile apart); wide-ffn-sgd-bf16 and
        long-seq unchanged, every share within the cap unchanged. After the middle's
        compile, the set the model puts within the limit before any came out over (rather
        than halving on up): rope-gqa2-bf16 99% (largest miss 1.18), the other train steps
        unchanged in every column. Reading flat memory from
        full remat and one save set (as every tag saved against full remat was read) cost
        moe8-rope-sgd 3 points: a set holding its router's logits and experts' up projection
        compiles 0.8 MiB under what it keeps, the pair spares a workspace."""
        front = _frontier(self.candidates)
        if self.oracle and not self.budget_given:  # a caller's budget is theirs
            self.max_compiles = _oracle_cap(len(front))
        self.log(("fit: the backend reports no memory figures; the compile is the oracle. "
                  if self.oracle else "fit: ")
                 + f"bisecting a predicted frontier of {len(front)} save sets from its "
                 f"middle: at most {self.max_compiles} compiles in all")
        lo, hi = len(front) - 1, -1  # front[lo] fits (full remat); front[hi] does not
        start = self.used
        while lo - hi > 1 and self.used < self.max_compiles:
            # the middle first; then the set the model puts within the limit, though none
            # came out over yet where memory figures calibrate it (not the oracle's)
            first = hi < 0 and (self.oracle or self.used == start)
            mid = (lo + hi) // 2 if first else self._oracle_next(front, lo, hi)
            c = front[mid]
            if c.saved in self.compiled:  # full remat is the whole frontier's only set
                break
            got = self._measure(c)
            if got.bytes is None and not got.oom:
                self.oracle = True  # no figures now: the compile decides
            if len(self.compiled) == 2:
                self._check_program(c)
            if got.over(self.limit):
                hi = mid
            else:
                lo = mid
            if self._flat_evidence(self._with_figures()) is None:
                continue
            if front[0].saved not in self.compiled and self.used < self.max_compiles:
                # before calling memory flat, the set that keeps the most: one tag whose
                # saving spares as much workspace as it keeps looks flat too
                self._measure(front[0])
            top_fits = self.fits(front[0].saved)  # (its figure counts where it has one)
            if not (top_fits and self.oracle) and self._flat(self._with_figures()):
                return self._flat_best()
            if top_fits:
                lo = 0  # nothing recomputes less
                break
        self.stop = ("bisection converged" if lo - hi <= 1
                     else f"the budget of {self.max_compiles} compiles is spent")
        best = front[lo]
        stretched = False
        if lo - hi <= 1 and self.model is not None and self.used < self.max_compiles:
            # converged with compiles to spare, and out-of-memory figures calibrated the
            # model: the sets beside the frontier that the figures say may fit get the
            # rest, by expected gain as with memory figures (with the stretch from the
            # start where those figures put full remat close to the limit, so that the
            # walk does not hold back a last compile that is not its last)
            stretched = self.oracle and self._stretch_by_figures()
            self.log("fit: bisection converged; walking beside the frontier with "
                     f"{self.max_compiles - self.used} compiles left")
            best = self._walk() or best
        if not stretched and self.oracle and self.used >= self.max_compiles \
                and self._stretch_by_figures():
            best = self._walk() or best
        if lo - hi <= 1 and self.model is None and self.used < self.max_compiles \
                and self._model_by_outcomes():
            self.log("fit: bisection converged; no out-of-memory figures, so the model is "
                     "placed between the sets that fit and those that did not: walking "
                     f"beside the frontier with {self.max_compiles - self.used} compiles left")
            best = self._walk() or best
        every = self._every
        if best is not None and best.saved is None and every is not None and every.saved \
                and every.saved not in self.compiled and self.used < self.max_compiles:
            # no remat fits; so may every tag saved, whose compile can count fewer FLOPs
            # (no remat keeps converts and XLA's rewrites that saving every tag does not):
            # one compile more lets fit compare the two (`_fit._fewest_ops`)
            self._measure(every)
        return best

    def _model_by_outcomes(self) -> bool:
        """No memory figures and no out-of-memory figures: only which compiles fit. With the
        per-byte scale and the workspace slope at their prior (1), the intercept lies
        between the limit less the largest (stored + read) of the sets that fit and the
        limit less the smallest of those that did not: the model takes its middle, and
        the uncertainty half that interval (at least `FLOOR`). Whether there was such an
        interval (the outcomes may contradict a model of bytes alone: then no model)."""
        sets = [(self._by[s], r) for s, r in self.compiled.items()
                if s is not None and self._known(s)]
        fit = [c.stored + c.read for c, r in sets if not r.over(self.limit)]
        over = [c.stored + c.read for c, r in sets if r.over(self.limit)]
        if not fit or not over:
            return False
        top, bottom = self.limit - max(fit), self.limit - min(over)  # bottom < c <= top
        if bottom >= top:
            return False
        self.model = _Model((top + bottom) / 2, 1.0, 1.0)
        self.sigma = max((top - bottom) / 2, self._floor)
        return True

    def _stretch_by_figures(self) -> bool:
        """With the compile as the oracle and fit's own budget: when the model the
        out-of-memory figures calibrated puts full remat within `TIGHT` x the uncertainty
        of the limit (`_tight_by_figures`), `stretch` compiles more, as `_rescue` has with
        memory figures there, and as `_rescue` does, each `spare` tag alone (one compile
        more each), then while nothing better than full remat fits, each tag alone
        (`_each_tag_alone`). Whether it gave them."""
        if self.model is None or self.budget_given or not self._tight_by_figures():
            return False
        self.max_compiles += self.stretch + len(self.spare)
        self.log(f"fit: the out-of-memory figures put full remat within {TIGHT:g} x the "
                 f"uncertainty of the limit, where the model cannot rank the sets: "
                 f"{self.stretch + len(self.spare)} compiles more, as with memory figures "
                 f"(at most {self.max_compiles})")
        self._compile_spare(self.max_compiles)
        best = self.best()
        if best is not None and best.saved == ():
            self._each_tag_alone()
        return True

    def _each_tag_alone(self) -> None:
        """Compile each tag alone not compiled yet, most likely to fit first, until one
        fits or the budget is spent: saving one tag can compile smaller than saving none
        (`_rescue`'s second stage, for the oracle when nothing better than full remat
        fit)."""
        while self.used < self.max_compiles:
            singles = self._untried_singles()
            if not singles:
                return
            if not self._measure(self._most_likely(singles)).over(self.limit):
                return

    def _untried_singles(self) -> list[_Candidate]:
        """The sets of one tag not compiled yet."""
        return [c for c in self.candidates if c.saved and len(c.saved) == 1
                and c.saved not in self.compiled]

    def _most_likely(self, cands: Sequence[_Candidate]) -> _Candidate:
        """The candidate most likely to fit, the one that recomputes less on a tie."""
        return max(cands, key=lambda c: (self.chance(c), -c.recompute))

    def _most_gain(self, cands: Sequence[_Candidate]) -> _Candidate:
        """The candidate of greatest expected gain against full remat (chance to fit x
        recompute saved, as the walk scores its sets: `_scored`), the likelier, then the
        one that recomputes less, on a tie; most likely where `_scored` leaves none."""
        scored = self._scored(self._by[()], cands, 0.0, False)
        return max(scored, key=lambda s: s[:3])[3] if scored else self._most_likely(cands)

    def _fewest_tags_most_saved(self, cands: Sequence[_Candidate]) -> _Candidate:
        """The set of fewest tags, the one that recomputes least among those: the rescue's
        order once full remat and every tag alone ran out of memory and no error gave a
        figure. The uncalibrated model ranked those singles by what they keep and read
        beyond full remat, and all came out over: it has nothing left to rank by. XLA's
        workspace drops with the recompute a set cuts, not with what it keeps (on MaxText's
        gpt-oss at 62.33 MiB, where each tag alone compiles 1.3 to 5.2 MiB over, the pairs
        of its three expert projections cut the most recompute of any pair, and one of them
        fits; the model's next four, pairs of attention projections, were each over by 5
        MiB or more)."""
        return min(cands, key=lambda c: (len(c.saved or ()), c.recompute, c.stored))

    def _tight_by_figures(self) -> bool:
        """With the compile as the oracle: whether the model the out-of-memory figures
        calibrated predicts full remat within `TIGHT` x the uncertainty of the limit (with
        memory figures, the compile says so and `_rescue` explores with `stretch` more)."""
        return self.limit - self.predict(self._by[()]) < TIGHT * self.sigma

    def _oracle_next(self, front: Sequence[_Candidate], lo: int, hi: int) -> int:
        """The next frontier index to compile between a set that fits (`lo`) and one over
        (`hi`; -1 while none came out over, the top a candidate too): once figures (memory
        or out-of-memory) have calibrated the model, the least-recompute set between them
        predicted within the limit (the interval's midpoint when none is, or no figure
        came); otherwise the midpoint.

        Tried and not kept: the set of greatest expected gain (chance to fit x recompute
        saved against the best compiled set that fits, no remat left out), as the walk
        picks. On the train steps it gained more than it lost (rope-gqa2-bf16 with memory
        figures and with the oracle's from 99% of sizes within 0.5 points and 1.18 at most
        to 100% and 0; moe8-rope-sgd with the oracle's from 98% and 1.29 to 100% and 0.43,
        with memory figures 98% -> 97%); held out it lost more than it gained
        (moe8-rope-sgd-fsdp8 with the oracle's figures 98% and 1.83 -> 92% and 7.15;
        moe-fused-qkv-fsdp8 with memory figures 97% and 3.60 -> 94% and 7.33; eqx-llama's
        largest miss 0.57 -> 1.68 with memory figures, 0 -> 1.68 with the oracle's;
        eqx-llama-accum4 with the oracle's 95% -> 98%)."""
        mid = (lo + hi) // 2
        if self.model is None:
            return mid
        inside = [i for i in range(hi + 1, lo) if self.predict(front[i]) <= self.limit]
        return inside[0] if inside else mid

    def _flat(self, overs: Sequence[tuple[_Candidate, int]]) -> bool:
        """Whether the out-of-memory figures seen say the compiled memory does not follow
        the kept bytes (`noticed` says why): the two sets over the limit furthest apart in
        kept bytes, at least `FLAT_SPAN` of the limit apart, differ in their figures by
        less than `FOLLOW` of that."""
        evidence = self._flat_evidence(overs)
        if evidence is None:
            return False
        self._not_following(evidence)
        return True

    def _flat_evidence(self, overs: Sequence[tuple[_Candidate, int]]) -> str | None:
        """What `_flat` reads in `overs`, as the line it would log (None: nothing), without
        its verdict."""
        if len(overs) < 2:
            return None
        (a, ra), (b, rb) = (max(overs, key=lambda o: o[0].stored),
                            min(overs, key=lambda o: o[0].stored))
        span = a.stored - b.stored
        if span < FLAT_SPAN * self.limit or ra - rb >= FOLLOW * span:
            return None
        figures = ("the compiler's out-of-memory figures" if self.oracle else
                   "their compiled bytes")
        return (f"{_what(a.saved)} keeps {fmt_bytes(span)} more than {_what(b.saved)}, but "
                f"{figures} differ by {fmt_bytes(ra - rb)}")

    def _with_figures(self) -> list[tuple[_Candidate, int]]:
        """The compiled save sets with a figure (`_figure`: with the oracle, those over
        the limit whose error gave one), each with it; not full remat: a set that compiles
        under what it keeps against full remat may be one tag sparing a workspace (two save
        sets that compile alike are not)."""
        return [(self._by[s], b) for s, r in self.compiled.items()
                if s != () and self._known(s) and (b := self._figure(r)) is not None]

    def _check_program(self, c: _Candidate) -> None:
        """Raise `_PolicyIgnored` when `c` (the bisection's first set, or every tag saved in
        the rescue) compiled to full remat's FLOPs (and bytes, where both have figures)
        though it keeps other bytes."""
        a, b = self.compiled[()], self.compiled[c.saved]
        if not b.oom and a.flops == b.flops and c.kept != self._by[()].kept \
                and (a.bytes is None or b.bytes is None or a.bytes == b.bytes):
            raise _PolicyIgnored(f"full remat and {_what(c.saved)} compile to the same "
                                 f"program ({b.flops / 1e9:.4g} GFLOP"
                                 + ("" if b.bytes is None else f", {fmt_bytes(b.bytes)}")
                                 + ")")

    def _flat_best(self) -> _Candidate | None:
        """The compiled memory does not follow the kept bytes (`_flat`): every save set
        compiles to about the same bytes, so the least-recompute one (every tag) is as
        likely to fit as any; compile it when it was not, the budget allows and the
        least-recompute candidate (no remat) did not fit, then the best that fit."""
        every, best = self._every, self.best()
        if every is not None and every.saved not in self.compiled \
                and self.used < self.max_compiles and best is not self.candidates[0]:
            self._measure(every)
        return self.best()

    def _rescue(self) -> _Candidate | None:
        """Full remat does not fit, or fits tightly (`TIGHT`): look for sets that compile
        smaller than the model says. XLA's workspace can drop by more than a tag keeps,
        and the drop comes with particular tags (saving one that cuts a layer's recompute
        in two), not with the smallest. First every tag (the model's second point; on a
        step whose memory does not follow the kept bytes, as likely to fit as any set,
        and the search stops there when it shows that); then each `spare` tag alone (one
        compile more each: where one fits, the walk goes on among the sets beside it);
        then each tag alone until each has been compiled alone, then any set: with memory
        figures by expected gain (chance to fit x recompute saved, `_most_gain`), with the
        compile as the oracle most likely to fit first. The first that fits hands over to
        the walk, with what is left of the rescue's budget (`max_compiles` + `stretch`, and
        one per spare tag; with the compile as the oracle, `_oracle_cap` and one per spare
        tag, on the model its out-of-memory figures calibrated, and `stretch` more where
        the first fit came with that spent: the rescue returned that fit instead, which
        on MaxText's gpt-oss, saving one tag, was 32 to 60 points of recompute over the
        best; that step's sweep went to 5.27 points at most without figures and 32.37
        with them, and no README table of the zoo moved). With no figure at all, the
        model is the uncalibrated one with full remat put over the limit: each tag alone,
        most likely first, is then least kept and read beyond full remat first (chosen on
        the zoo's train steps with the oracle and no figures: gqa4-adamw within 0.5
        points at 93% -> 94% of sizes; the others unchanged; it was the most recompute
        saved first, every set predicted far within the limit). Once every tag alone is
        over too, the sets of fewest tags, least recompute first
        (`_fewest_tags_most_saved`).

        By expected gain with memory figures was chosen on the train steps (before, most
        likely first in both modes): gqa4-adamw within 0.5 points at 99% -> 100% of sizes,
        largest miss 0.73 -> 0.16; moe8-rope-sgd 98% -> 99%, 8.09 -> 7.66; rope-gqa2-bf16
        99% -> 98% (1.18 at most in both); long-seq within the cap 98% -> 99%. With the
        oracle it was tried and not kept: the first fit comes sooner, within the
        bisection's cap, and the walk from it has no stretch (`maxtext-mixtral`, a tuning
        step, with the oracle's figures: 98% / 0.88 -> 88% / 26.96)."""
        full = self._by[()]
        if self.points():  # memory figures, or the out-of-memory error's
            self.model = _Model.calibrate(self.points())
        else:
            # no figure, so full remat ran out of memory (a tight fit is known only from
            # its figure): the uncalibrated model, its intercept raised to put full remat
            # over the limit (so the sets it ranks first are those that keep and read least
            # beyond full remat, not those that save most)
            self.model = _Model(max(float(self.compiled[()].fixed or 0),
                                    float(self.limit - full.stored - full.read + 1)), 1.0, 1.0)
        total = self.max_compiles + self.stretch
        every = self._every
        if every is not None and every.saved and self.used < total:
            got = self._measure(every)
            if got.bytes is None and not got.oom:
                # no figures: the compile is the oracle, and every tag fits; only no remat
                # recomputes less, and the walk says whether it is worth a compile
                self.oracle = True
                self.max_compiles = total if self.budget_given else _oracle_cap(len(
                    _frontier(self.candidates)))
                return self._walk()
            self._check_program(every)
            if not got.over(self.limit):
                if self.fits(()) and not self._follows(full, every):
                    return self.best()  # full remat fits tightly, and memory is flat
                self.max_compiles = total
                return self._walk()
            figure, first = self._figure(got), self._figure(self.compiled[()])
            extra = every.stored - full.stored
            if figure is not None and first is not None and extra > 0 \
                    and figure - first < FOLLOW * extra \
                    and not self._no_remat_follows(first, total):
                self._not_following(f"saving every tag keeps {fmt_bytes(extra)} more than "
                                    f"full remat but compiles {fmt_bytes(figure - first)} "
                                    "larger")
                return self.best()
        if self.spare and not self.budget_given:
            total += len(self.spare)
        self._compile_spare(total)
        if any(self.fits(c.saved) for c in self.spare):
            self.max_compiles = total
            return self._walk()
        while self.used < total:
            left = [c for c in self.candidates if c.saved not in self.compiled
                    and c.saved is not None]  # no remat keeps the most: never smaller
            if not left:
                break
            singles = self._untried_singles()
            todo = singles or left
            # with memory figures, by expected gain: an over compile calibrates the model
            # too, and the budget is the memory mode's; with the oracle, most likely first,
            # until every tag alone came out over with no figure (`_fewest_tags_most_saved`)
            c = (self._most_gain(todo) if self.compiled[()].bytes is not None
                 else self._fewest_tags_most_saved(todo) if not singles and not self._calibrated
                 else self._most_likely(todo))
            got = self._measure(c)
            if got.over(self.limit):
                continue
            if got.bytes is None:  # the compile is the oracle: walk on the error's figures
                self.oracle = True
                # the bisection's cap and the spare tags' one each; where the first fit
                # came with that spent, `stretch` more (the oracle's budget where full
                # remat does not fit, as said up front), so that the walk has compiles
                cap = total if self.budget_given else _oracle_cap(len(_frontier(
                    self.candidates))) + len(self.spare)
                if self.used >= cap and not self.budget_given:
                    cap += self.stretch
                if self.model is None or self.used >= cap:
                    break
                self.max_compiles = cap
                return self._walk() or self.best()
            # one fits: recompute less with what is left of the rescue's budget
            self.max_compiles = total
            return self._walk()
        best = self.best()
        if not any(c.saved for c in self.candidates):
            self.stop = ("no tag is a candidate: full remat is the only save set"
                         + ("" if self.fits(()) else ", and it does not fit"))
        elif self.fits(()):
            self.stop = (f"full remat fits tightly; each tag alone and the sets most likely "
                         f"to fit came out over ({self.used} compiles)")
        else:
            self.stop = ("full remat does not fit; a set predicted smaller does" if best
                         else "full remat does not fit, nor the sets most likely to fit")
        return best


def _what(saved: tuple[str, ...] | None) -> str:
    return NO_REMAT if saved is None else ("save " + ", ".join(saved) if saved else
                                           "full remat")
