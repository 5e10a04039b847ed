"""AWQ: activation-aware scaling and clipping of weights before low-bit quantization (Lin et al., 2024).

Per smoothing pair, the per-channel scale s = mean|x|^r / mean|w~|^(1 - r) (w~: weight magnitude
relative to its group's max) is searched over r in [0, 1). A candidate is judged by the output
error of the block the pair feeds (the whole attention for a norm -> q/k/v pair, the whole MLP
for a norm -> gate/up pair, the linear itself for v -> o and up -> down) with the pair's weights
fake-quantized as Q(W * s) / s, on a few calibration sequences; no scaling is a candidate too,
so the search never makes the block worse on them. The chosen s is folded exactly by fold.py.
Then each linear's weights are clipped per group to the fraction of their range that minimises
the group's output error. AWQ only folds scales and clips: a later step (rtn, gptq) quantizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from lowbit.calibrate.arch import is_linear, layer_pairs, linear_weight
from lowbit.calibrate.distributed import all_sum, count_before, mean_rows, sum_int, sum_numbers
from lowbit.calibrate.walker import (LayerInputs, WhileAlive, first_output, layer_forward, record_linear_inputs,
                                     walk)
from lowbit.quantize.grids.integer import IntScheme, fake_quantize, grouped, scale_zero_from_range
from lowbit.quantize.grids.linear import Plan
from lowbit.quantize.steps.awq_rounded_clip import search_clip_rounded
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.fold import fold_scale, follower_index
from lowbit.quantize.steps.smoothing import UNREACHED, pair_index, pair_names, to_prev, token_stride, unreached
from lowbit.quantize.steps.spec import WALK, StepSpec
from lowbit.quantize.targets import is_ignored, planned_targets


@dataclass(frozen=True)
class AWQConfig:
    # the weight grid the searches assume: the weight step after it must write this grid (AWQ
    # usually quantizes asymmetrically, with a zero point: recipes say so); or a llama.cpp file
    # type (GGUFTypes): each linear searched with the GGML type it will be written in
    scheme: Plan = IntScheme(4, True, "group", 128)
    grid: int = 20  # scale exponents r = 0, 1/grid, ..., (grid-1)/grid
    duo_scaling: bool = True  # divide by weight magnitude^(1-r) too, not only activations^r
    clip: bool = True
    clip_grid: int = 20  # clip ratios 1, 1 - 1/clip_grid, ... down to 1 - max_shrink
    max_shrink: float = 0.5
    # clipping query/key weights distorts attention scores more than it helps (AWQ's finding)
    clip_skip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    # whole calibration sequences (attention needs them) holding about this many tokens feed the
    # scale search and the mean |x| statistic; each candidate costs a block forward on them
    max_tokens: int = 1024
    # evenly strided calibration tokens whose second moments judge the clip ratios; None: all.
    # Each candidate costs a (group x group) product per group, not a pass over the tokens
    clip_tokens: Optional[int] = None

    def __post_init__(self):
        if not self.scheme.scales_per_row():
            raise ValueError("awq searches per-channel or per-group scales; scheme strategy tensor "
                             "is not supported (use channel or group)")
        if not self.scheme.searchable():
            raise ValueError(f"awq searches scales within rows; {self.scheme.describe()} has scales spanning rows "
                             "(FP8 strategy block): use strategy channel")
        if self.grid < 1 or self.clip_grid < 1 or not 0.0 <= self.max_shrink < 1.0:
            raise ValueError("grid and clip_grid must be >= 1 and max_shrink in [0, 1)")
        if self.clip_tokens is not None and self.clip_tokens < 1:
            raise ValueError(f"clip_tokens must be >= 1 or null (all tokens), got {self.clip_tokens}")


def weight_magnitude(weights: list[torch.Tensor], grid) -> torch.Tensor:
    """(in,) mean over all rows of |w| relative to its group's absmax."""
    rel = []
    for w in weights:
        g = grid.search_groups(w.abs())  # (out, G, group)
        rel.append((g / g.amax(dim=-1, keepdim=True).clamp(min=1e-8)).reshape(w.shape))
    return torch.cat(rel).mean(dim=0)


def search_scale(x_mean, w_mean, error, cfg: AWQConfig):
    """(scale over prev channels, best r or None for no scaling), by grid search on `error`."""
    x_mean, w_mean = x_mean.clamp(min=1e-8), w_mean.clamp(min=1e-8)
    ones = torch.ones_like(x_mean)
    best = (error(ones), ones, None)
    for k in range(cfg.grid):
        r = k / cfg.grid
        s = x_mean.pow(r) / w_mean.pow(1 - r) if cfg.duo_scaling else x_mean.pow(r)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre the range around 1
        loss = error(s)
        if loss < best[0]:
            best = (loss, s, r)
    return best[1], best[2]


class GroupGram:
    """Mean second moments C_g = E[x_g x_gᵀ] of a linear's input, per weight group g (the whole
    row when per-channel). A change d to a row's group g moves the output by x_g·d, whose mean
    square is dᵀ C_g d: the clip search reads every token through C at no cost per token."""

    def __init__(self, grid):
        self.grid, self.sum, self.tokens = grid, None, 0

    def update(self, x2d: torch.Tensor) -> None:
        x = x2d.detach().float().cpu()
        xg = self.grid.search_groups(x)  # (tokens, G, group)
        with torch.autocast("cpu", enabled=False):  # called from hooks inside bf16 autocast
            c = torch.einsum("ngk,ngl->gkl", xg, xg).double()  # float64 sums: ranks add them in another order
        self.sum = c if self.sum is None else self.sum + c
        self.tokens += x.shape[0]

    def merge_ranks(self) -> None:
        """Sums and counts of every rank's tokens (a no-op in one process)."""
        self.sum, self.tokens = all_sum(self.sum), sum_int(self.tokens)

    def result(self) -> torch.Tensor:
        return (self.sum / max(self.tokens, 1)).float()  # (G, group, group)


def group_gram(x: torch.Tensor, grid) -> torch.Tensor:
    gram = GroupGram(grid)
    gram.update(x)
    return gram.result()


@torch.no_grad()
def search_clip(w: torch.Tensor, gram: torch.Tensor, scheme: IntScheme, cfg: AWQConfig) -> torch.Tensor:
    """w (out, in) with each group clipped to the range fraction minimising its mean square
    output error dᵀ C_g d, C_g the group's input second moments (gram: (G, group, group))."""
    g = grouped(w.float(), scheme)  # (rows, G, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # (rows, G)
    best_err = torch.full_like(lo, float("inf"))
    best_ratio = torch.ones_like(lo)
    for k in range(int(cfg.max_shrink * cfg.clip_grid) + 1):
        ratio = 1 - k / cfg.clip_grid
        scale, zero = scale_zero_from_range(lo * ratio, hi * ratio, scheme)
        q = fake_quantize(g, scale.unsqueeze(-1), None if zero is None else zero.unsqueeze(-1),
                          scheme.qmin, scheme.qmax)
        d = (g - q).transpose(0, 1)  # (G, rows, group)
        err = (torch.bmm(d, gram) * d).sum(dim=-1).t()  # (rows, G)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    lo_c, hi_c = (lo * best_ratio).unsqueeze(-1), (hi * best_ratio).unsqueeze(-1)
    return torch.maximum(torch.minimum(g, hi_c), lo_c).reshape(w.shape).to(w.dtype)


def block_targets(layer, pair) -> list[str]:
    """Modules whose outputs judge a scaling of `pair`: the block its linears share (attention,
    MLP) when prev is a norm, else the linears themselves (v -> o, up -> down)."""
    if pair.block:
        return [pair.block]
    owners = {n.rpartition(".")[0] for n in pair.linears}
    if not is_linear(layer.get_submodule(pair.prev)) and len(owners) == 1 and "" not in owners:
        return [owners.pop()]
    return list(pair.linears)


def leading_sequences(inputs: LayerInputs, max_tokens: int, before: int = 0) -> LayerInputs:
    """The first whole sequences holding at least max_tokens tokens (all of them if fewer);
    before: tokens held by earlier ranks, which count first (a later rank may get none).

    Keyword tensors with 2+ dims and the micro-batch's size first (attention masks, per-sample
    rotary tables) are sliced with the hidden states; the rest (shared rotaries) are kept.
    """
    out = LayerInputs([], [], [])
    tokens = before
    for i, hidden in enumerate(inputs.hidden):
        if tokens >= max_tokens:
            break
        batch, seq = hidden.shape[:2]
        n = min(batch, -(-(max_tokens - tokens) // seq))
        out.hidden.append(hidden[:n])
        out.kwargs.append(_take_batch(inputs.kwargs[i], batch, n))
        mask = inputs.token_mask[i] if inputs.token_mask else None
        out.token_mask.append(None if mask is None else mask[:n])
        tokens += n * seq
    return out


def _take_batch(value, batch: int, n: int):
    if isinstance(value, torch.Tensor):
        return value[:n] if value.dim() >= 2 and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_take_batch(v, batch, n) for v in value)
    if isinstance(value, dict):
        return {k: _take_batch(v, batch, n) for k, v in value.items()}
    return value


def record_calls(layer, targets: list[str], inputs: LayerInputs, device) -> dict[str, list]:
    """Each target module's calls (args, kwargs, float output) in one layer forward, with the token
    mask of the micro-batch each was made in where it fits the output (a routed expert reads its
    tokens gathered, padding among them if the router sent it any)."""
    masks = inputs.token_mask or [None] * len(inputs.hidden)
    calls, batch = {n: [] for n in targets}, [None]

    def recorder(name):
        def hook(module, args, kwargs, output):
            out, mask = first_output(output), masks[batch[0]]
            fits = mask is not None and tuple(mask.shape) == tuple(out.shape[:-1])
            calls[name].append((args, kwargs, out, mask.to(device) if fits else None))
        return hook

    def count_batch(module, args):
        batch[0] = 0 if batch[0] is None else batch[0] + 1

    hooks = [layer.register_forward_pre_hook(count_batch)]
    hooks += [layer.get_submodule(n).register_forward_hook(recorder(n), with_kwargs=True) for n in targets]
    try:
        layer_forward(layer, inputs, device)
    finally:
        for h in hooks:
            h.remove()
    return calls


class BlockError:
    """Output error of the pair's target blocks with its linears fake-quantized under a scaling,
    on the blocks' calls recorded in one layer forward (record_calls)."""

    def __init__(self, layer, pair, calls: dict[str, list], grid_of, prefix: str = ""):
        self.layer, self.pair = layer, pair
        self.quant = {n: partial(grid_of(f"{prefix}.{n}").fake_round, name=f"{prefix}.{n}") for n in pair.linears}
        self.targets = block_targets(layer, pair)
        self.calls = {n: calls[n] for n in self.targets}
        channels, _ = pair_index(layer, pair)
        self.index = {n: follower_index(layer, n, channels) for n in pair.linears}
        self.original = {n: linear_weight(layer.get_submodule(n)).clone() for n in pair.linears}

    def block_input(self) -> torch.Tensor:
        """(tokens, in) the pair's linears read: the first target's input, padding left out
        (no rows on a rank that holds none of the leading sequences, or for an expert no
        token was routed to)."""
        rows = []
        for args, kwargs, _, mask in self.calls[self.targets[0]]:
            x = args[0] if args else kwargs["hidden_states"]
            rows.append(x[mask] if mask is not None else x.reshape(-1, x.shape[-1]))
        if not rows:
            return torch.zeros(0, next(iter(self.original.values())).shape[1])
        return torch.cat(rows).float()

    @torch.no_grad()
    def __call__(self, scale: torch.Tensor) -> float:
        for name, w in self.original.items():
            s = scale[self.index[name]].to(w.device, w.dtype).unsqueeze(0)
            linear_weight(self.layer.get_submodule(name)).copy_(self.quant[name](w * s) / s)
        try:
            total = 0.0
            for name in self.targets:
                module = self.layer.get_submodule(name)
                for args, kwargs, ref, mask in self.calls[name]:
                    diff = (first_output(module(*args, **kwargs)) - ref).float().pow(2)
                    diff = diff[mask] if mask is not None else diff
                    total += diff.mean().item() if diff.numel() else 0.0
            return sum_numbers(total)[0]  # every rank's micro-batches: all pick the same scale
        finally:
            self.restore()

    def restore(self) -> None:
        for name, w in self.original.items():
            linear_weight(self.layer.get_submodule(name)).copy_(w)


def scale_layer(layer, arch, prefix, inputs: LayerInputs, device, cfg: AWQConfig, ignore, grid_of=None) -> dict:
    """Search and fold one scale per smoothing pair; inputs: the sequences to search on.

    Every pair is searched on the layer's float weights (recorded before any folding), as the
    folds commute: a norm's scale multiplies v_proj's columns, o_proj's scale its rows.
    grid_of: a linear's full name -> the grid the searches quantize it with (default cfg.scheme,
    then a single grid).
    """
    grid_of = grid_of or (lambda name: cfg.scheme)
    pairs = [p for p in layer_pairs(layer, arch.smooth)
             if not any(is_ignored(f"{prefix}.{n}", ignore) for n in p.linears)]
    calls = record_calls(layer, list(dict.fromkeys(t for p in pairs for t in block_targets(layer, p))), inputs, device)
    errors = [BlockError(layer, p, calls, grid_of, prefix) for p in pairs]
    del calls  # each error holds its targets' calls, freed once its pair is searched
    ratios = {}
    for pair, error in zip(pairs, errors):
        channels, index = pair_index(layer, pair)
        seen = error.block_input()
        if sum_int(seen.shape[0]) == 0:  # an expert no search token was routed to (on any rank): kept as is
            ratios[pair.prev] = UNREACHED
            error.calls.clear()
            continue
        x_mean = to_prev(mean_rows(seen.abs()).cpu(), index, channels)
        grid = grid_of(f"{prefix}.{pair.linears[0]}")  # a pair's linears share its groups' width
        w_mean = to_prev(weight_magnitude([w.float().cpu() for w in error.original.values()], grid),
                         index, channels)
        scale, ratios[pair.prev] = search_scale(x_mean, w_mean, error, cfg)
        error.calls.clear()  # free the recorded activations
        fold_scale(layer, pair, scale, arch.norm_offset)
    return ratios


def clip_layer(layer, arch, prefix, inputs: LayerInputs, device, cfg: AWQConfig, ignore, grid_of=None) -> list[str]:
    """Clip each linear's groups, judged on (a stride of) all calibration tokens in `inputs`."""
    grid_of = grid_of or (lambda name: cfg.scheme)
    present = dict(layer.named_modules())  # a mixture's layer holds its experts or a dense MLP
    names = [n for n in arch.linears
             if n in present and n not in cfg.clip_skip and not is_ignored(f"{prefix}.{n}", ignore)]
    stride = 1 if cfg.clip_tokens is None else token_stride(inputs.hidden, cfg.clip_tokens)
    grams = {n: GroupGram(grid_of(f"{prefix}.{n}")) for n in names}
    took = WhileAlive()  # an input tensor -> the linear whose Gram took it

    def update(name, x2d):  # linears handed one tensor (gate/up; every expert's under all_experts): one Gram
        first = took.get(x2d)
        if first is not None:
            grams[name] = grams[first]
        else:
            took.put(x2d, name)
            grams[name].update(x2d[::stride])

    record_linear_inputs(layer, names, inputs, device, update)
    for gram in {id(g): g for g in grams.values()}.values():  # each shared Gram once, in one order
        gram.merge_ranks()
    names = [n for n in names if grams[n].tokens]  # a routed expert no token reached keeps its range
    for name in names:
        w = linear_weight(layer.get_submodule(name))  # a view: copying into it updates the module
        grid = grid_of(f"{prefix}.{name}")
        clip = CLIPS.get(grid.FAMILY, _clip_rounded)
        clipped = clip(w.float().cpu(), grams[name].result(), grid, f"{prefix}.{name}", cfg)
        w.copy_(clipped.to(w.device, w.dtype))
    return names


def _clip_int(w, gram, grid, name: str, cfg: AWQConfig) -> torch.Tensor:
    return search_clip(w, gram, grid, cfg)


def _clip_rounded(w, gram, grid, name: str, cfg: AWQConfig) -> torch.Tensor:
    return search_clip_rounded(w, gram, grid, name, cfg.max_shrink, cfg.clip_grid)


# a grid's FAMILY -> its own clip search; every other grid searches by rounding onto itself
CLIPS = {"int": _clip_int}


def apply(ctx: StepContext, cfg: AWQConfig) -> dict:
    if not ctx.arch.smooth:
        raise ValueError("awq: the architecture table has no smoothing pairs for this model "
                         "(an unknown architecture?); add its row to calibrate/arch.py")
    # each linear searched on the grid the weight step will give it; those the plan keeps 16-bit
    # (rows no GGML block divides) are left out of the searches too
    targets, grids = planned_targets(ctx.model, ctx.arch, ctx.ignore, cfg.scheme)
    ignore = ctx.ignore + tuple(n for n in targets.ignored if n not in ctx.ignore)

    def on_layer(i, prefix, layer, inputs):
        sample = leading_sequences(inputs, cfg.max_tokens, count_before(_tokens(inputs)))
        ratios = scale_layer(layer, ctx.arch, prefix, sample, ctx.device, cfg, ignore, grids.__getitem__)
        clipped = (clip_layer(layer, ctx.arch, prefix, inputs, ctx.device, cfg, ignore, grids.__getitem__)
                   if cfg.clip else [])
        return {"ratios": {k: r for k, r in ratios.items() if r != UNREACHED}, "clipped": clipped,
                "unreached": unreached(prefix, ratios)}

    per_layer = walk(ctx.model, ctx.arch, ctx.batches, on_layer, device=ctx.device, label="awq",
                     store=ctx.layer_store, source=ctx.layer_source, offload=ctx.offload)
    return {"scaled_pairs": pair_names(ctx.arch.smooth),
            "scale_ratio": [r["ratios"] for r in per_layer],
            "clipped": sorted({n for r in per_layer for n in r["clipped"]}),
            # up_proj of experts no search token reached: their up -> down pair kept unscaled
            "unscaled_pairs": [n for r in per_layer for n in r["unreached"]]}


def _tokens(inputs: LayerInputs) -> int:
    return sum(h.shape[0] * h.shape[1] for h in inputs.hidden)


SPEC = StepSpec("awq", AWQConfig, apply,
                "activation-aware weight scaling and clipping (folds scales; a later step quantizes)",
                searches=lambda cfg: cfg.scheme, streamed=lambda cfg: WALK)
