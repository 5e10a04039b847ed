"""Hessians of routed experts: every expert gets one, and one that too few calibration tokens
reached is solved against a stand-in (the identity: GPTQ then rounds to nearest) and named.

Without this an expert the router never picked had no Hessian, was never solved and stayed float;
one that saw a handful of tokens would be fitted to them."""
from __future__ import annotations

import sys

import torch
from torch import nn

from lowbit.calibrate.experts import calibration_settings
from lowbit.quantize.steps.gptq_solver import HessianAccumulator


INPUT_SHARED = ("gate_proj", "up_proj")  # an expert's projections that read its input


class StandInHessian:
    """The identity in an accumulator's place: with H = I GPTQ carries no error between columns."""

    def __init__(self, columns: int, tokens: int, device):
        self.columns, self.tokens, self.device = columns, tokens, device

    def take(self) -> torch.Tensor:
        return torch.eye(self.columns, dtype=torch.float32, device=self.device)

    matrix = take


def routed_names(layer: nn.Module, names: list[str]) -> set[str]:
    return {n for n in names if getattr(layer.get_submodule(n), "inputs_masked", False)}


def complete(layer: nn.Module, names: list[str], hessians: dict, sharing: dict) -> tuple[dict, dict]:
    """Every name in `names` covered (an expert no token reached gets an empty accumulator, its gate
    and up projections one, as they share one where tokens reached it), leads in the order of
    `names`: the same accumulators in the same order on every rank."""
    covered = {n for members in sharing.values() for n in members}
    empty: dict[str, str] = {}  # expert module -> the lead of its gate/up accumulator added here
    for name in names:
        if name in covered:
            continue
        parent, _, projection = name.rpartition(".")
        if projection in INPUT_SHARED and parent in empty:
            sharing[empty[parent]].append(name)
            continue
        weight = layer.get_submodule(name).weight
        hessians[name] = HessianAccumulator(weight.shape[1], device=_device(weight))
        sharing[name] = [name]
        if projection in INPUT_SHARED:
            empty[parent] = name
    order = {n: k for k, n in enumerate(names)}
    leads = sorted(sharing, key=order.__getitem__)
    return {n: hessians[n] for n in leads}, {n: sharing[n] for n in leads}


def stand_in_starved(prefix: str, layer: nn.Module, hessians: dict, sharing: dict,
                     seen: dict[str, int]) -> dict[str, str]:
    """Replace the Hessian of every routed expert's linear that saw fewer than the recipe's
    `calibration.moe_min_tokens` tokens; full name -> the fallback, as the run records it. `seen`
    gets each expert linear's calibration token count."""
    floor = calibration_settings().min_tokens
    routed = routed_names(layer, [n for members in sharing.values() for n in members])
    fallbacks = {}
    for lead, members in sharing.items():
        acc = hessians[lead]
        if lead in routed:
            seen.update({f"{prefix}.{name}": acc.tokens for name in members})
        if lead in routed and acc.tokens < floor:
            hessians[lead] = StandInHessian(acc.columns, acc.tokens, acc.device)
            why = (f"round-to-nearest (identity Hessian): {acc.tokens} calibration tokens reached it, "
                   f"calibration.moe_min_tokens is {floor}")
            for name in members:
                fallbacks[f"{prefix}.{name}"] = why
                print(f"[gptq] {prefix}.{name}: {why}", file=sys.stderr)
    return fallbacks


def _device(weight: torch.Tensor):
    return None if weight.is_meta else weight.device


class SharedHessian:
    """One matrix for several solves: formed from the accumulator at the first take, handed to each
    (the solver reads H and factors a copy of its own)."""

    def __init__(self, accumulator):
        self.accumulator, self.columns, self.tokens = accumulator, accumulator.columns, accumulator.tokens
        self.device, self.H = accumulator.device, None

    def take(self) -> torch.Tensor:
        if self.H is None:
            self.H = self.accumulator.take()
        return self.H

    matrix = take


def one_expert_per_solve(hessians: dict, sharing: dict) -> tuple[dict, dict]:
    """Split a Hessian that several experts share (under all_experts every expert's gate and up see
    the same tokens) into one solve per expert over the one matrix: a stacked solve of every expert
    of a Qwen3-30B-A3B layer would hold 128 x 2 x 768 x 2048 float32 weights (1.6 GB) at once."""
    out_h, out_s = {}, {}
    for lead, members in sharing.items():
        by_expert: dict[str, list[str]] = {}
        for name in members:
            by_expert.setdefault(name.rpartition(".")[0] if _is_expert(name) else "", []).append(name)
        if len(by_expert) == 1:
            out_h[lead], out_s[lead] = hessians[lead], members
            continue
        shared = SharedHessian(hessians[lead])
        for group in by_expert.values():
            out_h[group[0]], out_s[group[0]] = shared, group
    return out_h, out_s


def _is_expert(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 3 and parts[-3] == "experts" and parts[-2].isdigit()
