"""Stand-in for axlearn.common.flash_attention.layer.FlashAttention (34aed43c,
axlearn/common/flash_attention/layer.py:30): a GroupedQueryAttention subclass. On Neuron its
``_compute_attention`` calls the NKI kernel (neuron_attention.py, a custom_vjp with no
checkpoint_name) and does not tag ``context``."""

from __future__ import annotations

from typing import Any

from axlearn.common.attention import GroupedQueryAttention
from axlearn.common.config import config_class


class FlashAttention(GroupedQueryAttention):
    @config_class
    class Config(GroupedQueryAttention.Config):
        tpu_block_size: int = 512
        mha_dim_to_partition_spec: Any = {}
