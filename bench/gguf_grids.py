"""Weight-space error of the GGUF block grids on smollm2-135m's linears (lm_head excluded).

    python bench/gguf_grids.py [--json] [--types q4_0,q4_k]

Per type and per set of linears: RMSE of lowbit's quantize_gguf against the float weights, the
same for the `gguf` package's own quantizer where it has one (Q8_0, Q4_0, Q4_1) with how many
tensors came out byte-identical, and whether the package's dequantizer reads lowbit's packed
bytes back bit for bit. Sets: "all" (every targeted linear; block-32 types only) and "in%256"
(the linears whose rows split into 256-weight super-blocks: on smollm2 only mlp.down_proj, its
576-wide rows do not, and llama.cpp falls back to another type there).
smollm2's weights came from a Q4_1 GGUF: Q4_1 re-quantization is lossless and says nothing.
"""
import argparse
import json
import time

import numpy as np
import torch
from gguf import quants

from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.models import load_model
from lowbit.quantize.grids.gguf import LAYOUTS, GGUFScheme, quantize_gguf
from lowbit.quantize.grids.gguf_packing import pack
from lowbit.quantize.targets import select_targets

HAS_GGUF_QUANTIZER = ("q8_0", "q4_0", "q4_1")


def measure(weights: dict, scheme: GGUFScheme) -> dict:
    """Sums over the weights that fit the scheme's blocks."""
    out = {"tensors": 0, "weights": 0, "sq_err": 0.0, "sq_w": 0.0, "gguf_sq_err": 0.0,
           "bytes_equal": 0, "dequant_exact": 0, "seconds": 0.0}
    for W in weights.values():
        start = time.perf_counter()
        mine = quantize_gguf(W, scheme)
        out["seconds"] += time.perf_counter() - start
        data = pack(mine).numpy()
        theirs = quants.dequantize(data, scheme.ggml_type)
        out["dequant_exact"] += int(np.array_equal(theirs.view(np.int32), mine.dequantize().numpy().view(np.int32)))
        out["tensors"] += 1
        out["weights"] += W.numel()
        out["sq_err"] += float((mine.dequantize() - W).double().square().sum())
        out["sq_w"] += float(W.double().square().sum())
        if scheme.type in HAS_GGUF_QUANTIZER:
            reference = quants.quantize(W.numpy(), scheme.ggml_type)
            out["bytes_equal"] += int(np.array_equal(reference, data))
            back = torch.from_numpy(quants.dequantize(reference, scheme.ggml_type))
            out["gguf_sq_err"] += float((back - W).double().square().sum())
    return out


def row(kind: str, subset: str, m: dict) -> dict:
    n = m["weights"]
    result = {"type": kind, "set": subset, "tensors": m["tensors"], "weights": n,
              "bits_per_weight": GGUFScheme(kind).bits_per_weight,
              "rmse": (m["sq_err"] / n) ** 0.5, "relative_rmse": (m["sq_err"] / m["sq_w"]) ** 0.5,
              "dequant_bit_exact": f"{m['dequant_exact']}/{m['tensors']}", "seconds": round(m["seconds"], 2)}
    if kind in HAS_GGUF_QUANTIZER:
        result["gguf_rmse"] = (m["gguf_sq_err"] / n) ** 0.5
        result["bytes_equal_gguf"] = f"{m['bytes_equal']}/{m['tensors']}"
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="q4_0,q4_1,q4_k,q6_k,q8_0")
    p.add_argument("--json", action="store_true", help="one JSON line per row")
    args = p.parse_args()
    model, _, _ = load_model("smollm2-135m")
    linears = select_targets(model, arch_for(model), ("lm_head",)).linears
    weights = {n: m.weight.detach().float() for n, m in linears.items()}
    sets = {"all": weights, "in%256": {n: w for n, w in weights.items() if w.shape[1] % 256 == 0}}
    for kind in args.types.split(","):
        scheme = GGUFScheme(kind)
        for subset, chosen in sets.items():
            if LAYOUTS[kind].block == 256 and subset == "all":
                continue  # most of smollm2's rows are 576 wide: not a multiple of 256
            r = row(kind, subset, measure(chosen, scheme))
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                extra = (f"  gguf package {r['gguf_rmse']:.3e}, bytes equal {r['bytes_equal_gguf']}"
                         if "gguf_rmse" in r else "")
                print(f"{kind:5s} {subset:7s} {r['tensors']:3d} tensors  {r['bits_per_weight']:.4g} bpw  "
                      f"rmse {r['rmse']:.3e} (relative {r['relative_rmse']:.4f})  dequant exact "
                      f"{r['dequant_bit_exact']}{extra}  [{r['seconds']}s]", flush=True)


if __name__ == "__main__":
    main()
