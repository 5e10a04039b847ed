"""`lowbit fit MODEL`: a GGML type per decoder-layer linear, chosen from measured sensitivity to
fit a budget, written as a recipe that `lowbit run` quantizes and exports as one GGUF file.

The budget is bits per weight over the decoder-layer linears, or a device's memory at a context
length and batch: then the 16-bit KV cache, the prefill workspace and the tensors outside the
linears (token embedding at llama.cpp's type for it, norms, an untied output) come off first.
Sensitivities (evaluate/sensitivity.py) are cached per model, calibration text and candidate
types, so a second budget on the same model costs only the solve.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import torch
import yaml

from lowbit.calibrate.arch import arch_for, linear_weight, target_linears
from lowbit.calibrate.cache import cache_dir
from lowbit.calibrate.data import CalibrationConfig, calibration_batches
from lowbit.calibrate.models import load_model
from lowbit.evaluate import sensitivity
from lowbit.evaluate.allocation import Plan, allocate
from lowbit.evaluate.memory import ModelShape, activation_bytes, kv_cache_bytes
from lowbit.export.manifest import write_text_atomic
from lowbit.quantize.grids.gguf import LAYOUTS
from lowbit.quantize.grids.gguf_plan import F16, GGUFTypes, embedding_type, output_type

BASE_FILE_TYPE = "q4_k_m"  # the file type whose rules give the embedding and output their types
SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B)\s*$", re.IGNORECASE)
SIZE_UNITS = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
CACHE_VERSION = "gguf-kl-v1"  # bump when the measurement changes


def add_parser(sub) -> None:
    fit = sub.add_parser("fit", help="choose a GGML type per linear from measured sensitivity to fit a budget")
    fit.add_argument("model", help="built-in model name, local folder or hub id")
    budget = fit.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-bits-per-weight", type=float, metavar="BITS",
                        help="average bits per weight over the decoder-layer linears, e.g. 4.5")
    budget.add_argument("--memory", metavar="SIZE", help="device memory for weights, KV cache and workspace, "
                        "e.g. 8GB or 7.5GiB (with --context and --batch)")
    fit.add_argument("--context", type=int, default=4096, help="tokens per sequence (with --memory)")
    fit.add_argument("--batch", type=int, default=1, help="sequences at once (with --memory)")
    fit.add_argument("--types", default=",".join(sensitivity.CANDIDATES),
                     help=f"candidate types (default {','.join(sensitivity.CANDIDATES)})")
    fit.add_argument("--dataset", default="wiki", help="calibration text (built-in corpus, file or datasets name)")
    fit.add_argument("--samples", type=int, default=2, help="calibration sequences")
    fit.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence")
    fit.add_argument("--step", choices=("rtn", "gptq"), default="rtn", help="how the written recipe rounds")
    fit.add_argument("--write", metavar="RECIPE.yaml", help="write the plan as a recipe for `lowbit run`")
    fit.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    fit.set_defaults(handler=cmd_fit)


def cmd_fit(args) -> int:
    kinds = tuple(k.strip() for k in args.types.split(",") if k.strip())
    bad = [k for k in kinds if k not in LAYOUTS and k != F16]
    if bad or not kinds:
        raise ValueError(f"--types {args.types!r}: {', '.join(bad) or 'none given'}; valid: {', '.join(sorted(LAYOUTS))}, {F16}")
    model, tokenizer, _ = load_model(args.model, torch.float32)
    arch = arch_for(model)
    calibration = CalibrationConfig(args.dataset, args.samples, args.seq_len)
    options = sensitivity.linear_options(model, arch, kinds)
    losses, cached = _sensitivities(model, arch, tokenizer, args.model, calibration, options)
    choices = {name: [sensitivity.Option(k, b, losses[name][k]) for k, b in by_kind.items()]
               for name, by_kind in options.items()}
    params = sum(linear_weight(module).numel() for module in target_linears(model, arch).values())
    budget, accounting = _budget_bytes(args, model, params)
    plan = allocate(choices, budget)
    summary = _summary(plan, params, accounting, cached)
    if args.json:
        print(json.dumps({**summary, "types": {n: o.kind for n, o in plan.choice.items()}}))
    else:
        _print_plan(plan, arch.layers, summary)
    if args.write:
        _write_recipe(Path(args.write), args, plan, summary)
        print(f"recipe      {args.write} (lowbit run {args.write})")
    return 0


def _sensitivities(model, arch, tokenizer, name: str, calibration, options) -> tuple[dict, bool]:
    """{linear: {type: KL}} from the cache, else measured and cached; and whether it was cached."""
    key = _cache_key(model, name, calibration, options)
    path = cache_dir("sensitivity") / f"{key}.json"
    if path.is_file():
        print(f"[lowbit] fit: sensitivities from the cache ({path})", file=sys.stderr)
        return json.loads(path.read_text())["losses"], True
    batches = calibration_batches(calibration, tokenizer)
    losses = sensitivity.measure(model, arch, batches, options)
    write_text_atomic(path, json.dumps({"model": name, "calibration": vars(calibration), "losses": losses}))
    return losses, False


def _cache_key(model, name: str, calibration, options) -> str:
    """The model (its config and a checksum of every parameter), the calibration and the options."""
    digest = hashlib.sha256()
    digest.update(json.dumps([CACHE_VERSION, name, model.config.to_json_string(), vars(calibration),
                              options], sort_keys=True, default=str).encode())
    with torch.no_grad():
        for pname, p in model.named_parameters():
            digest.update(f"{pname} {float(p.double().sum())} {float(p.double().abs().sum())}".encode())
    return digest.hexdigest()[:24]


def parse_size(text: str) -> int:
    match = SIZE.match(text)
    if not match:
        raise ValueError(f"--memory {text!r}: give a size such as 8GB, 256MB or 7.5GiB")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def _budget_bytes(args, model, params: int) -> tuple[int, dict]:
    """The bytes the linears may take, and how a memory budget was split."""
    if args.budget_bits_per_weight is not None:
        if args.budget_bits_per_weight <= 0:
            raise ValueError(f"--budget-bits-per-weight must be positive, got {args.budget_bits_per_weight}")
        return int(args.budget_bits_per_weight * params / 8), {}
    shape = ModelShape.from_config(model.config)
    split = {"memory": parse_size(args.memory), "context": args.context, "batch": args.batch,
             "kv_cache_16bit": kv_cache_bytes(shape, args.context, args.batch, 2),
             "workspace": activation_bytes(shape, args.batch, args.context, 4),
             "other_weights": _other_weight_bytes(model)}
    left = split["memory"] - split["kv_cache_16bit"] - split["workspace"] - split["other_weights"]
    if left <= 0:
        raise ValueError(f"--memory {args.memory}: the 16-bit KV cache ({split['kv_cache_16bit'] / 2**20:.1f} MiB), "
                         f"workspace ({split['workspace'] / 2**20:.1f} MiB) and the weights outside the linears "
                         f"({split['other_weights'] / 2**20:.1f} MiB) leave nothing for the linears; "
                         "lower --context or --batch")
    return left, split


def _other_weight_bytes(model) -> int:
    """The file's tensors outside the decoder-layer linears: the token embedding (and an untied
    output) at llama.cpp's types for the base file type, everything else float32 (norms, biases)."""
    arch = arch_for(model)
    linear_ids = {id(m.weight) for m in target_linears(model, arch).values()}
    types = GGUFTypes(BASE_FILE_TYPE)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    total = _typed_bytes(embed, embedding_type(types, embed.shape[1], tied))
    if head is not None and not tied:
        total += _typed_bytes(head.weight, output_type(types, head.weight.shape[1]))
    skip = linear_ids | {id(embed)} | ({id(head.weight)} if head is not None else set())
    total += sum(p.numel() * 4 for p in model.parameters() if id(p) not in skip)
    return total


def _typed_bytes(weight: torch.Tensor, kind) -> int:
    rows, cols = weight.shape
    return sensitivity.type_bytes(kind or F16, rows, cols)


def _summary(plan: Plan, params: int, accounting: dict, cached: bool) -> dict:
    counts: dict[str, int] = {}
    for option in plan.choice.values():
        counts[option.kind] = counts.get(option.kind, 0) + 1
    return {"linears": len(plan.choice), "params": params, "budget_bytes": plan.budget,
            "plan_bytes": plan.bytes, "bits_per_weight": plan.bytes * 8 / params,
            "predicted_kl_sum": plan.loss, "solver_slack_bytes": plan.slack, "type_counts": counts,
            "sensitivities_cached": cached, **({"memory_split": accounting} if accounting else {})}


def _print_plan(plan: Plan, layers_path: str, summary: dict) -> None:
    rows: dict[int, list] = {}
    prefix = layers_path + "."
    for name, option in plan.choice.items():
        index = int(name[len(prefix):].split(".")[0])
        rows.setdefault(index, []).append((name[len(prefix):].split(".", 1)[1], option))
    print(f"{'layer':>5}  {'MiB':>7}  {'KL sum':>9}  types")
    for index, members in rows.items():
        mib = sum(o.bytes for _, o in members) / 2**20
        kl = sum(o.loss for _, o in members)
        types = " ".join(f"{short.rpartition('.')[2]}={o.kind}" for short, o in members)
        print(f"{index:>5}  {mib:7.2f}  {kl:9.2e}  {types}")
    split = summary.get("memory_split")
    if split:
        print(f"memory      {split['memory'] / 2**20:.1f} MiB = linears {summary['budget_bytes'] / 2**20:.1f} "
              f"+ KV cache 16-bit {split['kv_cache_16bit'] / 2**20:.1f} ({split['batch']} x {split['context']} tokens) "
              f"+ workspace {split['workspace'] / 2**20:.1f} + other weights {split['other_weights'] / 2**20:.1f}")
    counts = ", ".join(f"{k} {n}" for k, n in sorted(summary["type_counts"].items()))
    print(f"plan        {summary['plan_bytes'] / 2**20:.2f} MiB of {summary['budget_bytes'] / 2**20:.2f} MiB, "
          f"{summary['bits_per_weight']:.3f} bits per weight over {summary['linears']} linears ({counts})")
    print(f"predicted   summed KL {summary['predicted_kl_sum']:.4g} nats per token (each linear's own, "
          f"added); no plan within {summary['solver_slack_bytes'] / 2**10:.1f} KiB less budget does better")


def _write_recipe(path: Path, args, plan: Plan, summary: dict) -> None:
    step = {"rtn": {}} if args.step == "rtn" else {
        "gptq": {"actorder": "static", "true_sequential": False, "dampening_frac": 0.1, "scale_search": "mse"}}
    recipe = {
        "description": (f"lowbit fit: {summary['bits_per_weight']:.3f} bits per weight over the decoder-layer "
                        f"linears, predicted summed KL {summary['predicted_kl_sum']:.4g}"),
        "model": args.model,
        "calibration": {"dataset": args.dataset},
        "scheme": {"gguf": BASE_FILE_TYPE, "types": {n: o.kind for n, o in plan.choice.items()}},
        "steps": [step],
        "export": {"format": "gguf"},
    }
    write_text_atomic(path, yaml.safe_dump(recipe, sort_keys=False, width=120))
