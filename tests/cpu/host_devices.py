"""XLA:CPU's host devices, for the tests and zoos that lay a step over several.

XLA:CPU makes as many devices as ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
says when JAX's backend starts, so a step over N devices runs in a process started so
(`run`), and a fixture that needs them says how to get them (`first`)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def first(n: int, who: str) -> list[Any]:
    """The first `n` of ``jax.devices()``; a RuntimeError naming `who` and the flag when
    JAX sees fewer."""
    import jax  # noqa: PLC0415

    found = jax.devices()
    if len(found) < n:
        raise RuntimeError(f"{who} needs {n} devices and JAX sees {len(found)}: start it "
                           f"with XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    return list(found[:n])


def run(code: str, n: int) -> str:
    """Python `code`'s stdout, run in a process that sees `n` XLA:CPU devices (the test
    environment's XLA_FLAGS kept), with tests/cpu and the checkout on its path; an
    AssertionError with its stderr when it fails."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"
    env = {**os.environ, "XLA_FLAGS": flags.strip(),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=900, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
