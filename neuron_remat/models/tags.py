"""Tag vocabularies: what a host library calls each checkpointed value of a layer
(`TagNames`; axlearn's and MaxText's, and what each emits on a Neuron device)."""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from ..device import DeviceSpec

ROLES = ("input", "q_proj", "k_proj", "v_proj", "context", "o_proj",
         "linear1_0", "linear1_1", "linear2")
MOE_ROLES = ("gate_weights", "gate_assignment", "moe_linear1_0", "moe_linear1_1", "moe_linear2")
"""Roles of a mixture-of-experts feed-forward block: the router's top-k weights and expert
indices, and the routed experts' two input projections and output projection (shared
experts are a dense feed-forward block beside them and use the dense roles)."""
MLA_ROLES = ("q_a", "q_a_norm", "kv_a", "kv_a_norm")
"""Roles of a multi-head latent attention block besides the dense ones: the low-rank query
projection and its normalised value, and the joint key-value latent (with the shared RoPE
key) and its normalised main part."""
_ALL_ROLES = ROLES + MOE_ROLES + MLA_ROLES


@dataclass(frozen=True)
class TagNames:
    """What a host library calls each checkpointed value of a layer.

    `prefixed` says the host adds a class prefix (axlearn tags ``MultiheadAttention.q_proj``),
    so patterns match the name after any ``Class.`` prefix. A role set to None is not
    emitted by the host.
    """

    vocabulary: str = "axlearn"
    input: str | None = "input"
    q_proj: str | None = "q_proj"
    k_proj: str | None = "k_proj"
    v_proj: str | None = "v_proj"
    context: str | None = "context"
    o_proj: str | None = "o_proj"
    linear1_0: str | None = "linear1_0"
    linear1_1: str | None = "linear1_1"
    linear1_ungated: str | None = "linear1_0"
    linear2: str | None = "linear2"
    flash_context: str | None = "flash_residuals"
    prefixed: bool = True
    # Mixture of experts (MOE_ROLES) and latent attention (MLA_ROLES).
    gate_weights: str | None = "gate_weights"
    gate_assignment: str | None = "gate_assignment"
    moe_linear1_0: str | None = None
    moe_linear1_1: str | None = None
    moe_linear2: str | None = None
    q_a: str | None = "q_a_proj"
    q_a_norm: str | None = "q_a_norm"
    kv_a: str | None = "kv_a_proj"
    kv_a_norm: str | None = "kv_a_norm"
    aliases: tuple[tuple[str, str], ...] = ()
    """(role, name): a second name the host tags the same value with; saving either keeps it."""
    others: tuple[str, ...] = ()
    """Names the host emits that no role models (MaxText's ``moe_x_sorted``): known, so
    that an adapter does not warn about them, and never planned (recomputed)."""

    def knows(self, tag: str) -> bool:
        """Whether the host emits `tag` under this vocabulary: a role's name (gated or not,
        the flash kernels' context or not), an alias or one of `others`; after any class
        prefix where the host adds one (as the policy's patterns match it)."""
        names = _names(self)
        return tag in names or (self.prefixed and any(tag.endswith(n) for n in names))

    def name(self, role: str, *, gated: bool = True, flash: bool = False) -> str | None:
        if role not in _ALL_ROLES:
            raise ValueError(f"unknown tag role {role!r}; valid: {', '.join(_ALL_ROLES)}")
        if role == "linear1_0" and not gated:
            return self.linear1_ungated
        if role == "context" and flash:
            return self.flash_context
        return getattr(self, role)

    def pattern(self, role: str, *, gated: bool = True, flash: bool = False) -> str | None:
        """The regex that matches this role's tag (after any prefix, as axlearn's
        ``.*q_proj`` does)."""
        name = self.name(role, gated=gated, flash=flash)
        if name is None:
            return None
        return (".*" if self.prefixed else "") + re.escape(name)


@functools.lru_cache(maxsize=32)
def _names(tags: TagNames) -> frozenset[str]:
    """Every name `tags` gives (`TagNames.knows`)."""
    names = {getattr(tags, f.name) for f in dataclasses.fields(tags)
             if f.name != "vocabulary" and isinstance(getattr(tags, f.name), str)}
    return frozenset(names | {n for _, n in tags.aliases} | set(tags.others))


AXLEARN_TAGS = TagNames()
"""axlearn's names (``BaseLayer._remat_name``: ``f"{type(self).__name__}.{name}"``); its
GPU and TPU flash-attention kernels tag their residuals ``flash_residuals`` (not the Neuron
kernel: see `AXLEARN_NEURON_TAGS`).

Mixture of experts: at apple/axlearn 34aed43c1b6e581c4753d06d7cbeedd5010ef26b,
``axlearn/common/mixture_of_experts.py`` tags only the router's top-k output
(``TopKGating.gate_weights`` and ``.gate_assignment``, in ``BaseGating._top_k``); the expert
einsums (``wi_0``, ``wi_1``, ``wo``) carry no remat name, so under any names policy they are
recomputed. axlearn has no latent-attention layer at that commit: the MLA names here
(``q_a_proj``, ``q_a_norm``, ``kv_a_proj``, ``kv_a_norm``: Hugging Face DeepSeek's module
names) are for a host layer written in its style."""

AXLEARN_NEURON_TAGS = TagNames(vocabulary="axlearn-neuron", flash_context=None)
"""What axlearn's layer emits on a Neuron device (apple/axlearn 34aed43c): its
``FlashAttention`` layer hands attention to the NKI kernel
(``flash_attention/neuron_attention.py``, a ``custom_vjp`` with no ``checkpoint_name``) and
does not tag ``context`` (``flash_attention/layer.py`` ``_compute_attention``); only the GPU
and TPU kernels tag ``flash_residuals``. So under any names policy the kernel's forward is
recomputed in the backward. Native attention (``MultiheadAttention``,
``GroupedQueryAttention``) still tags ``context``."""


MAXTEXT_TAGS = TagNames(
    vocabulary="maxtext", input="decoder_layer_input", q_proj="query_proj",
    k_proj="key_proj", v_proj="value_proj", context="attention_out", o_proj="out_proj",
    linear1_0="mlpwi_0", linear1_1="mlpwi_1", linear1_ungated="mlpwi", linear2="mlpwo",
    flash_context="context", prefixed=False,
    gate_weights=None, gate_assignment=None, moe_linear1_0="moe_mlpwi_0",
    moe_linear1_1="moe_mlpwi_1", moe_linear2="moe_mlpwo", q_a="query_wa_proj",
    q_a_norm="mla_q", kv_a="kv_wa_proj", kv_a_norm="mla_kv",
    aliases=(("moe_linear1_0", "mlpwi_0"), ("moe_linear2", "mlpwo")),
    others=("moe_x_sorted", "moe_routing_maps", "mlpwi", "kv_proj", "qkv_proj",
            "indexer_cutoff_threshold", "engram"),
)
"""MaxText's names (``layers/attentions.py``, ``layers/linears.py``, ``decoders.py``): the
attention output before the output projection is ``attention_out``; ``context`` is the
flash kernels' output and log-sum-exp (cuDNN and TPU splash paths only).

Mixture of experts and MLA, from AI-Hypercomputer/maxtext
e591f30cbbf217ed67ef71263ec0538239f9c3b8: ``layers/moe.py``'s sparse (grouped-matmul) path
tags the routed experts ``moe_mlpwi_0`` (also named ``mlpwi_0``), ``moe_mlpwi_1`` and
``moe_mlpwo`` (also named ``mlpwo``), so a dense ``mlpwi_0`` or ``mlpwo`` in a policy saves
the routed value too; shared experts are a dense ``MlpBlock`` (``mlpwi_0``, ``mlpwi_1``,
``mlpwo``); the router is not tagged. ``layers/attention_mla.py`` tags ``query_wa_proj``
(the low-rank query), ``mla_q`` (after its norm), ``kv_wa_proj`` (the key-value latent with
the RoPE key), ``mla_kv`` (the normalised latent), then ``query_proj``, ``key_proj``,
``value_proj``, ``attention_out`` and ``out_proj``. `others`: the remat keys of MaxText
0.2.5's config that name no role here (the sorted tokens and routing maps of its sparse
MoE path, fused projections, DeepSeek's indexer and engram)."""

MAXTEXT_NEURON_TAGS = dataclasses.replace(MAXTEXT_TAGS, vocabulary="maxtext-neuron",
                                          flash_context=None)
"""What MaxText's layer emits on a Neuron device: ``context`` (the flash kernel's output and
log-sum-exp) is tagged only by its cuDNN and TPU splash attention kernels
(``layers/attention_op.py`` at AI-Hypercomputer/maxtext e591f30c), which do not run on
Neuron; every other name is tagged by the layer itself and stands."""

_NEURON_VOCABULARIES = {AXLEARN_TAGS: AXLEARN_NEURON_TAGS, MAXTEXT_TAGS: MAXTEXT_NEURON_TAGS}


def host_tags(tags: TagNames, device: DeviceSpec | None) -> TagNames:
    """The vocabulary the host really emits on `device`. On a Neuron device the GPU and TPU
    flash-attention kernels' tags are not emitted: axlearn's names become
    `AXLEARN_NEURON_TAGS` (no ``flash_residuals``) and MaxText's `MAXTEXT_NEURON_TAGS` (no
    ``context``). Anything else (a user's own `TagNames`) is returned as is."""
    if device is not None and device.is_neuron:
        return _NEURON_VOCABULARIES.get(tags, tags)
    return tags


def host_of(tags: TagNames) -> str:
    """The host a vocabulary belongs to: ``axlearn``, ``maxtext`` or the vocabulary's own
    name (``axlearn-neuron`` is axlearn's)."""
    return tags.vocabulary.split("-", 1)[0]
