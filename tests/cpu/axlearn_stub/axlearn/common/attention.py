"""Stand-in for the layer classes of axlearn.common.attention (apple/axlearn 34aed43c,
axlearn/common/attention.py): the class names and inheritance (lines 659-1094 for the QKV
linears, 1704 MultiheadAttention, 2383 GroupedQueryAttention, 2779
TransformerAttentionLayer, 3114 TransformerFeedForwardLayer, 3413 TransformerLayer, 3902-4494
the stacks) and the config fields the adapter reads, with axlearn's defaults."""

from __future__ import annotations

import enum
from typing import Any, Optional

from axlearn.common.base_layer import BaseLayer
from axlearn.common.config import REQUIRED, Required, config_class
from axlearn.common.layers import LayerNorm, Linear


class MultiheadInputLinear(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        bias: bool = True


class BaseQKVLinear(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        query_dim: Required[int] = REQUIRED
        key_dim: Required[int] = REQUIRED
        value_dim: Required[int] = REQUIRED
        num_heads: Required[int] = REQUIRED
        per_head_dim: Required[int] = REQUIRED


class QKVLinear(BaseQKVLinear):
    @config_class
    class Config(BaseQKVLinear.Config):
        layer: Any = MultiheadInputLinear.default_config()


class GroupedQKVLinear(QKVLinear):
    @config_class
    class Config(QKVLinear.Config):
        num_kv_heads: Required[int] = REQUIRED


class FusedQKVLinear(BaseQKVLinear):
    @config_class
    class Config(BaseQKVLinear.Config):
        layer: Any = MultiheadInputLinear.default_config()


class FusedGroupedQKVLinear(BaseQKVLinear):
    @config_class
    class Config(BaseQKVLinear.Config):
        num_kv_heads: Required[int] = REQUIRED
        layer: Any = MultiheadInputLinear.default_config()


class RoFormerQKVLinear(BaseQKVLinear):
    @config_class
    class Config(BaseQKVLinear.Config):
        input_linear: Any = QKVLinear.default_config()
        rotary_value: Required[bool] = REQUIRED


class MultiheadAttention(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        query_dim: Required[int] = REQUIRED
        key_dim: Required[int] = REQUIRED
        value_dim: Required[int] = REQUIRED
        output_dim: Optional[int] = None
        hidden_dim: Optional[int] = None
        num_heads: Required[int] = REQUIRED
        input_linear: Any = QKVLinear.default_config()
        mask: Optional[Any] = None
        causal: Optional[bool] = None


class GroupedQueryAttention(MultiheadAttention):
    pass


class TransformerAttentionLayer(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        target_dim: Required[int] = REQUIRED
        source_dim: Required[int] = REQUIRED
        norm: Any = LayerNorm.default_config()
        attention: Any = MultiheadAttention.default_config()
        structure: str = "prenorm"


class TransformerFeedForwardLayer(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        hidden_dim: Required[Any] = REQUIRED
        linear1: Any = Linear.default_config()
        linear2: Any = Linear.default_config()
        norm: Any = LayerNorm.default_config()
        activation: Any = "nn.relu"
        structure: str = "prenorm"


class BaseTransformerLayer(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED


class TransformerLayer(BaseTransformerLayer):
    @config_class
    class Config(BaseTransformerLayer.Config):
        self_attention: Any = TransformerAttentionLayer.default_config()
        feed_forward: Any = TransformerFeedForwardLayer.default_config()


class BaseStackedTransformerLayer(BaseTransformerLayer):
    @config_class
    class Config(BaseTransformerLayer.Config):
        num_layers: Required[int] = REQUIRED
        layer: Any = TransformerLayer.default_config()


class StackedTransformerLayer(BaseStackedTransformerLayer):
    pass


class RepeatedTransformerLayer(BaseStackedTransformerLayer):
    @config_class
    class Config(BaseStackedTransformerLayer.Config):
        repeat: Optional[Any] = None


class PipelinedTransformerLayer(BaseStackedTransformerLayer):
    @config_class
    class Config(BaseStackedTransformerLayer.Config):
        num_stages: Required[int] = REQUIRED


class RematRegexSavePatterns(enum.Enum):
    """Values as in attention.py:4574 (34aed43c)."""

    QKV_PROJ = r".*[kqv]_proj"
    O_PROJ = r".*o_proj"
    CONTEXT = r".*context"
    LINEAR1_X = r".*linear1_[01]"
    NATIVE_ATTENTION = ".*([qkvo]_proj|context)"
    INPUT = r".*input"
