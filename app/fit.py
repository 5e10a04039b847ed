"""`lowbit fit MODEL`: a format per decoder-layer linear and a KV-cache format, chosen together from
measured sensitivity to fit a budget (app/fit_plan.py), printed as a table per layer and
written as a recipe that `lowbit run` quantizes, audits and exports in one checkpoint:
compressed-tensors with a config group per integer format (for vLLM and transformers), or one
GGUF file with a GGML type per tensor (for llama.cpp).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import yaml

from lowbit.calibrate.models import load_model
from lowbit.export.manifest import write_text_atomic
from lowbit.recipes.fit_config import FitConfig

from .fit_plan import FitResult, fit, plan_recipe


def add_parser(sub) -> None:
    p = sub.add_parser("fit", help="choose a format per linear and a KV format from measured sensitivity "
                       "to fit a budget")
    p.add_argument("model", help="built-in model name, local folder or hub id")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-bits-per-weight", type=float, metavar="BITS",
                        help="average bits per weight over the decoder-layer linears, e.g. 4.5")
    budget.add_argument("--memory", metavar="SIZE", help="device memory for weights, KV cache and workspace, "
                        "e.g. 8GB or 7.5GiB (with --context and --batch)")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (with --memory)")
    p.add_argument("--batch", type=int, default=1, help="sequences at once (with --memory)")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per forward (with --memory; default: the "
                   "largest of 512, 256, 128 at which a plan fits)")
    p.add_argument("--overhead", default="40MiB", help="the runtime's memory beyond tensors and workspace "
                   "(with --memory; default: lowbit's lean CPU runtime; e.g. 1GiB for vLLM)")
    p.add_argument("--format", choices=("compressed-tensors", "gguf"), default="compressed-tensors",
                   help="integer formats for vLLM/transformers, or GGML types for llama.cpp")
    p.add_argument("--types", help="candidate weight formats, comma-separated (default: compressed-tensors "
                   "int3_g64,int4_g64,int4_g128,int8,f16; gguf q4_0,q4_k,q5_0,q6_k,q8_0,f16)")
    p.add_argument("--kv-formats", help="candidate KV formats with --memory (default int4,int8,fp8,f16; "
                   "gguf: f16)")
    p.add_argument("--dataset", default="wiki", help="calibration text (built-in corpus, file or datasets name)")
    p.add_argument("--samples", type=int, default=2, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence")
    p.add_argument("--step", choices=("rtn", "gptq"), default="gptq", help="how the written recipe rounds")
    p.add_argument("--write", metavar="RECIPE.yaml", help="write the plan as a recipe for `lowbit run`")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(handler=cmd_fit, uses_cache=True)  # its sensitivities are cached


def _listed(text) -> tuple[str, ...]:
    return tuple(k.strip() for k in (text or "").split(",") if k.strip())


FLAGS = {"bits_per_weight": "--budget-bits-per-weight", "memory": "--memory", "context": "--context",
         "batch": "--batch", "prefill_chunk": "--prefill-chunk", "overhead": "--overhead", "types": "--types",
         "kv_formats": "--kv-formats", "samples": "--samples", "seq_len": "--seq-len"}  # FitConfig key -> flag


def fit_config(args) -> FitConfig:
    """The flags as a FitConfig, checked before the model loads and anything is measured; a refusal
    names the flag the user typed (FitConfig's messages start with the recipe key they are about)."""
    try:
        return FitConfig(format=args.format, bits_per_weight=args.budget_bits_per_weight, memory=args.memory,
                         context=args.context, batch=args.batch, prefill_chunk=args.prefill_chunk,
                         overhead=args.overhead, types=_listed(args.types), kv_formats=_listed(args.kv_formats),
                         dataset=args.dataset, samples=args.samples, seq_len=args.seq_len)
    except ValueError as err:
        raise ValueError(re.sub(r"^[a-z_]+", lambda key: FLAGS.get(key[0], key[0]), str(err))) from None


def cmd_fit(args) -> int:
    cfg = fit_config(args)
    model, tokenizer, _ = load_model(args.model, torch.float32)
    result = fit(model, tokenizer, args.model, cfg)
    summary = result.summary()
    if args.json:
        print(json.dumps({**summary, "types": {n: o.kind for n, o in result.plan.choice.items()}}))
    else:
        print_plan(result, model.config)
    if args.write:
        recipe = plan_recipe(cfg, result, args.model, args.step)
        write_text_atomic(Path(args.write), yaml.safe_dump(recipe, sort_keys=False, width=120))
        print(f"recipe      {args.write} (lowbit run {args.write})")
    return 0


def print_plan(result: FitResult, config) -> None:
    """A row per decoder layer (its MiB, predicted KL and formats), then the budget's split."""
    rows: dict[int, list] = {}
    for name, option in result.plan.choice.items():
        parts = name.split(".")
        index = next(int(p) for p in parts if p.isdigit())
        rows.setdefault(index, []).append((parts[-1], option))
    print(f"{'layer':>5}  {'MiB':>7}  {'KL sum':>9}  formats")
    for index, members in rows.items():
        mib = sum(o.bytes for _, o in members) / 2**20
        kl = sum(o.loss for _, o in members)
        print(f"{index:>5}  {mib:7.2f}  {kl:9.2e}  " + " ".join(f"{short}={o.kind}" for short, o in members))
    s = result.summary()
    split = s.get("memory_split")
    if split:
        print(f"memory      {split['memory'] / 2**20:.1f} MiB = linears {s['budget_bytes'] / 2**20:.1f} "
              f"+ KV cache {result.kv} {split['kv_cache'] / 2**20:.1f} ({split['batch']} x {split['context']} tokens) "
              f"+ workspace {split['workspace'] / 2**20:.1f} (prefill chunks of {split['prefill_chunk']}) "
              f"+ runtime overhead {split['overhead'] / 2**20:.1f} "
              f"+ other weights {split['other_weights'] / 2**20:.1f}")
        for t in s["kv_formats_tried"]:
            verdict = (f"predicted KL {t['predicted_kl_sum']:.4g}" if "predicted_kl_sum" in t
                       else "the linears' smallest plan does not fit")
            print(f"  kv {t['kv_format']:>5}  cache {t['kv_cache_bytes'] / 2**20:7.1f} MiB, linears "
                  f"{t['linears_budget'] / 2**20:7.1f} MiB: {verdict}")
    counts = ", ".join(f"{k} {n}" for k, n in sorted(s["type_counts"].items()))
    print(f"plan        {s['plan_bytes'] / 2**20:.2f} MiB of {s['budget_bytes'] / 2**20:.2f} MiB, "
          f"{s['bits_per_weight']:.3f} bits per weight over {s['linears']} linears ({counts}); KV cache {result.kv}")
    print(f"predicted   summed KL {s['predicted_kl_sum']:.4g} nats per token (weights {s['predicted_kl_weights']:.4g}, "
          f"KV {s['predicted_kl_kv']:.4g}; each measured alone, added); no plan within "
          f"{s['solver_slack_bytes'] / 2**10:.1f} KiB less budget does better")
