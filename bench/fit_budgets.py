"""`lowbit fit` plans against uniform GGUF recipes: perplexity and KL over bits per weight.

    lowbit fit smollm2-135m --budget-bits-per-weight 5 --write plan-5.yaml && lowbit run plan-5.yaml --output runs/plan-5
    lowbit run gguf-q4_0 --output runs/q4_0          # and q5_0, q8_0: the uniform points
    python bench/fit_budgets.py --uniform runs/q4_0 runs/q5_0 runs/q8_0 --plans runs/plan-* [--json]

Bits per weight count the decoder-layer linears' tensors in model.gguf (scales included), which
is what a plan's budget constrains. Each plan's perplexity is set against the straight line through
the uniform runs' points (piecewise, between the two uniform runs around its bits per weight), and
its predicted KL (the sum of each linear's own, from the plan's recipe description) against the
KL its checkpoint measured, which says how well the per-linear costs add up.
`lowbit report runs/*` draws the same runs on one quality-against-memory plot.
"""
import argparse
import json
import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader

LINEAR = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


def linear_bits_per_weight(run: Path) -> float:
    bits = params = 0
    for t in GGUFReader(run / "model.gguf").tensors:
        if LINEAR.match(t.name):
            bits += int(t.n_bytes) * 8
            params += int(np.prod(t.shape))
    return bits / params


def figures(run: Path) -> dict:
    results = json.loads((run / "results.json").read_text())
    kl = results["quality"].get("kl") or {}
    description = results.get("recipe", {}).get("description", "")
    predicted = re.search(r"predicted summed KL ([0-9.e+-]+)", description)
    return {"run": run.name, "bits_per_weight": linear_bits_per_weight(run),
            "perplexity": results["quality"]["perplexity"], "kl_mean": kl.get("kl_mean"),
            "predicted_kl": float(predicted.group(1)) if predicted else None,
            "weight_mib": results["memory"]["weight_bytes"] / 2**20}


def uniform_line(points: list[dict], bits: float) -> float | None:
    """The uniform runs' perplexity interpolated at `bits` (None outside their range)."""
    xs = [p["bits_per_weight"] for p in points]
    if not xs or bits < min(xs) - 1e-9 or bits > max(xs) + 1e-9:
        return None
    return float(np.interp(bits, xs, [p["perplexity"] for p in points]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--uniform", nargs="+", type=Path, required=True)
    parser.add_argument("--plans", nargs="+", type=Path, required=True)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    uniform = sorted((figures(r) for r in args.uniform), key=lambda f: f["bits_per_weight"])
    plans = sorted((figures(r) for r in args.plans), key=lambda f: f["bits_per_weight"])
    for p in plans:
        p["uniform_line_perplexity"] = uniform_line(uniform, p["bits_per_weight"])
    print(f"{'run':<16} {'bits/w':>7} {'MiB':>7} {'ppl':>8} {'line':>8} {'KL':>9} {'pred KL':>9}")
    for f in uniform + plans:
        line = f.get("uniform_line_perplexity")
        print(f"{f['run']:<16} {f['bits_per_weight']:7.3f} {f['weight_mib']:7.1f} {f['perplexity']:8.3f} "
              f"{line if line is not None else float('nan'):8.3f} {f['kl_mean'] or float('nan'):9.5f} "
              f"{f['predicted_kl'] if f['predicted_kl'] is not None else float('nan'):9.5f}")
    if args.json:
        for f in uniform + plans:
            print(json.dumps(f))


if __name__ == "__main__":
    main()
