"""Which tag sets a test holds to JAX: every subset, or a sample that covers every pair.

`every_or_covering` reads ``NR_TEST_TAG_SETS``: unset or ``every`` gives every subset (the
README's test command), ``covering`` the pairwise-covering sample (`covering_sample`). CI's
runs on the other JAX versions and on JAX's new remat set ``covering``: they repeat tests
the README's command already runs over every subset on the default JAX, and there every
subset of the trace tests' 9 tags cost about 4.5 minutes of a 6.5-minute run.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Sequence

ENV = "NR_TEST_TAG_SETS"
CHOICES = ("every", "covering")


def every_subset(tags: Sequence[str]) -> list[tuple[str, ...]]:
    """Every subset of `tags`, smallest first."""
    return [s for r in range(len(tags) + 1) for s in itertools.combinations(tags, r)]


def covering_sample(tags: Sequence[str], extra: int = 48, seed: int = 0
                    ) -> list[tuple[str, ...]]:
    """Subsets of `tags` that cover every tag and every pair of tags in each of the four
    ways (both saved, one without the other, neither): none, all, each tag alone, all but
    each tag, and `extra` more drawn at random (seeded). The coverage is asserted, not
    assumed."""
    tags = tuple(tags)
    out = {(), tags}
    out |= {(t,) for t in tags} | {tuple(u for u in tags if u != t) for t in tags}
    rng = random.Random(seed)
    while len(out) < 2 * len(tags) + 2 + extra and len(out) < 2 ** len(tags):
        out.add(tuple(t for t in tags if rng.random() < 0.5))
    for a, b in itertools.combinations(tags, 2):
        ways = {(a in s, b in s) for s in out}
        assert ways == {(True, True), (True, False), (False, True), (False, False)}, (a, b)
    return sorted(out, key=lambda s: (len(s), s))


def every_or_covering(tags: Sequence[str]) -> list[tuple[str, ...]]:
    """Every subset of `tags`, or with ``NR_TEST_TAG_SETS=covering`` the covering sample."""
    how = os.environ.get(ENV, "every")
    if how not in CHOICES:
        raise ValueError(f"{ENV}={how!r} (from the environment): use one of {CHOICES}")
    return every_subset(tags) if how == "every" else covering_sample(tags)
