"""Stand-in for helpers of axlearn.experiments.text.gpt.common (34aed43c): MESH_AXIS_NAMES
(line 80), mesh_shape_from_axes (158), scaled_hidden_dim/scale_fn (83: ceil(dim * scale /
multiple) * multiple), STEP_DTYPE (75: bfloat16)."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from axlearn.common.config import config_for_function

STEP_DTYPE = jnp.bfloat16
MESH_AXIS_NAMES = ("pipeline", "data", "expert", "fsdp", "seq", "model")


def mesh_shape_from_axes(*, pipeline: int = 1, data: int = 1, expert: int = 1, fsdp: int = 1,
                         seq: int = 1, model: int = 1) -> tuple[int, ...]:
    return (pipeline, data, expert, fsdp, seq, model)


def scale_fn(input_dim: int, *, scale: float, round_up_to_multiples_of: int) -> int:
    return math.ceil(input_dim * scale / round_up_to_multiples_of) * round_up_to_multiples_of


def scaled_hidden_dim(scale: float, *, round_up_to_multiples_of: int = 256) -> Any:
    return config_for_function(scale_fn).set(scale=scale,
                                             round_up_to_multiples_of=round_up_to_multiples_of)
