"""The small reference layer several test files share: GQA (4 query heads over 2 KV heads),
a gated feed-forward, axlearn-style tags (MultiheadAttention.q_proj, ...,
TransformerFeedForwardLayer.linear1_0, ...)."""

import jax

from neuron_remat import models
import reference as ref

CFG = models.TransformerConfig(hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, vocab=50,
                               name="test-layer")
NAMES = ref.tag_names(CFG)


def make_args():
    """(x, params): a batch of 2 sequences of 8 tokens, and the layer's parameters."""
    params = ref.init_layer(jax.random.PRNGKey(0), CFG)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, CFG.hidden))
    return x, params


def layer(x, params):
    return ref.layer(x, params, CFG)
