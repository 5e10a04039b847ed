"""What learned rounding can reach on each linear's own objective, against GPTQ, on smollm2-135m.

    python bench/rounding_reach.py [--layers 0 14 29] [--samples 16] [--bits 4] [--steps 200] [--json]

Each linear's output error on its calibration inputs X is tr(ΔW H ΔWᵀ) / 2 with H = 2/N · XᵀX
(GPTQ's objective; the float model's inputs, `--samples` wiki samples of 512 tokens). For the
linears of each chosen layer it prints that error, summed per output over the layer and relative
to round-to-nearest's, for:
  - gptq: lowbit's solve as w4a16-gptq sets it (static act-order, damping 0.1, MSE scale search);
  - signround: SignRound's view (an offset per weight in [-0.5, 0.5], a clipping factor per group),
    `--steps` signed-gradient steps on this exact objective, every token in each step, the best
    step kept: learned rounding at its cheapest, with no batch noise;
and `within_reach`, the share of GPTQ's codes SignRound's view can express at all (|code - w / s|
at most half a step, s being GPTQ's scale, which the clipping factor can reach; a weight past the
grid's end measured from that end).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from lowbit.calibrate.arch import arch_for, linear_weight
from lowbit.calibrate.data import CalibrationConfig, calibration_batches
from lowbit.calibrate.models import load_model
from lowbit.calibrate.provenance import provenance
from lowbit.calibrate.walker import walk
from lowbit.quantize.grids.integer import IntScheme, grouped
from lowbit.quantize.grids.integer_learned import IntLearnedRounding
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import solve_onto
from lowbit.quantize.steps.layerwise import collect_hessians


class Done(Exception):
    """Ends the walk after the last chosen layer."""


def output_error(Wq: torch.Tensor, W: torch.Tensor, H: torch.Tensor) -> float:
    """Mean over tokens of |x (Wq - W)ᵀ|², from H = 2/N · XᵀX."""
    E = Wq - W
    return float((E @ H * E).sum()) / 2


def signround_on_hessian(W: torch.Tensor, H: torch.Tensor, grid: IntScheme, steps: int) -> tuple[float, float]:
    """The error at the start (round-to-nearest) and the lowest of `steps` signed-gradient steps
    (first step 1/steps, falling linearly to 0, as signround's)."""
    view = IntLearnedRounding(W, grid)
    params, errors = list(view.parameters()), []
    for step in range(steps):
        with torch.enable_grad():
            fake = view.fake_weight()
            pushed = (fake.detach() - W) @ H  # d error / d fake
            grads = torch.autograd.grad(fake, params, grad_outputs=pushed)
        errors.append(output_error(fake.detach(), W, H))
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g.sign(), alpha=-(1 - step / steps) / steps)
        view.keep_in_range()
    return errors[0], min(errors)


def within_reach(result, W: torch.Tensor) -> float:
    """Share of GPTQ's codes within half a step of the float weight on GPTQ's own scales (past the
    grid's ends: of its end, where every offset rounds and clamps to). Static act-order keeps the
    groups in place (no g_idx), so the codes group as the weight does."""
    q = result.weight
    zero = 0 if q.zero is None else q.zero.float().unsqueeze(-1)
    nearest = (grouped(W, q.scheme) / q.scale.unsqueeze(-1) + zero).clamp(q.scheme.qmin, q.scheme.qmax)
    return float(((grouped(q.codes.float(), q.scheme) - nearest).abs() <= 0.5).float().mean())


def linear_row(W: torch.Tensor, H: torch.Tensor, grid: IntScheme, steps: int) -> dict:
    gptq_cfg = GPTQConfig(grid, actorder="static", dampening_frac=0.1, scale_search="mse")
    result = solve_onto(grid, W.clone(), H.clone(), gptq_cfg)
    rtn, signround = signround_on_hessian(W, H, grid, steps)
    return {"rtn": rtn, "gptq": output_error(result.weight.dequantize().float(), W, H),
            "signround": signround, "within_reach": within_reach(result, W),
            "weights": W.numel()}


def measure(model, batches, layers: list[int], grid: IntScheme, steps: int) -> list[dict]:
    arch, rows = arch_for(model), []

    def on_layer(i, prefix, layer, inputs):
        if i in layers:
            names = list(arch.linears)
            hessians, sharing = collect_hessians(layer, names, inputs, None)
            per_linear = {}
            for lead, members in sharing.items():
                H = hessians[lead].take()
                for name in members:
                    W = linear_weight(layer.get_submodule(name)).detach().float()
                    per_linear[name] = {k: v / W.shape[0] if k in ("rtn", "gptq", "signround") else v
                                        for k, v in linear_row(W, H, grid, steps).items()}
            rows.append(layer_row(prefix, per_linear))
            print(f"[rounding_reach] {prefix}: gptq {rows[-1]['gptq_over_rtn']:.3f}, signround "
                  f"{rows[-1]['signround_over_rtn']:.3f} of rtn's error", file=sys.stderr)
        if i >= max(layers):
            raise Done
        return {"layer": prefix}

    try:
        walk(model, arch, batches, on_layer, label="rounding_reach", micro_batch=4, forward_dtype=torch.float32,
             final_outputs=False)
    except Done:
        pass
    return rows


def layer_row(prefix: str, per_linear: dict) -> dict:
    total = {k: sum(r[k] for r in per_linear.values()) for k in ("rtn", "gptq", "signround")}
    weights = sum(r["weights"] for r in per_linear.values())
    reach = sum(r["within_reach"] * r["weights"] for r in per_linear.values()) / weights
    return {"layer": prefix, "gptq_over_rtn": round(total["gptq"] / total["rtn"], 4),
            "signround_over_rtn": round(total["signround"] / total["rtn"], 4),
            "gptq_within_reach": round(reach, 4),
            "linears": {n: {k: round(v, 6) for k, v in r.items() if k != "weights"} for n, r in per_linear.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", type=int, nargs="+", default=[0, 14, 29])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = p.parse_args(argv)
    grid = IntScheme(args.bits, True, "group", args.group)
    model, tokenizer, _ = load_model(args.model)
    batches = calibration_batches(CalibrationConfig(dataset="wiki", samples=args.samples, seq_len=args.seq_len),
                                  tokenizer)
    rows = measure(model, batches, sorted(args.layers), grid, args.steps)
    command = " ".join(["python bench/rounding_reach.py", *(sys.argv[1:] if argv is None else argv)])
    record = {"command": command, **provenance(), "model": args.model, "grid": grid.describe(),
              "samples": args.samples, "seq_len": args.seq_len, "steps": args.steps, "layers": rows}
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        for row in rows:
            print(f"{row['layer']}: error vs rtn: gptq {row['gptq_over_rtn']:.3f}, signround "
                  f"{row['signround_over_rtn']:.3f}; gptq codes within signround's reach "
                  f"{row['gptq_within_reach']:.1%}")
    return record


if __name__ == "__main__":
    main()
