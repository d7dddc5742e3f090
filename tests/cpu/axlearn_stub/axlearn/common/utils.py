"""Stand-in for axlearn.common.utils: ``save_and_offload_only_these_names_regex`` with
axlearn's keyword-only signature (axlearn/common/utils.py at 34aed43c). Its behaviour is
supplied by neuron_remat's implementation of the same function, so a policy built from a
config can be run under jax.checkpoint in the tests."""

from __future__ import annotations

from typing import Any


def save_and_offload_only_these_names_regex(
    *,
    names_which_can_be_saved: Any,
    names_which_can_be_offloaded: Any,
    offload_src: Any,
    offload_dst: Any,
) -> Any:
    from neuron_remat import policies

    return policies.save_and_offload_only_these_names_regex(
        names_which_can_be_saved=names_which_can_be_saved,
        names_which_can_be_offloaded=names_which_can_be_offloaded,
        offload_src=offload_src, offload_dst=offload_dst)
