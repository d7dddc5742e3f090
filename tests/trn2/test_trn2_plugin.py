"""On a trn2 instance: the provider plans the demo model, and one training step of the
Flax demo compiles and runs on the neuron backend with the planned policy.

The demo is a single-core program, so it runs in a subprocess that sees one core
(``NEURON_RT_VISIBLE_CORES=0``): detection then reports one core and the planner's check
that the parallel degrees cover every core holds with ``Parallelism()``.
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import jax
    import flax_demo as demo
    import neuron_remat as nr

    spec = nr.detect(refresh=True)
    choice = demo.resolved_choice()
    expected = nr.plan(spec, demo.CONFIG, demo.SHAPE, demo.PARALLELISM)
    run = demo.run("resolved", 1)
    stats = None
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception as err:  # the Neuron plugin may not implement it
        stats = {"error": repr(err)}
    print(json.dumps({
        "backend": jax.default_backend(), "family": spec.family, "cores": spec.cores,
        "provider": choice.provider, "policy": repr(choice.policy),
        "expected": repr(expected.policy), "losses": [float(l) for l in run.losses],
        "predicted": expected.predicted_bytes_per_core,
        "reserve": expected.budget.reserve_bytes, "memory_stats": stats}))
""")


def test_demo_step_runs_on_neuron_with_the_planned_policy():
    env = {**os.environ, "NEURON_RT_VISIBLE_CORES": "0"}
    env.pop("NEURON_REMAT_DEVICE", None)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "examples")], env=env,
                         capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["backend"] == "neuron" and out["family"] == "trn2" and out["cores"] == 1
    assert out["provider"] == "neuron_remat"
    assert out["policy"] == out["expected"]
    assert len(out["losses"]) == 1 and math.isfinite(out["losses"][0]), out["losses"]
    stats = out["memory_stats"]
    peak = (stats or {}).get("peak_bytes_in_use")
    print(f"plan predicts {out['predicted']} B per core (+ reserve {out['reserve']} B); "
          f"memory_stats: {stats}")
    if peak is not None:
        assert peak <= out["predicted"] + out["reserve"]
