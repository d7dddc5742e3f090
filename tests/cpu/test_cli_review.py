"""What a new user ran into (a review of the CLI and the API by hand), each now one line
that names the value and what is valid: `--plot` that cannot be written (before any plan,
so `--json` prints one document), flags that apply only beside another, a `fit` target whose
step fails to trace, errors that name the CLI's flag, and the API's device and model
arguments given as strings or as the wrong type. `main(argv)` in-process."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import neuron_remat as nr
from neuron_remat import device as dev
from neuron_remat.cli import main

PLAN = ["plan", "--model", "llama3-8b", "--device", "trn2.48xlarge:hbm=8GiB"]


def _one_line_error(argv, capsys, *, as_json=False) -> str:
    rc = main([*argv, *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    if as_json:
        return json.loads(out)["error"]  # one document: json.loads refuses a second
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("as_json", [False, True])
def test_plot_that_cannot_be_written_is_refused_before_planning(tmp_path, capsys, as_json):
    taken = tmp_path / "plot.png"
    taken.mkdir()  # a writable folder, but the name is a folder: open() fails
    path = str(taken)
    msg = _one_line_error([*PLAN, "--plot", path], capsys, as_json=as_json)
    assert msg.startswith("error: --plot" if not as_json else "--plot") and path in msg


def test_plot_check_leaves_no_file_behind(tmp_path):
    from neuron_remat import cli

    path = tmp_path / "m.pdf"
    cli._check_plot_path(str(path))
    assert not path.exists()
    path.write_bytes(b"kept")  # a file that was there stays as it was
    cli._check_plot_path(str(path))
    assert path.read_bytes() == b"kept"


def test_empty_plot_name_is_refused(capsys):
    assert "--plot ''" in _one_line_error([*PLAN, "--plot", ""], capsys)


@pytest.mark.parametrize("argv,flag", [
    ([*PLAN, "--schedule", "gpipe"], "--schedule gpipe"),
    (["audit", "examples.flax_demo:factory", "--offload-dst", "unpinned_host"],
     "--offload-dst"),
    (["audit", "examples.flax_demo:factory", "--allow-offload-on-neuron"],
     "--allow-offload-on-neuron"),
])
def test_a_flag_that_needs_another_is_refused(argv, flag, capsys):
    msg = _one_line_error(argv, capsys)
    assert flag in msg and "drop" in msg


def test_max_sets_error_lists_none(capsys):
    msg = _one_line_error([*PLAN, "--per-layer", "--max-sets", "foo"], capsys)
    assert "or none" in msg


def test_errors_name_the_flag_to_change(capsys):
    msg = _one_line_error(["plan", "--model", "llama3-8b", "--device",
                           "trn2.48xlarge:hbm=8GiB:cores=1"], capsys)
    assert "tp=4" in msg and "valid products: 1" in msg
    msg = _one_line_error([*PLAN, "--seq-len", "2"], capsys)
    assert "--no-sequence-parallel" in msg
    msg = _one_line_error(["plan", "--model", "nosuch"], capsys)
    assert "--model path/to/config.json" in msg


def test_fit_target_whose_step_fails_to_trace_names_the_target(tmp_path, monkeypatch,
                                                                capsys):
    (tmp_path / "badstep.py").write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp
        def layer(x, params):
            return x @ params
        def factory():  # returns (layer, args), not (make_step, args)
            return layer, (jax.ShapeDtypeStruct((4, 4), jnp.float32),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("badstep", None)
    msg = _one_line_error(["fit", "badstep:factory", "--device",
                           "trn2.48xlarge:hbm=64MiB:cores=1"], capsys)
    assert "fit target 'badstep:factory'" in msg and "raised TypeError when traced" in msg


def test_offload_on_neuron_names_the_cli_flag(monkeypatch):
    monkeypatch.setenv(dev.OVERRIDE_ENV, "trn2")
    with pytest.raises(ValueError, match="--allow-offload-on-neuron"):
        nr.RegexPolicy([], ["x"], offload_src="device", offload_dst="pinned_host")


def test_api_takes_a_device_string_and_a_model_name():
    shape = nr.StepShape(seq_len=4096)
    spec = nr.parse_device("trn2.48xlarge:hbm=8GiB")
    by_string = nr.plan("trn2.48xlarge:hbm=8GiB", "llama3-8b", shape,
                        nr.Parallelism(tp=4, fsdp=-1))
    by_objects = nr.plan(spec, nr.get_model("llama3-8b"), shape, nr.Parallelism(tp=4, fsdp=-1))
    assert by_string.saved_tags == by_objects.saved_tags
    assert by_string.budget_bytes_per_layer == by_objects.budget_bytes_per_layer


def test_plan_without_a_parallelism_is_fsdp_over_the_hosts_cores():
    # trn2.48xlarge: 16 chips x 4 logical cores at LNC=2 = 64 cores on one host
    shape = nr.StepShape(seq_len=4096)
    plan = nr.plan("trn2.48xlarge", "llama3-8b", shape)
    explicit = nr.plan("trn2.48xlarge", "llama3-8b", shape, nr.Parallelism(fsdp=64))
    assert plan.saved_tags == explicit.saved_tags
    assert plan.budget_bytes_per_layer == explicit.budget_bytes_per_layer
    assert nr.memory_model.budget(nr.parse_device("trn2.48xlarge"), nr.get_model("llama3-8b"),
                                  shape).per_layer_bytes == explicit.budget_bytes_per_layer


@pytest.mark.parametrize("call,match", [
    (lambda: nr.from_instance_type(None), r"instance type None \(NoneType\) is not a name"),
    (lambda: nr.get_model(3), r"model 3 \(int\) is not a name"),
    (lambda: nr.plan(3, "llama3-8b", nr.StepShape(seq_len=8)), r"plan\(device=...\): 3"),
    (lambda: nr.plan("trn9", "llama3-8b", nr.StepShape(seq_len=8)),
     r"plan\(device=...\): device 'trn9': unknown device"),
    (lambda: nr.plan(None, 3.5, nr.StepShape(seq_len=8)),
     r"plan\(config=...\): '3.5' \(float\) is not a model"),
    (lambda: nr.plan(None, "llama3-8b"), r"shape=None; give StepShape\(seq_len=...\) "
                                         r"\(llama3-8b's default"),
])
def test_api_wrong_types_are_one_line(call, match):
    with pytest.raises((TypeError, ValueError), match=match) as err:
        call()
    assert "\n" not in str(err.value)


def test_an_ambiguous_audit_is_an_error_naming_the_candidates(tmp_path, monkeypatch, capsys):
    """Both arguments match the output: audit, like traced_footprint, asks which is the
    layer input (the README's contract), and --activation-argnums answers."""
    (tmp_path / "twin.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp
        from jax.ad_checkpoint import checkpoint_name
        def f(x, y):
            return x + checkpoint_name(jnp.tanh(x * y), "a")
        def factory():
            return f, (jnp.ones((4, 4)), jnp.ones((4, 4)))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("twin", None)
    import twin

    fn, args = twin.factory()
    with pytest.raises(ValueError, match=r"arguments \[0, 1\] all match"):
        nr.audit(fn, *args, policy=nr.RegexPolicy(["a"]))
    with pytest.raises(ValueError, match=r"arguments \[0, 1\] all match"):
        nr.traced_footprint(fn, *args)
    msg = _one_line_error(["audit", "twin:factory", "--save", "a"], capsys)
    assert "[0, 1] all match" in msg and "--activation-argnums" in msg
    assert main(["audit", "twin:factory", "--save", "a", "--activation-argnums", "1",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["activation_argnums"] == [1]


def test_text_only_on_a_text_config_is_refused(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                "hidden_size": 64, "num_attention_heads": 4,
                                "intermediate_size": 128, "vocab_size": 256}))
    msg = _one_line_error(["plan", "--model", str(path), "--text-only"], capsys)
    assert "text only already" in msg and "--text-only" in msg


def test_an_invalid_unknown_config_gives_its_error_alone(tmp_path, capsys, caplog):
    """A config.json of an unknown family that is also invalid: its error, without the
    warning that the family is planned as Llama-like (said only of a config that loads)."""
    path = tmp_path / "config.json"
    path.write_text("{}")
    with caplog.at_level("WARNING"):
        msg = _one_line_error(["plan", "--model", str(path)], capsys)
    assert "lacks num_hidden_layers" in msg
    assert not [r for r in caplog.records if "Llama-like" in r.getMessage()]


def test_a_reserve_of_the_whole_hbm_is_bad_input(capsys):
    # trn2 at LNC=2: 24 GiB per core; 30 GiB cannot be held back from it
    spec = nr.parse_device("trn2.48xlarge")
    with pytest.raises(ValueError, match=r"reserve=32212254720 bytes \(30 GiB\) is not less "
                                         r"than the 24 GiB of HBM per core"):
        nr.memory_model.reserve_bytes(spec, 30 << 30)
    assert main(["plan", "--model", "llama3-8b", "--reserve", "30GiB"]) == 2
    assert "is not less than the 24 GiB" in capsys.readouterr().err


def test_no_fit_advice_names_a_reserve_that_alone_leaves_nothing():
    # 95% of 24 GiB held back: more than the 10% default by more than the shortfall
    with pytest.raises(nr.NoFitError, match=r"To fit: lower the reserve \(now 22\.8 GiB, 95% "
                                            r"of HBM\)"):
        nr.plan("trn2.48xlarge", "llama3-8b", nr.StepShape(seq_len=8192),
                nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1), reserve=0.95)


def test_under_the_time_objective_the_why_is_in_time():
    # llama3-8b, seq 4096, FSDP only: q_proj recomputes 2 x 4096 x 4096 x 4096 = 137.4 GFLOP;
    # a logical core at LNC=2 is two physical cores of 79 TFLOP/s: 137.4e9 / 158e12 = 870 us.
    # It keeps 4096 x 4096 x 2 B = 32 MiB, written and read at 2 x 362.5 GB/s: 92.6 us.
    plan = nr.plan("trn2.48xlarge", "llama3-8b", nr.StepShape(seq_len=4096), objective="time")
    why = {d.tag: d.reason for d in plan.decisions}
    assert why["q_proj"] == "saved: 870 us of recompute for 92.6 us to write and read it"


def test_every_name_the_readme_calls_on_the_package_exists():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    # `nr.X` calls, and the config loaders the README names bare beside them
    named = set(re.findall(r"\bnr\.(\w+)", text)) | {"load_hf_config", "from_hf_config"}
    assert sorted(n for n in named if not hasattr(nr, n)) == []


def test_a_numpy_integer_reserve_is_bytes_as_an_int_is():
    # plan's own check takes any integral reserve; the budget took only Python ints
    import numpy as np

    shape = nr.StepShape(seq_len=4096)
    a = nr.plan("trn2.48xlarge", "llama3-8b", shape, reserve=np.int64(1 << 30))
    b = nr.plan("trn2.48xlarge", "llama3-8b", shape, reserve=1 << 30)
    assert a.budget_bytes_per_layer == b.budget_bytes_per_layer
