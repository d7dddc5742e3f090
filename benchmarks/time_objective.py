"""Where the time objective and the FLOP objective choose different save sets, and by how
much (predicted), on built-in models planned for one TRN2 core (LNC=2).

For each model and budget (a fraction of the way from what full remat keeps per layer to
what saving every useful tag keeps), both plans are made with the same budget; each chosen
set is priced both ways: recompute FLOPs as a share of step FLOPs, and recompute time (the
roofline per op of `neuron_remat.graph.op_seconds` over `device.ENGINE_RATES`) as a share
of the step's roofline time. The time figures are PREDICTIONS: no step time was measured
(no Neuron device or GPU here). `--rates h200-sxm` prices for an H200 instead.

    python benchmarks/time_objective.py [--rates trn2] [--json out/time_objective.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import neuron_remat as nr  # noqa: E402
from neuron_remat import device as dv, memory_model as mm, models, planner  # noqa: E402
from neuron_remat.graph import PICOSECONDS  # noqa: E402

TP4 = nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=1)
CASES = [  # (model, seq_len, parallelism); "-native": without a flash-attention kernel,
    # "-maxtext": MaxText's tag names
    ("llama3-8b", 8192, TP4),
    ("llama3-8b-native", 4096, TP4),
    ("llama3-8b-maxtext", 8192, TP4),
    ("fuji-7b-native", 2048, TP4),
    ("fuji-7b", 4096, nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=1)),
    ("llama3-70b", 8192, nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=8)),
    ("fuji-70b", 8192, nr.Parallelism(tp=4, sequence_parallel=True, fsdp=-1, hosts=8)),
]
FRACTIONS = (0.2, 0.4, 0.6, 0.8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="trn2", help="trn2 (LNC=2), h100-sxm or h200-sxm")
    ap.add_argument("--json", type=Path)
    opts = ap.parse_args()
    dev = nr.from_instance_type("trn2.48xlarge")
    rates = dv.engine_rates(dev) if opts.rates == "trn2" else dv.engine_rates(None, opts.rates)
    rows = []
    print(f"rates: {rates.name} ({rates.source}); time figures are predictions, unmeasured")
    print(f"{'model':<17} {'budget':>9}  {'FLOP objective saves':<44} {'time objective saves':<44}"
          f" {'FLOP%: flops/time':>18} {'time%: flops/time':>18}")
    for name, seq, par in CASES:
        cfg = nr.get_model(name.split("-native")[0].split("-maxtext")[0])
        if name.endswith("-native"):
            cfg = dataclasses.replace(cfg, flash_attention=False)
        if name.endswith("-maxtext"):
            cfg = dataclasses.replace(cfg, tags=models.MAXTEXT_TAGS)
        cfg = dataclasses.replace(cfg, tags=models.host_tags(cfg.tags, dev))
        shape = nr.StepShape(seq_len=seq)
        fp = mm.layer_footprint(cfg, shape, par.resolve(dev))
        tfp = planner._timed_footprint(fp, rates)
        step_flops = 3 * fp.forward_flops
        step_secs = 3 * tfp.graph.forward_flops() / PICOSECONDS
        useful = [t for t in fp if not fp[t].always_kept and fp[t].recompute_flops > 0]
        lo, hi = fp.evaluate(())[0], fp.evaluate(useful)[0]
        for frac in FRACTIONS:
            budget = int(lo + frac * (hi - lo))
            got = {}
            for obj in ("flops", "time"):
                p = nr.plan(dev, cfg, shape, par, budget_bytes=budget, objective=obj,
                            rates=rates, runner_ups=0)
                tags = tuple(t for t in p.saved_tags if not fp[t].always_kept)
                secs = tfp.evaluate(tags)[1] / PICOSECONDS  # recompute, per layer
                got[obj] = (tags, fp.evaluate(tags)[1] / step_flops, secs / step_secs, secs)
            (tf, ff, sf, msf), (tt, ft, st, mst) = got["flops"], got["time"]
            differ = set(tf) != set(tt)
            rows.append({"model": name, "seq_len": seq, "budget_bytes": budget,
                         "flops_plan": list(tf), "time_plan": list(tt), "differ": differ,
                         "flops_share": [ff, ft], "time_share": [sf, st],
                         "recompute_ms_per_layer": [1e3 * msf, 1e3 * mst],
                         "step_ms_per_layer": 1e3 * step_secs,
                         "time_saved_points": 100 * (sf - st),
                         "flops_cost_points": 100 * (ft - ff)})
            mark = "*" if differ else " "
            print(f"{name:<17} {budget / 2**20:>6.0f}MiB {mark}{','.join(sorted(tf)) or '-':<44}"
                  f"{','.join(sorted(tt)) or '-':<44} {100 * ff:>8.2f}/{100 * ft:<8.2f} "
                  f"{100 * sf:>8.2f}/{100 * st:<8.2f}")
    diff = [r for r in rows if r["differ"]]
    print(f"\n{len(diff)} of {len(rows)} cases choose differently (*):")
    print(f"{'model':<17} {'seq':>5} {'budget':>9}  {'recompute ms/layer: flops/time plan':>36}"
          f" {'saved ms/layer':>14} {'of a step ms/layer':>18} {'saved % step time':>17}"
          f" {'extra % step FLOPs':>18}")
    for r in diff:
        a, b = r["recompute_ms_per_layer"]
        print(f"{r['model']:<17} {r['seq_len']:>5} {r['budget_bytes'] / 2**20:>6.0f}MiB  "
              f"{a:>17.4f} / {b:<16.4f} {a - b:>14.4f} {r['step_ms_per_layer']:>18.3f} "
              f"{r['time_saved_points']:>17.2f} "
              f"{r['flops_cost_points']:>+18.2f}")
    print("Predicted only: step time was not measured (no Neuron device or GPU in this run).")
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps({"rates": rates.to_dict(), "rows": rows,
                                         "measured": False}, indent=1))


if __name__ == "__main__":
    main()
