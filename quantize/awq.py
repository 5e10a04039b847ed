"""AWQ: activation-aware scaling and clipping of weights before low-bit quantization (Lin et al., 2024).

Per smoothing pair, the per-channel scale s = mean|x|^r / mean|w~|^(1 - r) (w~: weight magnitude
relative to its group's max) is searched over r in [0, 1), keeping the s that minimises the
pair's output error under the target weight grid (never worse than no scaling, which is a
candidate too); s is folded exactly by fold.py. Then each linear's weights are clipped per
group to the fraction of their range that minimises the group's output error.
AWQ only folds scales and clips: a later step (rtn, gptq) quantizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lowbit.calibrate.walker import record_linear_inputs, walk

from .fold import fold_scale, weight_out_in
from .primitives import IntScheme, check_group_size, fake_quantize, grouped, scale_zero_from_range
from .smoothing import (InputCollector, PairError, first_micro_batches, pair_index, pair_weights, to_prev,
                        token_stride, weight_quantizer)
from .step import StepContext
from .targets import is_ignored


@dataclass(frozen=True)
class AWQConfig:
    bits: int = 4  # the weight grid the searches assume: match the weight step that follows
    symmetric: bool = True
    group_size: Optional[int] = 128  # None: per-channel
    grid: int = 20  # scale exponents r = 0, 1/grid, ..., (grid-1)/grid
    duo_scaling: bool = True  # divide by weight magnitude^(1-r) too, not only activations^r
    clip: bool = True
    clip_grid: int = 20  # clip ratios 1, 1 - 1/clip_grid, ... down to 1 - max_shrink
    max_shrink: float = 0.5
    # clipping query/key weights distorts attention scores more than it helps (AWQ's finding)
    clip_skip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    # tokens for the scale search (and the mean |x| statistic) and for the clipping search,
    # taken from the leading calibration samples: recording them costs a forward pass each
    max_tokens: int = 2048
    clip_tokens: int = 512

    def __post_init__(self):
        self.scheme  # validates bits / group_size
        if self.grid < 1 or self.clip_grid < 1 or not 0.0 <= self.max_shrink < 1.0:
            raise ValueError("grid and clip_grid must be >= 1 and max_shrink in [0, 1)")

    @property
    def scheme(self) -> IntScheme:
        strategy = "group" if self.group_size else "channel"
        return IntScheme(self.bits, self.symmetric, strategy, self.group_size)


def weight_magnitude(weights: list[torch.Tensor], scheme: IntScheme) -> torch.Tensor:
    """(in,) mean over all rows of |w| relative to its group's absmax."""
    rel = []
    for w in weights:
        g = grouped(w.abs(), scheme)  # (out, G, group)
        rel.append((g / g.amax(dim=-1, keepdim=True).clamp(min=1e-8)).reshape(w.shape))
    return torch.cat(rel).mean(dim=0)


def search_scale(x_mean, w_mean, index, error: PairError, cfg: AWQConfig):
    """(scale over prev channels, best r or None for no scaling), by grid search on `error`."""
    x_mean, w_mean = x_mean.clamp(min=1e-8), w_mean.clamp(min=1e-8)
    ones = torch.ones_like(x_mean)
    best = (error(ones[index]), ones, None)
    for k in range(cfg.grid):
        r = k / cfg.grid
        s = x_mean.pow(r) / w_mean.pow(1 - r) if cfg.duo_scaling else x_mean.pow(r)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre the range around 1
        loss = error(s[index])
        if loss < best[0]:
            best = (loss, s, r)
    return best[1], best[2]


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, scheme: IntScheme, cfg: AWQConfig) -> torch.Tensor:
    """w (out, in) with each group clipped to the range fraction minimising its output error on x."""
    g = grouped(w.float(), scheme)  # (rows, G, group)
    xg = x.float().reshape(x.shape[0], g.shape[1], g.shape[2])  # (tokens, G, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # (rows, G)
    best_err = torch.full_like(lo, float("inf"))
    best_ratio = torch.ones_like(lo)
    for k in range(int(cfg.max_shrink * cfg.clip_grid) + 1):
        ratio = 1 - k / cfg.clip_grid
        scale, zero = scale_zero_from_range(lo * ratio, hi * ratio, scheme)
        q = fake_quantize(g, scale.unsqueeze(-1), None if zero is None else zero.unsqueeze(-1),
                          scheme.qmin, scheme.qmax)
        err = torch.einsum("ngk,ogk->nog", xg, g - q).pow(2).mean(dim=0)  # (rows, G)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    lo_c, hi_c = (lo * best_ratio).unsqueeze(-1), (hi * best_ratio).unsqueeze(-1)
    return torch.maximum(torch.minimum(g, hi_c), lo_c).reshape(w.shape).to(w.dtype)


def scale_layer(layer, arch, prefix, inputs, device, cfg: AWQConfig, ignore) -> dict:
    pairs = [p for p in arch.smooth if not any(is_ignored(f"{prefix}.{n}", ignore) for n in p.linears)]
    inputs = first_micro_batches(inputs, cfg.max_tokens)  # mean |x| and the search use these tokens
    stride = token_stride(inputs.hidden, cfg.max_tokens)
    collectors = {p.linears[0]: InputCollector(stride) for p in pairs}
    record_linear_inputs(layer, list(collectors), inputs, device, lambda n, x: collectors[n].update(x))
    quant_w, ratios = weight_quantizer(cfg.scheme), {}
    for pair in pairs:
        stats = collectors[pair.linears[0]].result()
        weights = pair_weights(layer, pair)
        channels, index = pair_index(layer, pair)
        x_mean = to_prev(stats.mean_abs, index, channels)
        w_mean = to_prev(weight_magnitude(weights, cfg.scheme), index, channels)
        scale, ratios[pair.prev] = search_scale(x_mean, w_mean, index, PairError(stats.sample, weights, quant_w), cfg)
        fold_scale(layer, pair, scale, arch.norm_offset)
    return ratios


def clip_layer(layer, arch, prefix, inputs, device, cfg: AWQConfig, ignore) -> list[str]:
    names = [n for n in arch.linears if n not in cfg.clip_skip and not is_ignored(f"{prefix}.{n}", ignore)]
    inputs = first_micro_batches(inputs, cfg.clip_tokens)
    collectors = {n: InputCollector(token_stride(inputs.hidden, cfg.clip_tokens)) for n in names}
    record_linear_inputs(layer, names, inputs, device, lambda n, x: collectors[n].update(x))
    for name in names:
        w = weight_out_in(layer.get_submodule(name))  # a view: copying into it updates the module
        w.copy_(search_clip(w.cpu(), collectors[name].result().sample, cfg.scheme, cfg))  # on CPU
    return names


def apply(ctx: StepContext, cfg: AWQConfig) -> dict:
    if not ctx.arch.smooth:
        raise ValueError("awq: the architecture table has no smoothing pairs for this model "
                         "(an unknown architecture?); add its row to calibrate/arch.py")
    layer0 = ctx.model.get_submodule(f"{ctx.arch.layers}.0")
    for name in ctx.arch.linears:
        check_group_size(cfg.scheme, weight_out_in(layer0.get_submodule(name)).shape[1], name)

    def on_layer(i, prefix, layer, inputs):
        ratios = scale_layer(layer, ctx.arch, prefix, inputs, ctx.device, cfg, ctx.ignore)
        clipped = clip_layer(layer, ctx.arch, prefix, inputs, ctx.device, cfg, ctx.ignore) if cfg.clip else []
        return {"ratios": ratios, "clipped": clipped}

    per_layer = walk(ctx.model, ctx.arch, ctx.batches, on_layer, device=ctx.device, label="awq")
    return {"scaled_pairs": [p.prev for p in ctx.arch.smooth],
            "scale_ratio": [r["ratios"] for r in per_layer],
            "clipped": sorted({n for r in per_layer for n in r["clipped"]})}
