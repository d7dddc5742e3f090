"""The Hugging Face ``config.json`` loader: `from_hf_config` and `load_hf_config`.

Families are read with their own keys and defaults; architectures the package does not
model (state-space, encoder-decoder, multimodal towers) are refused with a one-line error
naming the key and the file."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from .config import (_ROUTERS, ContextLimits, LayerDetails, MLAConfig, MoEConfig,
                     TransformerConfig)

logger = logging.getLogger(__name__)

_NOT_MODELLED = ("neuron-remat does not model it, and will not plan it as a dense model: "
                 "measure the real layer with traced_footprint(fn, *args), or check the "
                 "compiled step with fit")
_SSM_TYPES = {"mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba",
              "recurrent_gemma", "rwkv", "falcon_h1", "nemotron_h", "granitemoehybrid", "lfm2"}
_ENC_DEC_TYPES = {"t5", "mt5", "umt5", "bart", "mbart", "whisper", "pegasus", "marian",
                  "led", "longt5", "switch_transformers", "encoder-decoder", "prophetnet"}
_SSM_KEYS = re.compile(r"ssm|mamba|state_size|conv_kernel|time_step|d_state|rnn|recurrent")
_ENC_DEC_KEYS = ("is_encoder_decoder", "encoder_layers", "num_decoder_layers",
                 "decoder_layers", "encoder_attention_heads", "d_model")
_VISION_KEYS = ("vision_config", "vision_tower", "mm_projector_type", "image_token_index",
                "image_token_id", "vision_feature_layer", "audio_config")
_STRUCTURE_KEYS = re.compile(
    r"expert|moe|router|lora_rank|nope|rope_head|v_head_dim|dense_replace|sparse_step|"
    r"mlp_only|topk|n_group|nextn|intermediate_size_mlp")
_GENERIC_KEYS = frozenset((
    "architectures", "model_type", "_name_or_path", "torch_dtype", "dtype",
    "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "use_cache", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "layer_norm_eps",
    "attention_dropout", "attention_bias", "mlp_bias", "hidden_act", "hidden_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "num_hidden_layers", "vocab_size", "pretraining_tp", "hidden_dropout", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "output_attentions",
    "output_hidden_states", "return_dict", "quantization_config", "auto_map"))
_FAMILIES: dict[str, dict[str, Any]] = {
    # model_type: defaults as each family's transformers config class sets them.
    "llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True},
    "gemma": {"tie": True, "act": "gelu_pytorch_tanh"},
    "gemma2": {"tie": True, "act": "gelu_pytorch_tanh", "sandwich_norm": True},
    "gemma3_text": {"tie": True, "act": "gelu_pytorch_tanh", "sandwich_norm": True,
                    "qk_norm": True},
    "mixtral": {"moe": "mixtral"}, "qwen2_moe": {"moe": "qwen2_moe", "qkv_bias": True},
    "qwen3_moe": {"moe": "qwen3_moe", "qk_norm": True},
    "deepseek_v2": {"moe": "deepseek", "mla": True},
    "deepseek_v3": {"moe": "deepseek", "mla": True},
    "llama4_text": {"moe": "llama4"},
    # OLMo 2: q/k RMS norms over the whole projection (not per head) and its two norms
    # after attention and the FFN instead of before: the same norms and bytes as qk_norm on
    # a Llama layer; parameters differ by (heads + kv_heads - 2) x head_dim per layer.
    "olmo2": {"qk_norm": True},
    # Phi-3 (and Phi-3.5, Phi-4, which keep model_type phi3): a Llama layer whose q/k/v and
    # gate/up projections are fused into one matmul each (the same values and bytes); its
    # sliding window, where set, is on every layer; its extra keys (resid_pdrop,
    # embd_pdrop, original_max_position_embeddings) change no layer shape.
    "phi3": {},
}
# The values transformers' config classes give fields a config.json may leave out (each
# class's __init__ defaults, same commit as below), where the loader's own fallback would
# differ: a Gemma head is 256 wide whatever hidden / heads is; Gemma 3's text config is
# often written with only what differs from its class; DeepSeek-V3's MoE differs from V2's.
# They fill a key only when it is absent (an explicit null keeps its meaning: DeepSeek's
# q_lora_rank null is no query compression).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"head_dim": 256}, "gemma2": {"head_dim": 256},
    "gemma3_text": {"head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "vocab_size": 262208},
    "deepseek_v2": {"n_shared_experts": 2, "q_lora_rank": 1536},
    "deepseek_v3": {"first_k_dense_replace": 3, "n_shared_experts": 1, "q_lora_rank": 1536,
                    "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    "qwen2_moe": {"shared_expert_intermediate_size": 5632},
    "llama4_text": {"intermediate_size_mlp": 16384},
}
# The other spellings transformers' config classes accept for a field the loader reads
# (each class's ``attribute_map``: either key sets the same attribute, and a config.json
# written by transformers may carry either). huggingface/transformers commit
# 008e574391258935f3ecc3035c882e73bbcac419, src/transformers/models/*/configuration_*.py;
# the base PreTrainedConfig's map is empty and the dense families here add none.
_SPELLINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "mixtral": {"num_local_experts": ("num_experts",)},
    "qwen3_moe": {"num_experts": ("num_local_experts",)},
    "deepseek_v2": {"n_routed_experts": ("num_experts",)},
    "deepseek_v3": {"n_routed_experts": ("num_local_experts",)},
}
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu",
                   "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                   "gelu_fast": "gelu_tanh", "gelu_python": "gelu", "relu": "relu"}
_MAX_SIZE = 1 << 31  # no published model comes near; bounds every loop and product
_REQUIRED = object()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """Typed reads of a config.json dict; every error names the key, the file and what
    is valid."""

    def __init__(self, cfg: Mapping[str, Any], source: str,
                 spellings: Mapping[str, tuple[str, ...]] | None = None) -> None:
        self.source = source
        self.cfg = _respell(cfg, spellings or {}, source)

    def _fail(self, key: str, value: Any, valid: str) -> ValueError:
        return ValueError(f"{self.source}: {key}={_short(value)} is not valid; {valid}")

    def int(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        if key not in self.cfg or (self.cfg[key] is None and default is not _REQUIRED):
            if default is _REQUIRED:
                raise ValueError(f"{self.source}: lacks {key} (an integer >= {minimum})")
            return default
        value = self.cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or \
                not minimum <= value < _MAX_SIZE:
            raise self._fail(key, value, f"give an integer from {minimum} to {_MAX_SIZE - 1}"
                             " (a JSON number, not a string or float)")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, value, "give true or false (a JSON boolean, not a string)")
        return value

    def str(self, key: str, default: str | None = None) -> str | None:
        value = self.cfg.get(key)
        if value is None:
            return default
        if value is not None and not isinstance(value, str):
            raise self._fail(key, value, "give a string")
        return value

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.cfg.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not 0 < value < 1e6:
            raise self._fail(key, value, "give a number > 0")
        return float(value)

    def int_list(self, key: str) -> list[int]:
        value = self.cfg.get(key) or []
        if not isinstance(value, list) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < _MAX_SIZE
                for i in value):
            raise self._fail(key, value, "give a list of layer indices")
        return value


def _respell(cfg: Mapping[str, Any], spellings: Mapping[str, tuple[str, ...]],
             source: str) -> Mapping[str, Any]:
    """`cfg` with each field under the key the loader reads, whichever of transformers'
    spellings it was written with; two spellings with different values are an error."""
    out = dict(cfg)
    for key, others in spellings.items():
        given = [(k, cfg[k]) for k in (key, *others) if cfg.get(k) is not None]
        if len({json.dumps(v, sort_keys=True, default=repr) for _, v in given}) > 1:
            shown = ", ".join(f"{k}={_short(v)}" for k, v in given)
            raise ValueError(f"{source}: {shown} are one setting spelled two ways, with "
                             "different values; keep one")
        if given:
            out[key] = given[0][1]
    return out


def _refuse(source: str, what: str) -> ValueError:
    return ValueError(f"{source}: {what}; {_NOT_MODELLED}")


def _check_modelled(cfg: Mapping[str, Any], source: str, model_type: str,
                    text_only: bool) -> Mapping[str, Any] | None:
    """Refuse architectures this package does not model. Returns the text model's config
    when `text_only` picks it out of a multimodal one."""
    if model_type in _SSM_TYPES or any(_SSM_KEYS.search(k) for k in cfg):
        keys = sorted(k for k in cfg if _SSM_KEYS.search(k))
        return _raise(_refuse(source, f"model_type {model_type!r} is a state-space (Mamba/"
                              f"SSM) or recurrent model (keys {keys[:4]})"))
    if model_type in _ENC_DEC_TYPES or cfg.get("is_encoder_decoder") is True or any(
            k in cfg for k in _ENC_DEC_KEYS[1:]):
        return _raise(_refuse(source, f"model_type {model_type!r} is an encoder-decoder model"))
    vision = [k for k in _VISION_KEYS if k in cfg]
    if vision or "text_config" in cfg:
        text = cfg.get("text_config")
        if text_only and isinstance(text, Mapping):
            return text
        what = (f"model_type {model_type!r} has a vision or audio tower ({', '.join(vision)})"
                if vision else f"model_type {model_type!r} nests its model in text_config")
        hint = (" (to plan its text decoder alone: --text-only on the command line, "
                "text_only=True in Python)" if isinstance(text, Mapping) else "")
        return _raise(_refuse(source, what + hint))
    if text_only:
        raise ValueError(f"{source}: text_only (--text-only) applies to a multimodal config "
                         f"with a text_config; model_type {model_type or '(none)'!r} is "
                         "text only already: drop it")
    return None


def _raise(err: Exception) -> Any:
    raise err


def _hf_moe(f: _Fields, kind: str, layers: int) -> MoEConfig:
    cap = f.number("capacity_factor")
    if kind == "mixtral":
        return MoEConfig(experts=f.int("num_local_experts"),
                         experts_per_token=f.int("num_experts_per_tok"),
                         expert_ffn=f.int("intermediate_size"), capacity_factor=cap)
    if kind in ("qwen2_moe", "qwen3_moe"):
        step = f.int("decoder_sparse_step", 1)
        only = set(f.int_list("mlp_only_layers"))
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
        shared = f.int("shared_expert_intermediate_size", 0, minimum=0) \
            if kind == "qwen2_moe" else 0
        return MoEConfig(experts=f.int("num_experts"),
                         experts_per_token=f.int("num_experts_per_tok"),
                         expert_ffn=f.int("moe_intermediate_size"), shared_ffn=shared,
                         dense_layers=dense, capacity_factor=cap, shared_gate=shared > 0)
    if kind == "deepseek":
        first = f.int("first_k_dense_replace", 0, minimum=0)
        freq = f.int("moe_layer_freq", 1)
        scoring = f.str("scoring_func", "softmax")
        if scoring not in _ROUTERS:
            raise f._fail("scoring_func", scoring, f"valid: {', '.join(_ROUTERS)}")
        assert scoring is not None
        width = f.int("moe_intermediate_size")
        return MoEConfig(experts=f.int("n_routed_experts"),
                         experts_per_token=f.int("num_experts_per_tok"), expert_ffn=width,
                         shared_ffn=f.int("n_shared_experts", 0, minimum=0) * width,
                         dense_layers=tuple(i for i in range(layers) if i < first or i % freq),
                         capacity_factor=cap, router=scoring,
                         router_bias=f.str("topk_method", "greedy") == "noaux_tc")
    assert kind == "llama4"
    step = f.int("interleave_moe_layer_step", 1)
    moe_layers = set(f.int_list("moe_layers")) if f.cfg.get("moe_layers") is not None \
        else set(range(step - 1, layers, step))
    width = f.int("intermediate_size")
    return MoEConfig(experts=f.int("num_local_experts"),
                     experts_per_token=f.int("num_experts_per_tok"), expert_ffn=width,
                     shared_ffn=width,
                     dense_layers=tuple(i for i in range(layers) if i not in moe_layers),
                     capacity_factor=cap, router="sigmoid")


def from_hf_config(cfg: Mapping[str, Any], *, name: str | None = None,
                   source: str = "config.json", text_only: bool = False,
                   **overrides: Any) -> TransformerConfig:
    """A `TransformerConfig` from a Hugging Face ``config.json`` dict.

    Families read with their own keys and defaults (activation, tied embeddings, norms,
    biases): ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``,
    ``gemma3_text``, ``olmo2``, ``phi3``; mixture of experts ``mixtral``, ``qwen2_moe``,
    ``qwen3_moe``, ``llama4_text``; latent attention and experts ``deepseek_v2``,
    ``deepseek_v3``. Another
    ``model_type`` is read as a Llama-like dense model only when it has no key outside the
    generic ones. State-space, encoder-decoder and multimodal models are refused (a
    multimodal one's text decoder is planned with ``text_only=True``); so is any key naming
    a structure (experts, latent ranks) the family does not have. Every value is
    type-checked: an error names the key, `source` and what is valid.

    ``config.json`` does not say which attention kernel training uses; like the built-in
    models this assumes a flash-attention kernel (``flash_attention=False`` for plain
    attention). Nor does it give the training sequence length, so plans need an explicit
    `StepShape`.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{source}: holds {_short(cfg)}, not a JSON object of model settings")
    try:
        return _from_hf_config(cfg, name, source, text_only, overrides)
    except ValueError as err:
        text = str(err)
        raise ValueError(text if text.startswith(source) else f"{source}: {text}") from None


def _from_hf_config(cfg: Mapping[str, Any], name: str | None, source: str, text_only: bool,
                    overrides: dict[str, Any]) -> TransformerConfig:
    model_type = _Fields(cfg, source).str("model_type", "") or ""
    f = _Fields({**_DEFAULTS.get(model_type, {}), **cfg}, source, _SPELLINGS.get(model_type))
    text = _check_modelled(cfg, source, model_type, text_only)
    if text is not None:
        return from_hf_config(text, name=name or f.str("_name_or_path"),
                              source=f"{source} text_config", **overrides)
    family = _FAMILIES.get(model_type)
    if family is None:
        unknown = sorted(k for k in cfg if k not in _GENERIC_KEYS)
        if unknown:
            shown = ", ".join(unknown[:6]) + (", ..." if len(unknown) > 6 else "")
            raise _refuse(source, f"model_type {model_type or '(none)'!r} is not a known "
                          f"family and has keys it does not know ({shown}); known families: "
                          f"{', '.join(_FAMILIES)}")
        family = {}
    structural = sorted(k for k in cfg if _STRUCTURE_KEYS.search(k))
    if structural and "moe" not in family and not family.get("mla"):
        raise _refuse(source, f"model_type {model_type!r} is dense, but the config has "
                      f"{', '.join(structural[:4])}")
    layers = f.int("num_hidden_layers")
    act_key = "hidden_activation" if model_type.startswith("gemma") and \
        cfg.get("hidden_activation") is not None else "hidden_act"
    act_name = f.str(act_key, family.get("act", "silu"))
    if act_name not in _HF_ACTIVATIONS:
        raise f._fail(act_key, act_name, f"valid: {', '.join(_HF_ACTIVATIONS)}")
    assert act_name is not None
    mla = None
    if family.get("mla"):
        mla = MLAConfig(kv_lora_rank=f.int("kv_lora_rank"),
                        qk_nope_head_dim=f.int("qk_nope_head_dim"),
                        qk_rope_head_dim=f.int("qk_rope_head_dim"),
                        v_head_dim=f.int("v_head_dim"),
                        q_lora_rank=f.int("q_lora_rank", 0, minimum=0))
    moe = _hf_moe(f, family["moe"], layers) if "moe" in family else None
    ffn_key = "intermediate_size_mlp" if family.get("moe") == "llama4" else "intermediate_size"
    kw: dict[str, Any] = dict(
        hidden=f.int("hidden_size"), heads=f.int("num_attention_heads"),
        kv_heads=f.int("num_key_value_heads", None), head_dim=f.int("head_dim", None),
        ffn=f.int(ffn_key), layers=layers, vocab=f.int("vocab_size"),
        tie_embeddings=f.bool("tie_word_embeddings", family.get("tie", False)),
        activation=_HF_ACTIVATIONS[act_name],
        name=name or f.str("_name_or_path") or model_type or "hf-model",
        source=source, flash_attention=True, moe=moe, mla=mla,
        details=LayerDetails(qkv_bias=f.bool("attention_bias", family.get("qkv_bias", False)),
                             qk_norm=family.get("qk_norm", False),
                             sandwich_norm=family.get("sandwich_norm", False)),
        limits=_hf_limits(f, layers, model_type),
    )
    if mla is not None:
        kw["head_dim"] = None  # MLA's per-head q/k width is nope + rope
    kw.update(overrides)
    config = TransformerConfig(**kw)
    if model_type not in _FAMILIES:  # said once the config is valid, not before its error
        _warn_once_per_type(model_type, source)
    _warn_dropout(cfg, source)
    return config


_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop")


def _warn_dropout(cfg: Mapping[str, Any], source: str) -> None:
    """The layer model has no dropout: a config that trains with it keeps a mask (and
    an output) per dropout more than the plan counts. Said once per file and setting."""
    on = [f"{k}={cfg[k]}" for k in _DROPOUT_KEYS if isinstance(cfg.get(k), (int, float))
          and not isinstance(cfg.get(k), bool) and cfg[k] > 0]
    said = (source, str(cfg.get("_name_or_path")), *on)  # dicts share config.json's name
    if not on or said in _WARNED_DROPOUT:
        return
    _WARNED_DROPOUT.add(said)
    logger.warning("%s: %s: the layer model has no dropout, so the plan does not count "
                   "dropout's masks and outputs; train without it, or check the step with "
                   "fit", source, ", ".join(on))


_WARNED_DROPOUT: set[tuple[str, ...]] = set()


_WARNED_TYPES: set[str] = set()


def _warn_once_per_type(model_type: str, source: str) -> None:
    if model_type in _WARNED_TYPES:
        return
    _WARNED_TYPES.add(model_type)
    logger.warning("%s: model_type %r is not a family neuron_remat knows (%s); it is planned "
                   "as a Llama-like dense layer (norms before attention and FFN, no q/k "
                   "norms); if its layer differs, measure it with traced_footprint", source,
                   model_type or "(none)", ", ".join(_FAMILIES))


def _hf_limits(f: _Fields, layers: int, model_type: str) -> ContextLimits:
    """max_position_embeddings, and the sliding window where the config turns it on
    (Qwen's ``use_sliding_window``; Gemma's and Qwen2-MoE's ``layer_types``)."""
    out: dict[str, Any] = {"max_positions": f.int("max_position_embeddings", None)}
    window = f.int("sliding_window", None, minimum=0) or None
    if window is not None and f.bool("use_sliding_window", True):
        kinds = f.cfg.get("layer_types")
        count = None
        if isinstance(kinds, list) and all(isinstance(k, str) for k in kinds):
            count = sum(k == "sliding_attention" for k in kinds)
            window = window if count else None
        elif model_type == "gemma2":  # transformers' default: every other layer, from 0
            count = (layers + 1) // 2
        elif model_type == "gemma3_text":  # all but every `sliding_window_pattern`-th
            count = layers - layers // f.int("sliding_window_pattern", 6)
        out.update(sliding_window=window, sliding_layers=count if window else None)
    return ContextLimits(**out)

def load_hf_config(path: str | os.PathLike[str], *, name: str | None = None,
                   text_only: bool = False, **overrides: Any) -> TransformerConfig:
    """Read a Hugging Face ``config.json`` file (see `from_hf_config`). A missing, empty
    or non-JSON file is a one-line error naming it."""
    where = os.fspath(path)
    if not os.path.exists(where):
        raise ValueError(f"config file {where!r}: no such file; give a config.json path")
    if os.path.isdir(where):
        inner = os.path.join(where, "config.json")
        if not os.path.isfile(inner):
            raise ValueError(f"{where!r} is a directory without a config.json")
        where = inner
    if not os.path.isfile(where):
        raise ValueError(f"config file {where!r} is not a regular file; give a config.json")
    try:
        with open(where, "rb") as fh:
            raw = fh.read(16 << 20)
    except OSError as err:
        raise ValueError(f"config file {where!r} cannot be read: {err.strerror}") from None
    if len(raw) >= 16 << 20:
        raise ValueError(f"config file {where!r} is over 16 MiB: not a config.json")
    if not raw.strip():
        raise ValueError(f"config file {where!r} is empty; expected a Hugging Face "
                         "config.json (a JSON object)")
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"config file {where!r} is not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"config file {where!r} nests JSON too deeply to be a config.json") \
            from None
    except ValueError as err:
        raise ValueError(f"config file {where!r} is not JSON: {err.msg} at line "
                         f"{err.lineno} column {err.colno}") from None  # type: ignore[attr-defined]
    if name is None:
        base = os.path.basename(where)
        name = os.path.basename(os.path.dirname(os.path.abspath(where))) \
            if base == "config.json" else base
    return from_hf_config(cfg, name=name, source=where, text_only=text_only, **overrides)
