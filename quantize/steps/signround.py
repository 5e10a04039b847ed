"""signround: rounding learned per decoder layer (SignRound, Cheng et al. 2023; Intel's AutoRound).

Each layer in turn: its float outputs on the inputs the quantized layers before it hand on are the
target (with target: model, the float model's own hidden states after the layer); every targeted
linear gets its grid's learned view (an offset per weight before rounding, and on integer grids a
clipping factor per group) and `iterations` steps of signed gradient descent, one batch of
calibration samples each, with a learning rate falling linearly to 0, move them so that the
quantized layer's output matches the target (mean squared error). The parameters of the step with
the lowest loss are kept; the linears become the runtime modules of the learned weights, so every
export and the audit apply unchanged. With several ranks each runs its own samples and the
gradients and losses are summed before each step, so every rank learns the same weights.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.calibrate.arch import linear_weight
from lowbit.calibrate.distributed import all_sum, ranks_agree, world
from lowbit.calibrate.hardware import denormals_flushed
from lowbit.calibrate.walker import first_output, forward_context, layer_forward, to_device, walk
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.learned import VIEWS, learnable, learned_view
from lowbit.quantize.grids.linear import LinearScheme, Plan
from lowbit.quantize.runtime import cpu_kernels
from lowbit.quantize.runtime.buffers import on_device
from lowbit.quantize.runtime.modules import module_for
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.layerwise import collect_hessians, outside_layers, resolve_forward_dtype, round_outside
from lowbit.quantize.steps.signround_start import gptq_views, refuse_unstartable
from lowbit.quantize.steps.spec import WALK, StepSpec
from lowbit.quantize.targets import planned_targets, replace_module


@dataclass(frozen=True)
class SignRoundConfig:
    scheme: Plan = IntScheme(4, True, "group", 128)
    iterations: int = 200  # signed-gradient steps per decoder layer
    learning_rate: Optional[float] = None  # the first step's size (None: 1 / iterations); falls linearly to 0
    batch: int = 8  # calibration samples per step (and per forward)
    seed: int = 0  # the order batches are drawn in
    forward_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # as gptq's: autocast for the forwards
    # what a quantized layer must reproduce: "layer", the float layer's output on the quantized stream
    # (GPTQ's target); "model", the float model's own hidden states after the layer (AutoRound's), so a
    # layer also learns to make up for the error of the layers before it
    target: Literal["layer", "model"] = "layer"
    # where the offsets start: "nearest", the float weights (SignRound's own start); "gptq", each layer's
    # linears first solved by GPTQ on the Hessians of the same forward that makes the target, the offsets
    # then moving around the weights GPTQ rounded and a factor on each group's GPTQ scale (integer grids)
    start: Literal["nearest", "gptq"] = "nearest"
    WRITTEN_WHEN_SET = ("target", "start")  # recipes written before the option keep their recipe.yaml

    def __post_init__(self):
        if self.iterations < 1 or self.batch < 1:
            raise ValueError(f"signround: iterations and batch must be positive, got {self.iterations}, {self.batch}")
        if self.learning_rate is not None and not 0 < self.learning_rate <= 1:
            raise ValueError(f"signround: learning_rate must be in (0, 1], got {self.learning_rate}")
        if self.forward_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"signround: forward_dtype must be auto, bfloat16 or float32, got {self.forward_dtype!r}")
        if self.target not in ("layer", "model"):
            raise ValueError(f"signround: target must be layer or model, got {self.target!r}")
        if self.start not in ("nearest", "gptq"):
            raise ValueError(f"signround: start must be nearest or gptq, got {self.start!r}")

    @property
    def first_rate(self) -> float:
        return self.learning_rate if self.learning_rate is not None else 1.0 / self.iterations


def apply(ctx: StepContext, cfg: SignRoundConfig) -> dict:
    targets, grids = planned_targets(ctx.model, ctx.arch, ctx.ignore, cfg.scheme)
    refuse_unlearnable(grids)
    if cfg.start == "gptq":
        refuse_unstartable(grids)
    outside = outside_layers(ctx, targets)
    forward_dtype = resolve_forward_dtype(cfg.forward_dtype, ctx.device)
    print(f"[signround] {cfg.iterations} steps per layer, batches of {cfg.batch}, first step "
          f"{cfg.first_rate:g}, forwards in {str(forward_dtype).removeprefix('torch.')}", file=sys.stderr)

    stream = FloatStream() if cfg.target == "model" else None

    def on_layer(i, prefix, layer, inputs):
        names = [n for n in ctx.arch.linears if f"{prefix}.{n}" in targets.linears]
        into = ctx.offload.new() if ctx.offload else None  # where the walk's own activations wait
        wanted, hessians = None, None
        if stream is not None:  # the float model's states after this layer, before it is quantized
            wanted = layer_forward(layer, stream.entering(i, prefix, inputs), ctx.device, into)
            stream.hidden = wanted
        elif names and cfg.start == "gptq":  # one forward: the target and GPTQ's Hessians
            wanted = [] if into is None else into
            hessians = collect_hessians(layer, names, inputs, ctx.device, outputs=wanted, prefix=prefix)
        elif names:
            wanted = layer_forward(layer, inputs, ctx.device, into)  # the float layer on the quantized stream
        if names and cfg.start == "gptq" and hessians is None:
            hessians = collect_hessians(layer, names, inputs, ctx.device, prefix=prefix)
        record = learn_layer(prefix, layer, names, grids, inputs, wanted, cfg, ctx.device, hessians)
        for name in names:
            del targets.linears[f"{prefix}.{name}"]
        return record

    with denormals_flushed():
        layers = walk(ctx.model, ctx.arch, ctx.batches, on_layer, device=ctx.device, label="signround",
                      micro_batch=cfg.batch, forward_dtype=forward_dtype, final_outputs=False,
                      store=ctx.layer_store, source=ctx.layer_source, offload=ctx.offload)
    round_outside(ctx, outside, grids, "signround")  # lm_head sees no decoder-layer output to match
    return {"quantized": list(grids), "ignored": targets.ignored, "round_to_nearest": list(outside),
            "forward_dtype": str(forward_dtype).removeprefix("torch."), **cfg.scheme.record(grids),
            "layers": list(layers)}


def refuse_unlearnable(grids: dict) -> None:
    """Stop before any weight changes where a linear's grid has no learned view."""
    for name, grid in grids.items():
        if not learnable(grid):
            raise ValueError(f"signround: {name} is planned onto {grid.describe()}, which has no learned rounding "
                             f"yet (signround learns on: {', '.join(sorted(VIEWS))} grids); use gptq or rtn for it")


class FloatStream:
    """The float model's hidden states entering each layer (target: model), carried beside the walk's
    quantized ones: at the first layer they are the same."""

    def __init__(self):
        self.hidden = None

    def entering(self, index: int, prefix: str, inputs):
        if self.hidden is None:
            if index != 0:  # a resumed walk starts past layer 0, where only the quantized stream was saved
                raise ValueError(f"signround: target model cannot resume at {prefix}: the float model's hidden "
                                 "states are not saved with the run; rerun from the start or use target: layer")
            self.hidden = inputs.hidden  # the walk replaces its containers, never refills them
        return dataclasses.replace(inputs, hidden=self.hidden)


def learn_layer(prefix: str, layer: nn.Module, names: list[str], grids: dict, inputs, wanted,
                cfg: SignRoundConfig, device, hessians=None) -> dict:
    """Learn the rounding of the layer's named linears so that the layer's output on `inputs` matches
    `wanted` (per micro-batch: a list, or a container like the walk's activations), then replace them.
    With start gptq, `hessians` are collect_hessians' of the named linears on `inputs`."""
    start = time.perf_counter()
    if not names:
        return {"layer": prefix, "seconds": 0.0, "linears": []}
    modules = {n: layer.get_submodule(n) for n in names}
    fallbacks = {}
    if cfg.start == "gptq":
        views, fallbacks = gptq_views(prefix, layer, grids, *hessians, device)
    else:
        views = {n: learned_view(grids[f"{prefix}.{n}"], linear_weight(m).to(device)) for n, m in modules.items()}
    fuse_fake_weights(views, device)
    with learning(layer, modules, views):
        losses = descend(layer, views, inputs, wanted, cfg, device)
    check_ranks_agree(prefix, views)
    for name, module in modules.items():
        weight = linear_weight(module)
        replace_module(layer, name, module_for(on_device(views[name].weight(), weight.device), module.bias))
    seconds = time.perf_counter() - start
    print(f"[signround] {prefix}: loss {losses['first']:.3g} -> {losses['best']:.3g} (best of "
          f"{cfg.iterations} steps, {seconds:.1f} s)", file=sys.stderr)
    record = {"layer": prefix, "seconds": round(seconds, 3), "linears": [f"{prefix}.{n}" for n in names], **losses}
    return {**record, "expert_fallbacks": fallbacks} if fallbacks else record


def fuse_fake_weights(views: dict, device=None) -> None:
    """On a CPU, views that have a compiled fake_weight (the integer grid's) use it from this CPU's
    kernel module: at one sample per step, fake_weight's torch calls took about 40% of each step."""
    if torch.device(device or "cpu").type != "cpu":
        return
    fusable = [view for view in views.values() if hasattr(view, "fuse")]
    kernel = cpu_kernels.load() if fusable else None
    for view in fusable:
        view.fuse(kernel)


class learning:
    """Within it each named linear computes with its view's fake_weight(), and the layer's own
    parameters take no gradient."""

    def __init__(self, layer: nn.Module, modules: dict, views: dict):
        self.layer, self.modules, self.views = layer, modules, views

    def __enter__(self):
        self.trained = [p for p in self.layer.parameters() if p.requires_grad]
        for p in self.trained:
            p.requires_grad_(False)
        for name, module in self.modules.items():
            view = self.views[name]
            module.forward = lambda x, view=view, bias=module.bias: F.linear(x, view.fake_weight().to(x.dtype), bias)
        return self

    def __exit__(self, *exc):
        for module in self.modules.values():
            del module.forward  # back to the class's forward
        for p in self.trained:
            p.requires_grad_(True)


def descend(layer, views: dict, inputs, wanted: list[torch.Tensor], cfg: SignRoundConfig, device) -> dict:
    """cfg.iterations signed-gradient steps on the views' parameters; leaves them at the step whose
    loss was lowest. Returns the first and best losses."""
    params = [p for view in views.values() for p in view.parameters()]
    best, best_params, first = math.inf, None, None
    order = batch_order(len(inputs.hidden), cfg.iterations, cfg.seed)
    for step, k in enumerate(order):
        with torch.enable_grad():
            loss, tokens = batch_loss(layer, inputs, wanted, k, device)
            grads = torch.autograd.grad(loss, params)
        total, tokens = summed_loss(loss.detach(), tokens)
        if first is None:
            first = total
        if total < best:  # these parameters gave this loss: keep them before the step moves them
            best, best_params = total, [p.detach().clone() for p in params]
        rate = cfg.first_rate * (1 - step / cfg.iterations)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(summed(g).sign(), alpha=-rate)  # p - rate * sign(g), bit for bit, in one pass fewer
        for view in views.values():
            view.keep_in_range()
    with torch.no_grad():
        for p, kept in zip(params, best_params):
            p.copy_(kept)
    return {"first": first, "best": best}


def batch_order(batches: int, iterations: int, seed: int) -> list[int]:
    """Which batch each step uses: every batch once per pass, each pass in a fresh order."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < iterations:
        order += torch.randperm(batches, generator=gen).tolist()
    return order[:iterations]


def batch_loss(layer, inputs, wanted: list[torch.Tensor], k: int, device) -> tuple[torch.Tensor, int]:
    """Mean squared error of the layer's output against the wanted one on batch k (real tokens
    only), and how many tokens it averaged."""
    with forward_context(inputs, device):
        out = first_output(layer(to_device(inputs.hidden[k], device), **to_device(inputs.kwargs[k], device)))
    error = (out.float() - wanted[k].to(device).float()).pow(2).mean(dim=-1)
    mask = inputs.token_mask[k] if inputs.token_mask else None
    if mask is not None:
        mask = mask.to(device)
        return error[mask].mean(), int(mask.sum())
    return error.mean(), error.numel()


def check_ranks_agree(prefix: str, views: dict) -> None:
    """Every rank must have learned the same parameters (their steps follow the same summed
    gradients); a rank that did not would quantize the next layer's inputs differently."""
    if not ranks_agree(p for view in views.values() for p in view.parameters()):
        raise RuntimeError(f"signround: the ranks learned different parameters for {prefix}; "
                           "their gradients were not summed alike (a bug in lowbit: please report it)")


def summed(t: torch.Tensor) -> torch.Tensor:
    return all_sum(t) if world().size > 1 else t


def summed_loss(loss: torch.Tensor, tokens: int) -> tuple[float, int]:
    """The loss over every rank's batch, weighted by their tokens."""
    if world().size == 1:
        return float(loss), tokens
    both = all_sum(torch.tensor([float(loss) * tokens, float(tokens)], dtype=torch.float64))
    return float(both[0] / both[1]), int(both[1])


SPEC = StepSpec("signround", SignRoundConfig, apply,
                "SignRound: rounding and clipping learned per layer by signed gradient descent",
                writes=lambda cfg: LinearScheme(cfg.scheme), streamed=lambda cfg: WALK)
