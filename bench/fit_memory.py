"""A memory plan's predicted footprint against the one measured for the budget's own prefill.

    lowbit fit smollm2-135m --memory 256MB --context 8192 --json > plan.json
    lowbit fit smollm2-135m --memory 256MB --context 8192 --write plan.yaml && lowbit run plan.yaml --output runs/plan-256MB
    python bench/fit_memory.py plan.json runs/plan-256MB [--remeasure] [--json]

The run's evaluation measured (the plan's recipe asks for it) a prefill of the plan's context in
chunks plus 16 decoded tokens on the memory-lean CPU runtime, in a fresh process: the resident set
the loaded model took, then the rise during the prefill and decode. `--remeasure` measures again
here instead. Printed per part: weights (the plan's linears and the tensors outside them), KV
cache, workspace, the runtime's overhead (resident beyond its tensors once loaded and warm), and
the total against the budget.
"""
import argparse
import json
from pathlib import Path

MIB = 2**20


def measured(run: Path, plan: dict, remeasure: bool) -> dict:
    if not remeasure:
        return json.loads((run / "results.json").read_text())["memory"]["measured_peak"]
    from lowbit.evaluate.peak_probe import Loadable, measure_in_subprocess

    split = plan["memory_split"]
    return measure_in_subprocess(Loadable(str(run)), split["batch"], split["context"], 16,
                                 split["prefill_chunk"], lean=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("plan", type=Path, help="`lowbit fit --memory ... --json` output")
    parser.add_argument("run", type=Path, help="the plan's run folder")
    parser.add_argument("--remeasure", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    plan = json.loads(args.plan.read_text().strip().splitlines()[-1])
    split = plan["memory_split"]
    m = measured(args.run, plan, args.remeasure)
    total = m["model_resident_bytes"] + m["increase_bytes"]
    weights = plan["plan_bytes"] + split["other_weights"]
    rows = [("weights", weights, m["model_tensor_bytes"]),
            ("overhead", split["overhead"], m["model_resident_bytes"] - m["model_tensor_bytes"]),
            ("KV cache", split["kv_cache"], m["cache_bytes"]),
            ("workspace", split["workspace"], m["increase_bytes"] - m["cache_bytes"]),
            ("total", weights + split["overhead"] + split["kv_cache"] + split["workspace"], total)]
    print(f"plan: {plan['bits_per_weight']:.3f} bits per weight, KV {plan['kv_format']}, "
          f"{split['batch']} x {split['context']} tokens in chunks of {split['prefill_chunk']}, +16 decoded")
    print(f"{'part':<10} {'predicted MiB':>14} {'measured MiB':>13} {'measured/predicted':>19}")
    for name, p, got in rows:
        print(f"{name:<10} {p / MIB:14.1f} {got / MIB:13.1f} {got / p:19.3f}")
    verdict = "under" if total <= split["memory"] else "OVER"
    print(f"budget     {split['memory'] / MIB:14.1f}  measured total {verdict} it by {abs(split['memory'] - total) / MIB:.1f} MiB")
    if args.json:
        print(json.dumps({"budget_bytes": split["memory"], "predicted_bytes": rows[-1][1], "measured_bytes": total,
                          "parts": {n: {"predicted": p, "measured": g} for n, p, g in rows}}))


if __name__ == "__main__":
    main()
