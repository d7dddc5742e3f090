"""Hugging Face config.json loading: exact parameter counts per family, refusal of what is
not modelled, and typed validation of every field (with hypothesis properties)."""

import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import neuron_remat as nr
from neuron_remat import models
from neuron_remat.cli import main

DATA = pathlib.Path(__file__).parent / "data"

# Published totals (tests/cpu/data/SOURCES.md says where each comes from).
PUBLISHED = {
    "mixtral-8x7b.json": 46.7e9, "qwen3-30b-a3b.json": 30.5e9,
    "qwen1.5-moe-a2.7b.json": 14.3e9, "deepseek-v2-lite.json": 15.7e9,
    "deepseek-v3.json": 671e9, "gemma-2-9b.json": 9.24e9, "gemma-3-1b.json": 1.0e9,
    "llama-3-8b.json": 8.03e9, "mistral-7b.json": 7.24e9, "qwen2.5-7b.json": 7.61e9,
    "phi-3-mini-4k.json": 3.82e9,
}
ACTIVE = {"mixtral-8x7b.json": 12.9e9, "qwen3-30b-a3b.json": 3.3e9,
          "deepseek-v3.json": 37e9}  # V2-Lite's 2.4B counts embeddings differently


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_param_count_within_half_a_percent_of_published(name):
    cfg = models.load_hf_config(DATA / name)
    assert cfg.param_count() == pytest.approx(PUBLISHED[name], rel=0.005)
    if name in ACTIVE:  # active counts are published to two figures
        assert cfg.active_param_count() == pytest.approx(ACTIVE[name], rel=0.05)


def test_llama4_scout_text_decoder():
    path = DATA / "llama4-scout.json"
    with pytest.raises(ValueError, match="vision or audio tower.*text_only=True"):
        models.load_hf_config(path)
    cfg = models.load_hf_config(path, text_only=True)
    # 109B on the model card includes the vision encoder; the text decoder is ~107.8B.
    assert 107.0e9 < cfg.param_count() < 109.0e9
    assert cfg.param_count() == nr.get_model("llama4-scout").param_count()
    assert cfg.active_param_count() == pytest.approx(17e9, rel=0.02)
    assert cfg.moe.experts == 16 and cfg.moe.shared_ffn == 8192 and not cfg.moe.dense_layers


def test_families_are_read_with_their_own_structure():
    ds = models.load_hf_config(DATA / "deepseek-v2-lite.json")
    assert ds.mla.q_lora_rank == 0 and ds.mla.kv_lora_rank == 512 and ds.head_dim == 192
    assert ds.moe.dense_layers == (0,) and ds.moe.shared_ffn == 2 * 1408
    assert ds.layer_kinds() == {"dense": 1, "moe": 26}
    v3 = models.load_hf_config(DATA / "deepseek-v3.json")
    assert v3.moe.router == "sigmoid" and v3.moe.router_bias and v3.moe.dense_layers == (0, 1, 2)
    assert v3.param_count() == nr.get_model("deepseek-v3").param_count()
    gemma = models.load_hf_config(DATA / "gemma-2-9b.json")
    assert gemma.tie_embeddings and gemma.activation == "gelu_tanh" and gemma.sandwich_norm
    qwen = models.load_hf_config(DATA / "qwen2.5-7b.json")
    assert qwen.qkv_bias and not qwen.tie_embeddings
    q15 = models.load_hf_config(DATA / "qwen1.5-moe-a2.7b.json")
    assert q15.moe.shared_gate and q15.moe.shared_ffn == 5632
    assert models.load_hf_config(DATA / "mixtral-8x7b.json").param_count() == \
        nr.get_model("mixtral-8x7b").param_count()
    assert models.load_hf_config(DATA / "qwen3-30b-a3b.json").param_count() == \
        nr.get_model("qwen3-30b-a3b").param_count()


BASE = json.loads((DATA / "llama-3-8b.json").read_text())


@pytest.mark.parametrize("cfg, words", [
    ({"model_type": "mamba", "hidden_size": 768, "state_size": 16, "num_hidden_layers": 24,
      "vocab_size": 50280}, ["state-space", "traced_footprint", "fit"]),
    ({**BASE, "model_type": "jamba", "mamba_d_state": 16}, ["'jamba'", "state-space"]),
    ({"model_type": "t5", "d_model": 512, "num_layers": 6, "is_encoder_decoder": True},
     ["encoder-decoder", "traced_footprint"]),
    ({"model_type": "llava", "vision_config": {}, "text_config": dict(BASE)},
     ["vision", "text_only=True"]),
    ({**BASE, "model_type": "falcon7", "multi_query": True, "parallel_attn": True},
     ["'falcon7'", "multi_query", "parallel_attn", "traced_footprint"]),
    ({**BASE, "num_local_experts": 8}, ["'llama' is dense", "num_local_experts"]),
    ({**BASE, "hidden_act": "swiglu_fancy"}, ["hidden_act='swiglu_fancy'", "gelu_pytorch_tanh"]),
])
def test_unmodelled_architectures_are_refused(cfg, words):
    with pytest.raises(ValueError) as err:
        models.from_hf_config(cfg, source="x/config.json")
    text = str(err.value)
    assert "\n" not in text and "x/config.json" in text
    for word in words:
        assert word in text


def test_unknown_family_with_only_generic_keys_is_llama_like():
    cfg = models.from_hf_config({**BASE, "model_type": "my_llama"})
    assert cfg.param_count() == nr.get_model("llama3-8b").param_count()


def test_relu_and_tied_embeddings_are_read_not_assumed():
    assert models.from_hf_config({**BASE, "hidden_act": "relu"}).activation == "relu"
    assert models.from_hf_config({**BASE, "tie_word_embeddings": True}).tie_embeddings
    with pytest.raises(ValueError, match="tie_word_embeddings='false'.*true or false"):
        models.from_hf_config({**BASE, "tie_word_embeddings": "false"})


@pytest.mark.parametrize("content, words", [
    (b"", ["is empty"]),
    (b"{not json", ["is not JSON", "line 1"]),
    (b"null", ["holds None", "JSON object"]),
    (b"[1, 2]", ["not a JSON object"]),
    (b"\xff\xfe", ["not UTF-8"]),
    (json.dumps({**BASE, "num_attention_heads": 0}).encode(), ["num_attention_heads=0"]),
    (json.dumps({**BASE, "num_attention_heads": 1000000007}).encode(), ["not divisible"]),
    (json.dumps({**BASE, "hidden_size": "4096"}).encode(), ["hidden_size='4096'", "string"]),
    (json.dumps({**BASE, "hidden_size": 4096.0}).encode(), ["hidden_size=4096.0"]),
    (json.dumps({**BASE, "hidden_size": "\u0664\u0660\u0669\u0666"}).encode(), ["hidden_size="]),
    (json.dumps({**BASE, "num_hidden_layers": True}).encode(), ["num_hidden_layers=True"]),
])
def test_bad_files_are_one_line_errors_naming_the_file(tmp_path, content, words):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        models.load_hf_config(path)
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    for word in words:
        assert word in text


def test_cli_names_a_missing_file_and_never_shows_a_traceback(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**BASE, "num_attention_heads": 0}))
    assert main(["plan", "--model", str(bad), "--seq-len", "128", "--json"]) == 2
    assert "num_attention_heads=0" in json.loads(capsys.readouterr().out)["error"]
    assert main(["plan", "--model", str(DATA / "deepseek-v2-lite.json"), "--seq-len", "4096",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"]["state_bytes"] > 0


# --- properties ----------------------------------------------------------------------------

INT_KEYS = ["hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "num_hidden_layers", "vocab_size", "head_dim"]
NOT_INT = st.one_of(st.text(max_size=12), st.floats(allow_nan=True), st.booleans(),
                    st.lists(st.integers(), max_size=3), st.integers(max_value=0),
                    st.integers(min_value=1 << 31, max_value=1 << 70),
                    st.text(alphabet="\u0660\u0661\u0662\u06f3\u0967\uff14", min_size=1, max_size=6))


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(INT_KEYS), value=NOT_INT)
def test_any_non_integer_in_an_int_field_is_an_error_naming_it(key, value):
    if key in ("num_key_value_heads", "head_dim") and value is None:
        return
    with pytest.raises(ValueError) as err:
        models.from_hf_config({**BASE, key: value}, source="f/config.json")
    text = str(err.value)
    assert key in text and "f/config.json" in text and "\n" not in text


@settings(max_examples=200, deadline=None)
@given(heads=st.integers(1, 64), per_head=st.integers(1, 64), kv_div=st.integers(1, 8),
       ffn=st.integers(1, 10**5), layers=st.integers(1, 200), vocab=st.integers(1, 10**6),
       tie=st.booleans())
def test_valid_integer_fields_load_and_count_exactly(heads, per_head, kv_div, ffn, layers,
                                                     vocab, tie):
    kv = heads // kv_div if heads % kv_div == 0 and heads // kv_div else heads
    cfg = models.from_hf_config({"model_type": "llama", "hidden_size": heads * per_head,
                                 "num_attention_heads": heads, "num_key_value_heads": kv,
                                 "intermediate_size": ffn, "num_hidden_layers": layers,
                                 "vocab_size": vocab, "tie_word_embeddings": tie})
    h = heads * per_head
    expected = layers * (h * per_head * (2 * heads + 2 * kv) + 3 * h * ffn + 2 * h) + \
        vocab * h * (1 if tie else 2) + h
    assert cfg.param_count() == expected


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.text(max_size=16), st.integers(), st.floats(), st.none()))
def test_activation_and_bool_fields_accept_only_what_is_known(value):
    known = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
             "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_python": "gelu",
             "relu": "relu"}
    if value is None or value in known:
        cfg = models.from_hf_config({**BASE, "hidden_act": value})
        assert cfg.activation == known.get(value, "silu")
    else:
        with pytest.raises(ValueError, match="hidden_act"):
            models.from_hf_config({**BASE, "hidden_act": value})
    if value is None:
        return
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        models.from_hf_config({**BASE, "tie_word_embeddings": value})


# --- transformers' spellings (attribute_map), OLMo-2, positions, multimodal hint ---------


def _qwen3_30b_a3b_by_hand():
    """Qwen3-30B-A3B's parameters, by arithmetic from its published shape."""
    hidden, layers, heads, kv, hd, experts, width, vocab = 2048, 48, 32, 4, 128, 128, 768, 151936
    attention = hidden * heads * hd * 2 + hidden * kv * hd * 2  # q, o; k, v
    per_layer = attention + 2 * hd + 2 * hidden + hidden * experts + experts * 3 * hidden * width
    return layers * per_layer + 2 * vocab * hidden + hidden  # untied embeddings, final norm


def test_a_qwen3_moe_config_written_by_transformers_loads_exactly():
    cfg = models.load_hf_config(DATA / "qwen3-30b-a3b-transformers.json")
    assert _qwen3_30b_a3b_by_hand() == 30_532_122_624
    assert cfg.param_count() == _qwen3_30b_a3b_by_hand()
    assert cfg.moe.experts == 128 and cfg.qk_norm and cfg.sliding_window is None


# (model_type, the key the loader reads, its other spellings) per transformers' attribute_map
SPELLINGS = [("mixtral", "num_local_experts", "num_experts"),
             ("qwen3_moe", "num_experts", "num_local_experts"),
             ("deepseek_v2", "n_routed_experts", "num_experts"),
             ("deepseek_v3", "n_routed_experts", "num_local_experts")]
BASE_FILES = {"mixtral": "mixtral-8x7b.json", "qwen3_moe": "qwen3-30b-a3b.json",
              "deepseek_v2": "deepseek-v2-lite.json", "deepseek_v3": "deepseek-v3.json"}


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(SPELLINGS), experts=st.integers(8, 300), both=st.booleans(),
       other=st.integers(2, 300))
def test_every_transformers_spelling_of_a_field_reads_the_same(case, experts, both, other):
    model_type, key, alias = case
    base = json.loads((DATA / BASE_FILES[model_type]).read_text())
    base.pop(key, None)
    base.pop(alias, None)
    want = models.from_hf_config({**base, key: experts})
    got = models.from_hf_config({**base, alias: experts})
    assert got.moe.experts == want.moe.experts == experts
    assert got.param_count() == want.param_count()
    if both:
        same = models.from_hf_config({**base, key: experts, alias: experts})
        assert same.moe.experts == experts
        if other != experts:
            with pytest.raises(ValueError) as err:
                models.from_hf_config({**base, key: experts, alias: other})
            text = str(err.value)
            assert key in text and alias in text and "\n" not in text


OLMO2_7B = {  # allenai/OLMo-2-1124-7B config.json (the keys the loader reads)
    "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 4096,
    "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
    "num_hidden_layers": 32, "vocab_size": 100352, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False,
    "hidden_act": "silu", "rope_theta": 500000}


def test_olmo2_is_read_with_its_qk_norms_not_as_plain_llama(caplog):
    cfg = models.from_hf_config(OLMO2_7B)
    assert cfg.qk_norm
    plain = models.from_hf_config({**OLMO2_7B, "model_type": "llama"})
    assert not plain.qk_norm
    # OLMo 2's q/k norms span the whole projection: 2 x 4096 per layer, not 2 x 128.
    by_hand = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096 + 2 * 4096) \
        + 2 * 100352 * 4096 + 4096
    assert abs(cfg.param_count() - by_hand) == 32 * (2 * 4096 - 2 * 128)
    assert abs(cfg.param_count() - by_hand) / by_hand < 1e-4


def test_phi3_is_a_known_family_and_dropout_is_said_once(caplog):
    path = DATA / "phi-3-mini-4k.json"
    with caplog.at_level("WARNING", logger="neuron_remat.models"):
        cfg = models.load_hf_config(path)
    assert not caplog.records  # a known family, trained without dropout
    # the fused qkv_proj and gate_up_proj hold the Llama layer's weights, counted by hand
    by_hand = 32 * (4 * 3072 * 3072 + 3 * 3072 * 8192 + 2 * 3072) + 2 * 32064 * 3072 + 3072
    assert cfg.param_count() == by_hand
    raw = json.loads(path.read_text())
    with caplog.at_level("WARNING", logger="neuron_remat.models"):
        models.from_hf_config({**raw, "resid_pdrop": 0.1}, source="phi-dropout.json")
        models.from_hf_config({**raw, "resid_pdrop": 0.1}, source="phi-dropout.json")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "resid_pdrop=0.1" in said[0] and "phi-dropout.json" in said[0]
    assert "\n" not in said[0]


def test_an_unknown_family_is_planned_as_llama_with_one_warning(caplog):
    odd = {**OLMO2_7B, "model_type": "brand_new_arch_x"}
    with caplog.at_level("WARNING", logger="neuron_remat.models"):
        models.from_hf_config(odd)
        models.from_hf_config(odd)
    warned = [r.getMessage() for r in caplog.records if "brand_new_arch_x" in r.getMessage()]
    assert len(warned) == 1 and "Llama-like" in warned[0] and "\n" not in warned[0]


def test_the_multimodal_hint_names_a_flag_the_cli_has(tmp_path, capsys):
    path = str(DATA / "llama4-scout.json")
    assert main(["plan", "--model", path, "--json"]) == 2
    err = capsys.readouterr()
    text = (err.err + err.out)
    assert "--text-only" in text and "Traceback" not in text
    rc = main(["plan", "--model", path, "--text-only", "--tp", "8", "--seq-len", "2048",
               "--device", "trn2.48xlarge", "--hosts", "4", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out)["saved_tags"] is not None
    assert main(["plan", "--model", "llama3-8b", "--text-only"]) == 2
    assert "--text-only" in capsys.readouterr().err


@pytest.mark.parametrize("name, seq, words", [
    ("llama-3-8b.json", 16384, ["max_position_embeddings 8192"]),
    ("mistral-7b.json", 8192, ["sliding_window 4096 (every layer)"]),
    ("phi-3-mini-4k.json", 4096, ["sliding_window 2047 (every layer)"]),
    ("gemma-2-9b.json", 8192, ["sliding_window 4096 (21 of 42 layers)"]),
    ("gemma-3-1b.json", 40000, ["sliding_window 512 (22 of 26 layers)",
                                "max_position_embeddings 32768"]),
])
def test_seq_len_past_what_the_config_bounds_is_noted_in_the_plan(name, seq, words):
    cfg = models.load_hf_config(DATA / name)
    dev = nr.parse_device("trn2.48xlarge:hbm=1TiB")
    par = models.Parallelism(tp=1, fsdp=-1)
    plan = nr.plan(dev, cfg, models.StepShape(seq_len=seq), par)
    notes = " ".join(plan.notes)
    for w in words:
        assert w in notes, plan.notes
    short = nr.plan(dev, cfg, models.StepShape(seq_len=256), par)
    assert not any("max_position" in n or "sliding_window" in n for n in short.notes)


def test_a_disabled_sliding_window_is_not_noted():
    qwen = models.load_hf_config(DATA / "qwen2.5-7b.json")
    assert qwen.sliding_window is None and qwen.max_positions == 131072
    assert models.shape_notes(qwen, models.StepShape(seq_len=100000)) == ()


@pytest.mark.parametrize("name, dropped", [
    ("gemma-2-9b.json", ["head_dim"]),  # hidden / heads would be 224
    ("gemma-3-1b.json", ["head_dim"]),
    ("deepseek-v3.json", ["first_k_dense_replace", "n_shared_experts", "q_lora_rank",
                          "scoring_func", "topk_method"]),
    ("deepseek-v2-lite.json", ["n_shared_experts"]),
    ("qwen1.5-moe-a2.7b.json", ["shared_expert_intermediate_size"]),
    ("llama4-scout.json", ["intermediate_size_mlp"]),
])
def test_a_field_left_out_takes_its_transformers_class_default(name, dropped):
    """A config.json may leave out what its transformers class defaults; where the file
    holds exactly those defaults, leaving them out changes nothing (the expected model is
    the complete file's)."""
    full = json.loads((DATA / name).read_text())
    text = "text_config" in full
    part = json.loads(json.dumps(full))
    src = part["text_config"] if text else part
    for key in dropped:
        del src[key]
    kw = {"text_only": True} if text else {}
    assert models.from_hf_config(part, **kw) == models.from_hf_config(full, **kw)


def test_a_gemma3_text_config_written_with_only_what_differs():
    """Gemma 3 4B's text_config as published (google/gemma-3-4b-it) gives only what differs
    from Gemma3TextConfig: the heads, head width and vocabulary are the class's (8, 4, 256,
    262208)."""
    cfg = {"model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"},
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                           "intermediate_size": 10240, "num_hidden_layers": 34,
                           "sliding_window": 1024,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}
    got = models.from_hf_config(cfg, text_only=True)
    assert (got.heads, got.kv_heads, got.head_dim, got.vocab) == (8, 4, 256, 262208)
