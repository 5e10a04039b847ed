"""Shared by AWQ and SmoothQuant: per-pair input statistics and the output error of a scaling.

A smoothing pair's linears all read the same input X (tokens, in). Scaling by s (per input
column) turns each linear into (X / s) @ (W * s)^T; the error of a candidate s is how far the
quantized version of that product lands from the float X @ W^T.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from lowbit.calibrate.arch import SmoothPair, linear_weight
from lowbit.calibrate.distributed import all_max, all_sum, mean_of, sum_int
from lowbit.calibrate.observers import ChannelAbsMax
from lowbit.calibrate.walker import LayerInputs
from lowbit.quantize.grids.inputs import InputQuant, per_token_scale
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.fold import follower_index, prev_channels, reduce_to_prev

Quantizer = Callable[[torch.Tensor], torch.Tensor]  # float tensor -> fake-quantized float tensor


@dataclass
class PairInput:
    """Statistics of one pair's input X (tokens, in) over every calibration token."""

    absmax: torch.Tensor  # (in,) max |x| per channel: SmoothQuant's statistic
    mean_abs: torch.Tensor  # (in,) mean |x| per channel: AWQ's statistic
    sample: torch.Tensor  # (about max_tokens, in) evenly strided tokens for the searches


# a pair inside an expert that no calibration token was routed to: left unscaled (the expert is still
# quantized by the weight step), named in results.json
UNREACHED = "unreached"


def pair_names(pairs) -> list[str]:
    """results.json's list of an architecture's smoothing pairs, by prev; the experts' own up -> down
    pairs as one entry."""
    names = list(dict.fromkeys(p.prev for p in pairs if ".experts." not in p.prev))
    return names + (["experts' up_proj -> down_proj"] if any(".experts." in p.prev for p in pairs) else [])


def unreached(prefix: str, chosen: dict) -> list[str]:
    return [f"{prefix}.{prev}" for prev, value in chosen.items() if value == UNREACHED]


class InputCollector:
    """Accumulates PairInput statistics from the walker's record_linear_inputs callback."""

    def __init__(self, stride: int, width: int):
        self.stride, self.width, self.absmax = stride, width, ChannelAbsMax()
        self.abs_sum, self.count, self.rows = None, 0, []

    def update(self, x2d: torch.Tensor) -> None:
        x2d = x2d.detach().float().cpu()
        self.absmax.update(x2d)
        s = x2d.abs().sum(dim=0).double()  # float64 sums: ranks add them in another order
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        self.count += x2d.shape[0]
        self.rows.append(x2d[:: self.stride].clone())

    def result(self) -> Optional[PairInput]:
        """Over every rank's tokens (the sample stays this rank's share of the global sample); None
        where no rank saw a token (an expert the router never picked). A rank that saw none adds zeros."""
        count = sum_int(self.count)
        if count == 0:
            return None
        absmax = self.absmax.value if self.absmax.value is not None else torch.zeros(self.width)
        abs_sum = self.abs_sum if self.abs_sum is not None else torch.zeros(self.width, dtype=torch.float64)
        rows = torch.cat(self.rows) if self.rows else torch.zeros(0, self.width)
        return PairInput(all_max(absmax), (all_sum(abs_sum) / count).float(), rows)


def token_stride(hidden: list[torch.Tensor], max_tokens: int) -> int:
    """Keep every k-th token so that about max_tokens remain for the searches (counting every
    rank's tokens: each micro-batch restarts the stride, so the ranks' picks are one process's)."""
    total = sum_int(sum(h.shape[0] * h.shape[1] for h in hidden))
    return max(1, -(-total // max_tokens))


def first_micro_batches(inputs: LayerInputs, max_tokens: int) -> LayerInputs:
    """The leading micro-batches holding at least max_tokens tokens (all of them if fewer).

    Recording a layer's inputs costs a forward pass; the searches only need max_tokens tokens,
    so they record on a prefix of the calibration set instead of all of it.
    """
    count, tokens = 0, 0
    while count < len(inputs.hidden) and tokens < max_tokens:
        tokens += inputs.hidden[count].shape[0] * inputs.hidden[count].shape[1]
        count += 1
    masks = inputs.token_mask[:count] if inputs.token_mask else []
    return LayerInputs(inputs.hidden[:count], inputs.kwargs[:count], masks)


def pair_weights(layer: nn.Module, pair: SmoothPair) -> list[torch.Tensor]:
    """Float (out, in) weights of the pair's linears (CPU copies: the searches run on CPU)."""
    return [linear_weight(layer.get_submodule(n)).float().cpu().clone() for n in pair.linears]


def pair_index(layer: nn.Module, pair: SmoothPair) -> tuple[int, torch.Tensor]:
    """(channels of prev, index from the linears' input columns to prev channels)."""
    channels = prev_channels(layer.get_submodule(pair.prev))
    return channels, follower_index(layer, pair.linears[0], channels)


def to_prev(stat: torch.Tensor, index: torch.Tensor, channels: int) -> torch.Tensor:
    return stat if len(stat) == channels and torch.equal(index, torch.arange(channels)) \
        else reduce_to_prev(stat, index, channels)


def weight_quantizer(scheme: IntScheme) -> Quantizer:
    return scheme.fake_round


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """Fake-quantize activations the way QuantLinear's dynamic per-token path does (its grid)."""
    iq = InputQuant(8, dynamic=True)
    s = per_token_scale(x.reshape(-1, x.shape[-1]), iq.qmax).reshape(*x.shape[:-1], 1)
    return torch.round(x / s).clamp(-iq.qmax - 1, iq.qmax) * s


class PairError:
    """Output error of candidate scalings of one pair; the float outputs are computed once."""

    def __init__(self, x: torch.Tensor, weights: list[torch.Tensor], quant_weight: Quantizer,
                 quant_input: Optional[Quantizer] = None):
        # the linears share the input and are quantized row by row: stack them into one matmul
        self.x, self.w = x, torch.cat(weights)
        self.quant_weight, self.quant_input = quant_weight, quant_input
        self.reference = x @ self.w.t()

    def __call__(self, col_scale: torch.Tensor) -> float:
        """Mean squared output error with input columns scaled by col_scale (in,)."""
        xs = self.x / col_scale
        if self.quant_input is not None:
            xs = self.quant_input(xs)
        out = xs @ self.quant_weight(self.w * col_scale).t()
        return mean_of((out - self.reference).pow(2))  # over every rank's sampled tokens
