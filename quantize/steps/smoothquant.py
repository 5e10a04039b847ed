"""SmoothQuant: migrate activation outliers into the weights before W8A8 quantization.

Per smoothing pair, s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha) (Xiao et al., 2023); X / s is
flatter per token and W * s takes up the difference, folded exactly by fold.py. alpha is fixed,
or searched per pair over a small grid minimising the pair's W8A8 output error.
Only smooths: a later weight step (rtn, gptq) and `quantize_inputs` quantize.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.calibrate.arch import layer_pairs, linear_weight
from lowbit.calibrate.walker import record_linear_inputs, walk
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.fold import fold_scale
from lowbit.quantize.steps.smoothing import (
    UNREACHED,
    InputCollector,
    PairError,
    pair_index,
    pair_names,
    pair_weights,
    per_token_int8,
    to_prev,
    token_stride,
    unreached,
    weight_quantizer,
)
from lowbit.quantize.steps.spec import WALK, StepSpec


@dataclass(frozen=True)
class SmoothQuantConfig:
    alpha: float = 0.5  # migration strength: 0 leaves activations as they are, 1 flattens them fully
    # when non-empty, each pair picks the alpha from this grid with the smallest W8A8 output error
    alpha_grid: tuple[float, ...] = ()
    # the weight grid the alpha search assumes: the weight step after it must write this grid
    scheme: IntScheme = IntScheme(8, True, "channel")
    max_tokens: int = 2048  # tokens per pair kept for the alpha search

    def __post_init__(self):
        for a in (self.alpha, *self.alpha_grid):
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"alpha values must lie in [0, 1], got {a}")


def smooth_scale(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-channel smoothing scale s = act^alpha / weight^(1 - alpha), kept positive."""
    a = act_absmax.float().clamp(min=1e-5)
    w = weight_absmax.float().clamp(min=1e-5)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=1e-5)


def choose_scale(x_absmax, weights, index, channels, cfg: SmoothQuantConfig, error=None):
    """(scale over prev channels, alpha): fixed alpha, or the best of cfg.alpha_grid."""
    w_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)  # (in,)
    act, wmax = to_prev(x_absmax, index, channels), to_prev(w_absmax, index, channels)
    candidates = cfg.alpha_grid if cfg.alpha_grid and error is not None else (cfg.alpha,)
    best = None
    for alpha in candidates:
        s = smooth_scale(act, wmax, alpha)
        loss = error(s[index]) if len(candidates) > 1 else 0.0
        if best is None or loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2]


def smooth_layer(layer, arch, inputs, device, cfg: SmoothQuantConfig) -> dict:
    pairs = layer_pairs(layer, arch.smooth)
    # a MoE pair's statistic is its block's input (every token), not expert 0's routed tokens
    stride = token_stride(inputs.hidden, cfg.max_tokens)
    collectors = {p.block or p.linears[0]: InputCollector(stride, _in_features(layer, p.linears[0])) for p in pairs}
    record_linear_inputs(layer, list(collectors), inputs, device,
                         lambda name, x: collectors[name].update(x))
    quant_w = weight_quantizer(cfg.scheme)
    chosen = {}
    for pair in pairs:
        stats = collectors[pair.block or pair.linears[0]].result()
        if stats is None:  # an expert no calibration token was routed to: its up -> down pair kept unscaled
            chosen[pair.prev] = UNREACHED
            continue
        weights = pair_weights(layer, pair)
        channels, index = pair_index(layer, pair)
        error = PairError(stats.sample, weights, quant_w, per_token_int8) if cfg.alpha_grid else None
        scale, alpha = choose_scale(stats.absmax, weights, index, channels, cfg, error)
        fold_scale(layer, pair, scale, arch.norm_offset)
        chosen[pair.prev] = alpha
    return chosen


def _in_features(layer, name: str) -> int:
    return linear_weight(layer.get_submodule(name)).shape[1]


def apply(ctx: StepContext, cfg: SmoothQuantConfig) -> dict:
    if not ctx.arch.smooth:
        raise ValueError("smoothquant: the architecture table has no smoothing pairs for this model "
                         "(an unknown architecture?); add its row to calibrate/arch.py")
    chosen = walk(ctx.model, ctx.arch, ctx.batches,
                  lambda i, name, layer, inputs: (name, smooth_layer(layer, ctx.arch, inputs, ctx.device, cfg)),
                  device=ctx.device, label="smoothquant", store=ctx.layer_store, source=ctx.layer_source,
                  offload=ctx.offload)
    alphas = [{prev: a for prev, a in layer.items() if a != UNREACHED} for _, layer in chosen]
    return {"smoothed_pairs": pair_names(ctx.arch.smooth), "alpha": cfg.alpha,
            "alphas_chosen": alphas if cfg.alpha_grid else None,
            "unscaled_pairs": [n for name, layer in chosen for n in unreached(name, layer)]}


SPEC = StepSpec("smoothquant", SmoothQuantConfig, apply,
                "migrate activation outliers into the weights (folds scales; quantizes nothing)",
                searches=lambda cfg: cfg.scheme if cfg.alpha_grid else None, streamed=lambda cfg: WALK)
