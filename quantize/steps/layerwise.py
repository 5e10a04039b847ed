"""The layer walk that Hessian-based steps share (gptq, fp8 with GPTQ rounding): per decoder layer
and linear group, record the inputs' Hessians, let the step solve, replace the linears, feed the
quantized layer's outputs to the next one."""
from __future__ import annotations

import sys
import time
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from lowbit.calibrate.distributed import all_sum, round_robin, sum_int, world
from lowbit.calibrate.experts import take_routed_tokens
from lowbit.calibrate.hardware import cpu_info, return_freed_memory
from lowbit.calibrate.walker import WhileAlive, record_linear_inputs, walk
from lowbit.quantize.steps import expert_hessians
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.gptq_solver import HessianAccumulator
from lowbit.calibrate.arch import linear_weight
from lowbit.calibrate.checks import largest_value
from lowbit.quantize.runtime.modules import module_for
from lowbit.quantize.targets import replace_module

if TYPE_CHECKING:
    from lowbit.quantize.steps.gptq import GPTQConfig


def resolve_forward_dtype(name: str, device) -> torch.dtype:
    """The dtype `auto` stands for on this device. On a CPU calibrate.hardware decides (not
    torch's mkldnn check, which says yes on any AVX-512 CPU, where bf16 may be emulated)."""
    if name != "auto":
        return getattr(torch, name)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and cpu_info().bf16_native:
        return torch.bfloat16
    return torch.float32


def walk_solving(ctx: StepContext, cfg: GPTQConfig, targets, solve, install) -> tuple[list[dict], str]:
    """Walk the decoder layers; per linear group, record its inputs' Hessians (summed over all
    ranks' samples), then per set of linears sharing one input: result = solve(prefix, layer,
    names, H), pure, on one rank (round-robin), its result sent to all; then on every rank
    install(prefix, layer, names, result, stats) -> {name: replacement module}. Each solved linear
    is replaced at once (with cfg.true_sequential, once all the layer's groups are solved: install
    must also write the rounded values into the float linears, so that later groups record what
    they will see), and the layer's quantized outputs feed the next layer. Each replaced linear
    leaves targets.linears. Returns the per-layer records and the forwards' dtype."""

    source = ctx.layer_source
    fetch, settle = getattr(source, "fetch", None), getattr(source, "settle", None)  # streamed: deferred experts

    def solve_trimmed(prefix, layer, unit):
        # glibc keeps the freed blocks of the forwards and the smaller solves (tensors of 1-32 MiB sit
        # below its self-raising mmap threshold) in its heap: given back first, down_proj's factorisation
        # does not stack on them
        return_freed_memory()
        if fetch is not None:
            fetch(layer, unit[0])
        return solve(prefix, layer, *unit)

    def on_layer(i, prefix, layer, inputs):
        start = time.perf_counter()
        names = [n for n in ctx.arch.linears if f"{prefix}.{n}" in targets.linears]
        groups = [[n for n in g if n in names] for g in ctx.arch.groups] if cfg.true_sequential else [names]
        stats: dict = {}
        solved: dict[str, nn.Module] = {}
        fallbacks: dict[str, str] = {}
        routed: dict[str, list[int]] = {}
        seen: dict[str, int] = {}

        def install_unit(unit, result):
            modules = install(prefix, layer, unit[0], result, stats)
            if cfg.true_sequential:  # later groups record their inputs through the float linears
                solved.update(modules)
                return
            for name, module in modules.items():  # every Hessian is recorded: the float linear can go now,
                let_go(prefix, layer, name, module)  # before down_proj's solve (0.6 GiB at Llama-3-8B widths)

        for group in filter(None, groups):
            hessians, sharing = collect_hessians(layer, group, inputs, ctx.device, prefix=prefix)
            routed.update(take_routed_tokens(layer, prefix))
            fallbacks.update(expert_hessians.stand_in_starved(prefix, layer, hessians, sharing, seen))
            hessians, sharing = expert_hessians.one_expert_per_solve(hessians, sharing)
            units = [(members, hessians.pop(lead)) for lead, members in sharing.items()]
            _smallest_first(units, lambda unit: solve_trimmed(prefix, layer, unit), install_unit)
        for name, module in solved.items():
            let_go(prefix, layer, name, module)
        if settle is not None:
            settle(layer)
        stats = {n: stats[n] for n in names if n in stats}  # the layer's order, not the solves'
        record = {"layer": prefix, "seconds": round(time.perf_counter() - start, 3),
                  "linears": {f"{prefix}.{n}": s for n, s in stats.items()}}
        if seen:  # a mixture of experts: what the router sent each, what its statistics saw, fallbacks
            record["routed_tokens"] = routed
            record["expert_statistics_tokens"] = seen
            record["expert_fallbacks"] = fallbacks
        return record

    def let_go(prefix, layer, name, module):
        replace_module(layer, name, module)
        # the float module is let go with the layer: streamed, a layer's float32 weights (0.87 GB at
        # Llama-3-8B widths) were otherwise kept by targets for the whole walk, one more per layer
        del targets.linears[f"{prefix}.{name}"]

    forward_dtype = resolve_forward_dtype(cfg.forward_dtype, ctx.device)
    name = str(forward_dtype).removeprefix("torch.")
    device = torch.device(ctx.device)
    where = f"CPU: {cpu_info().describe()}" if device.type == "cpu" else str(device)
    print(f"[gptq] forward dtype {name} ({cfg.forward_dtype} on {where})", file=sys.stderr)
    layers = walk(ctx.model, ctx.arch, ctx.batches, on_layer, device=ctx.device, label="gptq",
                  micro_batch=cfg.micro_batch, forward_dtype=forward_dtype, final_outputs=False,
                  store=ctx.layer_store, source=ctx.layer_source, offload=ctx.offload)
    return list(layers), name


def outside_layers(ctx: StepContext, targets) -> dict[str, nn.Module]:
    """The targets no decoder layer holds (lm_head): a layer walk never sees their inputs."""
    return {n: m for n, m in targets.linears.items() if not n.startswith(ctx.arch.layers + ".")}


def round_outside(ctx: StepContext, outside: dict[str, nn.Module], grids: dict, method: str) -> None:
    """Each of them rounded to nearest onto its grid, with a warning naming the method it did not get."""
    for name, module in outside.items():
        warnings.warn(f"{name} is outside the decoder layers; quantized round-to-nearest, not {method}")
        replace_module(ctx.model, name, module_for(grids[name].round(linear_weight(module), name), module.bias))


def _smallest_first(units: list, solve, install) -> None:
    """install(unit, solve(unit)) for every unit, the smallest Hessian first. Each solve takes its
    Hessian and frees it, and (one rank, no true_sequential) install lets the solved float linears
    go: by the time down_proj's f x f matrix is factored with its working copy (the step's peak),
    the layer's other Hessians and float weights are gone. Largest first kept three h x h float64
    sums and five float32 weights beside it (0.8 GiB at Llama-3-8B widths). Across ranks the
    solves run round-robin and every rank installs every result, in the same order."""
    order = sorted(range(len(units)), key=lambda k: units[k][1].columns)  # stable: ties keep their order
    if world().size == 1:
        for k in order:
            install(units[k], solve(units[k]))
        return
    results = round_robin([units[k] for k in order], solve)
    for k, result in zip(order, results):
        install(units[k], result)


def linear_stats(row_loss: torch.Tensor, dampening_frac: float, retries: int, seconds: float) -> dict:
    """One linear's record in a layer's "linears" (damping_retries and the report read it)."""
    return {"loss": float(row_loss.sum()), "dampening_frac": dampening_frac, "retries": retries,
            "seconds": round(seconds, 4)}


def damping_retries(layers) -> list[dict]:
    return [{"linear": n, "dampening_frac": s["dampening_frac"]}
            for layer in layers for n, s in layer["linears"].items() if s["retries"]]


def collect_hessians(layer: nn.Module, names: list[str], inputs, device, outputs=None, prefix: str = ""):
    """Hessians of the named linears' inputs, one per distinct input; and lead -> names sharing it.
    With `outputs`, the layer's outputs of the same forward are appended to it (record_linear_inputs).
    `prefix`: the layer's name, which a refused Hessian's message gives."""
    hessians: dict[str, HessianAccumulator] = {}
    sharing: dict[str, list[str]] = {}
    lead_of = WhileAlive()  # an input tensor -> the linear whose Hessian took it

    def record(name: str, x2d: torch.Tensor) -> None:
        # the walker hands linears fed the same tensor the same object: q/k/v, gate/up, and under
        # all_experts every expert's gate/up, though each expert's down_proj runs between them
        # (one accumulator per expert held 2.7 GB of float64 at Qwen3-30B-A3B widths)
        lead = lead_of.get(x2d)
        if lead is not None:
            if name not in sharing[lead]:
                sharing[lead].append(name)
            return
        if name not in hessians:
            hessians[name] = HessianAccumulator(x2d.shape[1], device=x2d.device)
            sharing[name] = [name]
        hessians[name].add(x2d)
        lead_of.put(x2d, name)

    record_linear_inputs(layer, names, inputs, device, record, outputs)
    hessians, sharing = expert_hessians.complete(layer, names, hessians, sharing)
    for accumulator in hessians.values():  # the same order on every rank
        merge_ranks(accumulator)
    check_hessians(layer, hessians, sharing, prefix)  # merged: every rank refuses alike
    return hessians, sharing


def check_hessians(layer: nn.Module, hessians: dict, sharing: dict, prefix: str) -> None:
    """Refuse, naming the linears, an input Hessian that overflowed float32: the solve would retry
    its damping up to 1000 and say only "not positive definite". Inputs that large come from an
    outsize weight, most often in the layer itself (a norm's scale, up_proj before down_proj)."""
    for lead, accumulator in hessians.items():
        if accumulator.finite():
            continue
        names = ", ".join(f"{prefix}.{n}" if prefix else n for n in sharing[lead])
        source, value = largest_value(layer)
        raise ValueError(f"{names}: the Hessian of their calibration inputs (XᵀX) overflows float32, so GPTQ "
                         f"cannot solve it: the inputs are too large for their squares' sums to stay under "
                         f"{torch.finfo(torch.float32).max:.2g}. The layer's largest weight is "
                         f"{prefix + '.' if prefix else ''}{source} at {value:g}: fix that source weight "
                         "(the checkpoint is corrupt or diverged)")


def merge_ranks(acc: HessianAccumulator) -> None:
    """acc becomes the Hessian of every rank's tokens: the float64 sums and the token counts added
    (never a mean of means); H is formed from them once, when taken."""
    if world().size == 1:
        return
    acc.tokens = sum_int(acc.tokens)
    acc.sums = [all_sum(block) for block in acc.sums]
