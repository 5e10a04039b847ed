"""`lowbit fit` plans against uniform recipes: perplexity and KL over bits per weight.

    lowbit fit smollm2-135m --budget-bits-per-weight 5 --write plan-5.yaml && lowbit run plan-5.yaml --output runs/plan-5
    lowbit run w4a16-gptq --output runs/w4a16-gptq      # and w3a16-gptq, w8a16-gptq: the uniform points
    python bench/fit_budgets.py --uniform runs/w3a16-gptq runs/w4a16-gptq runs/w8a16-gptq \\
        --plans runs/plan-* [--gap-of runs/w4a16-gptq] [--plot pareto.png] [--json]

Bits per weight count the decoder-layer linears' tensors in the checkpoint (model.safetensors:
codes, scales and shapes, or 16-bit weights; model.gguf: the linears' blocks), which is what a
plan's budget constrains. Each plan's perplexity is set against the straight line through the
uniform runs' points (piecewise, between the two uniform runs around its bits per weight), and
its predicted KL (the sum of each linear's own, from the plan's recipe description) against the
KL its checkpoint measured, which says how well the per-linear costs add up. `--gap-of RUN`
prints, per plan, the share of RUN's perplexity gap to the unquantized model that the plan closes.
"""
import argparse
import json
import re
from pathlib import Path

import numpy as np

GGUF_LINEAR = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
ST_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.(weight\w*)$")
ELEMENT = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "I8": 1, "U8": 1, "F8_E4M3": 1}


def linear_bits_per_weight(run: Path) -> float:
    if (run / "model.gguf").exists():
        from gguf import GGUFReader

        tensors = [(t.name, int(t.n_bytes), int(np.prod(t.shape))) for t in GGUFReader(run / "model.gguf").tensors]
        pairs = [(b, n) for name, b, n in tensors if GGUF_LINEAR.match(name)]
        return sum(b for b, _ in pairs) * 8 / sum(n for _, n in pairs)
    return _safetensors_linear_bits(run / "model.safetensors")


def _safetensors_linear_bits(path: Path) -> float:
    """Bytes of every decoder-layer linear tensor, over the linears' weights (a weight_shape's
    product, or a 16-bit weight's size)."""
    from safetensors import safe_open

    nbytes = params = 0
    with safe_open(path, "pt") as f:
        for name in f.keys():
            match = ST_LINEAR.match(name)
            if not match:
                continue
            part = f.get_slice(name)
            nbytes += int(np.prod(part.get_shape())) * ELEMENT[part.get_dtype()]
            if match.group(3) == "weight":
                params += int(np.prod(part.get_shape()))
            elif match.group(3) == "weight_shape":
                params += int(np.prod(f.get_tensor(name).tolist()))
    return nbytes * 8 / params


def figures(run: Path) -> dict:
    results = json.loads((run / "results.json").read_text())
    q = results["quality"]
    kl = q.get("kl") or {}
    description = results.get("recipe", {}).get("description", "")
    predicted = re.search(r"predicted summed KL ([0-9.e+-]+)", description)
    return {"run": run.name, "bits_per_weight": linear_bits_per_weight(run),
            "perplexity": q["perplexity"], "baseline_perplexity": q.get("baseline_perplexity"),
            "kl_mean": kl.get("kl_mean"), "predicted_kl": float(predicted.group(1)) if predicted else None,
            "weight_mib": results["memory"]["weight_bytes"] / 2**20}


def uniform_line(points: list[dict], bits: float, key: str = "perplexity") -> float | None:
    """The uniform runs' `key` interpolated at `bits` (None outside their range)."""
    xs = [p["bits_per_weight"] for p in points]
    if not xs or bits < min(xs) - 1e-9 or bits > max(xs) + 1e-9 or any(p[key] is None for p in points):
        return None
    return float(np.interp(bits, xs, [p[key] for p in points]))


def plot(uniform: list[dict], plans: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for ax, key, label in ((axes[0], "perplexity", "perplexity (wiki)"), (axes[1], "kl_mean", "mean KL vs float (nats)")):
        for group, style, name in ((uniform, "s-", "uniform recipes"), (plans, "o-", "lowbit fit plans")):
            pts = [(p["bits_per_weight"], p[key]) for p in group if p[key] is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=name)
            for p in group:
                if p[key] is not None:
                    ax.annotate(p["run"], (p["bits_per_weight"], p[key]), textcoords="offset points",
                                xytext=(4, 4), fontsize=7)
        base = next((p["baseline_perplexity"] for p in uniform + plans if p["baseline_perplexity"]), None)
        if key == "perplexity" and base:
            ax.axhline(base, color="black", lw=0.8, ls=":", label="unquantized")
        ax.set_xlabel("bits per weight, decoder-layer linears (scales included)")
        ax.set_ylabel(label)
        # linear axes: the straight line between uniform points is what mixing their layers gives
        # (losses add), and it stays straight only on linear axes
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--uniform", nargs="+", type=Path, required=True)
    parser.add_argument("--plans", nargs="+", type=Path, required=True)
    parser.add_argument("--gap-of", type=Path, help="a uniform run whose perplexity gap the plans close a share of")
    parser.add_argument("--plot", type=Path, help="write the two curves (perplexity, KL) as a PNG")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    uniform = sorted((figures(r) for r in args.uniform), key=lambda f: f["bits_per_weight"])
    plans = sorted((figures(r) for r in args.plans), key=lambda f: f["bits_per_weight"])
    gap = figures(args.gap_of) if args.gap_of else None
    for p in plans:
        p["uniform_line_perplexity"] = uniform_line(uniform, p["bits_per_weight"])
        p["uniform_line_kl"] = uniform_line(uniform, p["bits_per_weight"], "kl_mean")
        if gap and gap["baseline_perplexity"]:
            full = gap["perplexity"] - gap["baseline_perplexity"]
            p["gap_closed_vs_" + gap["run"]] = (gap["perplexity"] - p["perplexity"]) / full
    print(f"{'run':<16} {'bits/w':>7} {'MiB':>7} {'ppl':>8} {'line':>8} {'KL':>9} {'line KL':>9} {'pred KL':>9}"
          + ("  gap closed" if gap else ""))
    nan = float("nan")
    for f in uniform + plans:
        closed = f.get("gap_closed_vs_" + gap["run"]) if gap else None
        print(f"{f['run']:<16} {f['bits_per_weight']:7.3f} {f['weight_mib']:7.1f} {f['perplexity']:8.3f} "
              f"{f.get('uniform_line_perplexity') or nan:8.3f} {f['kl_mean'] or nan:9.5f} "
              f"{f.get('uniform_line_kl') or nan:9.5f} {f['predicted_kl'] if f['predicted_kl'] is not None else nan:9.5f}"
              + (f"  {100 * closed:6.1f}%" if closed is not None else ""))
    if args.plot:
        plot(uniform, plans, args.plot)
        print(f"plot        {args.plot}")
    if args.json:
        for f in uniform + plans:
            print(json.dumps(f))


if __name__ == "__main__":
    main()
