"""Multi-host agreement, for real: two JAX processes on this machine joined by
jax.distributed.initialize (coordinator on 127.0.0.1), once resolving the same remat policy
and once not. Every child runs under a timeout, so the test cannot hang."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from jax.ad_checkpoint import checkpoint_policies

from neuron_remat import multihost
from neuron_remat.policies import RegexPolicy

CHILD = textwrap.dedent("""
    import json, os, sys
    import jax
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    import neuron_remat as nr
    from neuron_remat import multihost
    from importlib.metadata import entry_points
    out = {"process": pid, "count": jax.process_count(),
           "registered": any(ep.name == "neuron_remat"
                             for ep in entry_points(group="jax_remat_policy"))}
    if os.environ.get("TEST_SILENT"):  # resolves nothing, publishes nothing
        import time
        time.sleep(float(os.environ["TEST_SILENT"]))
        print("RESULT " + json.dumps(out), flush=True)
        jax.distributed.shutdown()
        sys.exit(0)
    try:
        choice = nr.resolve_policy(
            layer=os.environ.get("TEST_LAYER", "decoder.layer"), stack="stacked",
            model="llama3-8b",
            shape={"seq_len": int(os.environ.get("TEST_SEQ", "8192"))},
            parallelism={"tp": 4, "fsdp": -1, "sequence_parallel": True, "hosts": 2})
        out["policy"] = multihost.describe_policy(choice.policy, choice.prevent_cse)
        out["provider"] = choice.provider
        # Asked again (the next layer of the same kind): no second exchange is needed.
        again = nr.resolve_policy(
            layer="decoder.layer", stack="stacked", model="llama3-8b",
            shape={"seq_len": 8192},
            parallelism={"tp": 4, "fsdp": -1, "sequence_parallel": True, "hosts": 2})
        out["same_again"] = again.policy == choice.policy
        # The provider called directly, as a host using the entry-point protocol would.
        direct = nr.provide(layer="decoder.other", model="llama3-8b",
                            shape={"seq_len": 8192},
                            parallelism={"tp": 4, "fsdp": -1, "sequence_parallel": True,
                                         "hosts": 2})
        out["direct"] = multihost.describe_policy(direct.policy, direct.prevent_cse)
        # A host default built from a set (iterated in PYTHONHASHSEED's order), and a set
        # and JAX's frozenset-holding policy in the context: every process keys alike.
        from jax.ad_checkpoint import checkpoint_policies as cp
        names = {f"layer{i}.{n}_proj" for i in range(6) for n in "qkvo"}
        by_set = nr.resolve_policy(
            default=nr.RegexPolicy(names), layer="decoder.set_default", stack="stacked",
            tags=set(names), other_default=cp.save_only_these_names(*names))
        out["set_default"] = multihost.describe_policy(by_set.policy, by_set.prevent_cse)
        out["order"] = list(nr.RegexPolicy(names).save)
    except nr.PolicyMismatchError as err:
        out["error"] = str(err)
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(tmp_path, envs, timeout_s=150):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    port = _free_port()
    procs = []
    for pid, extra in enumerate(envs):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_", "XLA_"))}
        env.update(JAX_PLATFORMS="cpu", NEURON_REMAT_AGREEMENT_TIMEOUT="60",
                   PYTHONPATH=os.pathsep.join(sys.path))
        env.update(extra)
        procs.append(subprocess.Popen([sys.executable, str(script), str(pid), str(port)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert lines, f"no result (rc {proc.returncode}): {err[-2000:]}"
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for proc in procs:  # only the children this test started
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


SAME = {"NEURON_REMAT_DEVICE": "trn2.48xlarge:hbm=8GiB"}


def test_two_processes_that_agree(tmp_path):
    # Different hash seeds: sets iterate in different orders in the two processes.
    results = _run_pair(tmp_path, [{**SAME, "PYTHONHASHSEED": "1"},
                                   {**SAME, "PYTHONHASHSEED": "2"}])
    assert [r["count"] for r in results] == [2, 2]
    assert all("error" not in r for r in results), results
    assert results[0]["policy"] == results[1]["policy"]
    assert all(r["same_again"] for r in results)
    if results[0]["registered"]:  # the package is installed, with its entry point
        assert "RegexPolicy" in results[0]["policy"] and "linear1_0" in results[0]["policy"]
        assert all(r["provider"] == "neuron_remat" for r in results)
    assert results[0]["direct"] == results[1]["direct"]
    assert "RegexPolicy" in results[0]["direct"] and "linear1_0" in results[0]["direct"]
    assert results[0]["set_default"] == results[1]["set_default"]
    assert results[0]["order"] == results[1]["order"] == sorted(results[0]["order"])


def test_a_host_with_other_visible_cores_is_named(tmp_path):
    # Process 1 sees half the cores: more state per core, so fewer tags fit.
    results = _run_pair(tmp_path, [SAME, {**SAME, "NEURON_RT_VISIBLE_CORES": "0-31"}])
    for r in results:
        assert "error" in r, r
        err = r["error"]
        assert "different remat policies" in err and "layer 'decoder." in err
        assert "process 0:" in err and "process 1:" in err
        assert "NEURON_RT_VISIBLE_CORES=0-31" in err
        assert "\n" not in err


def test_a_host_whose_provider_fell_back_is_named(tmp_path):
    # Process 1's override is invalid: its provider falls back to the host's default
    # (here None), which is not what process 0 planned: raised even without strict mode.
    results = _run_pair(tmp_path, [SAME, {"NEURON_REMAT_DEVICE": "trn2.48xlarge:cores=65"}])
    for r in results:
        assert "error" in r, r
        assert "process 1: no policy" in r["error"] and "process 0: RegexPolicy" in r["error"]


def test_a_process_that_never_answers_is_an_error_not_a_hang(tmp_path):
    # Process 1 publishes nothing at all: only that is a timeout.
    quick = {**SAME, "NEURON_REMAT_AGREEMENT_TIMEOUT": "3"}
    results = _run_pair(tmp_path, [quick, {**quick, "TEST_SILENT": "6"}])
    err = results[0]["error"]
    assert "process 1 of 2 did not publish" in err and "within 3 s" in err
    assert "NEURON_REMAT_AGREEMENT_TIMEOUT" in err and "\n" not in err
    assert "error" not in results[1]


# The agreement timeout is long (60 s) in the tests below: a disagreement must be reported
# as a mismatch once every process has published, never as a timeout.


def test_a_process_resolving_another_layer_is_a_mismatch_not_a_timeout(tmp_path):
    results = _run_pair(tmp_path, [SAME, {**SAME, "TEST_LAYER": "decoder.other_layer"}])
    for me, r in enumerate(results):
        err = r["error"]
        assert "did not publish" not in err and "asked for different remat policies" in err
        assert "decoder.other_layer" in err and "'decoder.layer'" in err, err
        assert "\n" not in err


def test_the_same_layer_in_another_context_is_a_mismatch_not_a_timeout(tmp_path):
    results = _run_pair(tmp_path, [SAME, {**SAME, "TEST_SEQ": "4096"}])
    for r in results:
        err = r["error"]
        assert "did not publish" not in err and "another context" in err, err
        assert "4096" in err and "8192" in err and "\n" not in err


# ----------------------------------------------------------------------------------------
# Fingerprints, in one process.
# ----------------------------------------------------------------------------------------


def test_fingerprints_are_process_independent_and_discriminating():
    names = ["b_proj", "a_proj", "c_proj", "d_proj"]
    policy = checkpoint_policies.save_only_these_names(*names)
    code = ("from jax.ad_checkpoint import checkpoint_policies as c; "
            "from neuron_remat import multihost as m; from neuron_remat.policies import "
            "RegexPolicy; import sys; "
            f"print(m.fingerprint(c.save_only_these_names(*{list(reversed(names))!r}), True), "
            "m.fingerprint(RegexPolicy(['.*q_proj']), False), m.fingerprint(None))")
    outs = set()
    for seed in ("1", "2"):  # frozenset order follows the per-process hash seed
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        outs.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=env, timeout=120, check=True).stdout.strip())
    assert len(outs) == 1
    here = (f"{multihost.fingerprint(policy, True)} "
            f"{multihost.fingerprint(RegexPolicy(['.*q_proj']), False)} "
            f"{multihost.fingerprint(None)}")
    assert outs == {here}
    assert multihost.fingerprint(policy, True) != multihost.fingerprint(policy, False)
    assert (multihost.fingerprint(RegexPolicy([".*q_proj"]))
            != multihost.fingerprint(RegexPolicy([".*k_proj"])))
    other = checkpoint_policies.save_only_these_names("a_proj")
    assert multihost.fingerprint(other) != multihost.fingerprint(policy)


def test_single_process_exchanges_nothing(monkeypatch):
    # No jax.distributed.initialize here: agree() returns at once, whatever the timeout.
    monkeypatch.setenv(multihost.AGREEMENT_TIMEOUT_ENV, "not-a-number")
    multihost.agree(None, None, what="x")


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "1e9", "٣", "soon"])
def test_a_bad_agreement_timeout_is_refused(monkeypatch, raw):
    monkeypatch.setenv(multihost.AGREEMENT_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=multihost.AGREEMENT_TIMEOUT_ENV):
        multihost._timeout_s()
