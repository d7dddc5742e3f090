"""The built-in models (`MODELS`, `get_model`), each with the source of its figures."""

from __future__ import annotations

from typing import Any

from .config import LayerDetails, MLAConfig, MoEConfig, TransformerConfig

_AXLEARN_FUJI = ("apple/axlearn axlearn/experiments/text/gpt/fuji.py (num_layers, "
                 "hidden_dim=128*heads, scaled_hidden_dim 8/3 or 3.5 rounded to 256, "
                 "VOCAB_SIZE, MAX_SEQUENCE_LENGTH)")
_HF_LLAMA3 = "Hugging Face meta-llama/Meta-Llama-3-{} config.json"


def _model(name: str, **kw: Any) -> TransformerConfig:
    # Long-sequence training uses a flash-attention kernel; the paper's GPT-3 layer does not.
    kw.setdefault("flash_attention", True)
    return TransformerConfig(name=name, **kw)


MODELS: dict[str, TransformerConfig] = {m.name: m for m in (
    _model("fuji-7b-v1", hidden=4096, heads=32, ffn=11008, layers=32, vocab=32768,
           tie_embeddings=True, default_seq_len=2048, source=_AXLEARN_FUJI),
    _model("fuji-7b-v2", hidden=4096, heads=32, ffn=11008, layers=32, vocab=32768,
           tie_embeddings=True, default_seq_len=4096, source=_AXLEARN_FUJI),
    _model("fuji-7b-v3", hidden=4096, heads=32, kv_heads=8, ffn=11008, layers=32,
           vocab=131072, tie_embeddings=True, default_seq_len=8192, source=_AXLEARN_FUJI),
    _model("fuji-70b-v1", hidden=8192, heads=64, ffn=28672, layers=80, vocab=32768,
           default_seq_len=2048, source=_AXLEARN_FUJI),
    _model("fuji-70b-v2", hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80,
           vocab=32768, default_seq_len=4096, source=_AXLEARN_FUJI),
    _model("fuji-70b-v3", hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80,
           vocab=131072, default_seq_len=8192, source=_AXLEARN_FUJI),
    _model("llama3-8b", hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=32,
           vocab=128256, default_seq_len=8192, source=_HF_LLAMA3.format("8B")),
    _model("llama3-70b", hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80,
           vocab=128256, default_seq_len=8192, source=_HF_LLAMA3.format("70B")),
    _model("gpt3-175b", hidden=12288, heads=96, ffn=4 * 12288, layers=96, vocab=51200,
           gated_ffn=False, norm="layer", activation="gelu", default_seq_len=2048,
           flash_attention=False,
           tie_embeddings=True,
           source="Brown et al. 2020; as configured in Korthikanti et al. 2022, Table 3"),
)}
_HF = "Hugging Face {} config.json"
for _m in (
    # All-MoE: 8 experts, top-2, every layer (intermediate_size is the expert width).
    _model("mixtral-8x7b", hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=32,
           vocab=32000, default_seq_len=4096,
           moe=MoEConfig(experts=8, experts_per_token=2, expert_ffn=14336),
           source=_HF.format("mistralai/Mixtral-8x7B-v0.1") + "; 46.7B total (Mistral AI)"),
    # MLA (q_lora_rank 1536, kv_lora_rank 512, 128+64 qk, 128 v), 256 routed experts top-8
    # plus one shared, first_k_dense_replace 3 (dense width 18432), sigmoid router with
    # noaux_tc bias. The 14B multi-token-prediction module is not counted (671B, not 685B).
    _model("deepseek-v3", hidden=7168, heads=128, ffn=18432, layers=61, vocab=129280,
           default_seq_len=4096,
           mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128),
           moe=MoEConfig(experts=256, experts_per_token=8, expert_ffn=2048, shared_ffn=2048,
                         dense_layers=(0, 1, 2), router="sigmoid", router_bias=True),
           source=_HF.format("deepseek-ai/DeepSeek-V3") + "; 671B total (model card)"),
    _model("qwen3-30b-a3b", hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144,
           layers=48, vocab=151936, details=LayerDetails(qk_norm=True), default_seq_len=4096,
           moe=MoEConfig(experts=128, experts_per_token=8, expert_ffn=768),
           source=_HF.format("Qwen/Qwen3-30B-A3B") + "; 30.5B total (model card)"),
    # Text decoder only: 16 experts top-1 plus a shared expert in all 48 layers
    # (interleave_moe_layer_step 1), sigmoid router.
    _model("llama4-scout", hidden=5120, heads=40, kv_heads=8, head_dim=128, ffn=16384,
           layers=48, vocab=202048, default_seq_len=8192,
           moe=MoEConfig(experts=16, experts_per_token=1, expert_ffn=8192, shared_ffn=8192,
                         router="sigmoid"),
           source=_HF.format("meta-llama/Llama-4-Scout-17B-16E") + " text_config; 109B "
           "total with the vision encoder (model card)"),
):
    MODELS[_m.name] = _m
_ALIASES = {"fuji-7b": "fuji-7b-v3", "fuji-70b": "fuji-70b-v3", "mixtral": "mixtral-8x7b",
            "llama-4-scout": "llama4-scout"}


def get_model(name: str) -> TransformerConfig:
    """A built-in model by name (``fuji-70b`` is ``fuji-70b-v3``)."""
    if not isinstance(name, str):
        raise TypeError(f"model {name!r} ({type(name).__name__}) is not a name; give one of "
                        f"{', '.join([*MODELS, *_ALIASES])}")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; built in: {', '.join([*MODELS, *_ALIASES])}; or load a "
            "Hugging Face config.json (from_hf_config, or --model path/to/config.json)")
    return MODELS[key]
