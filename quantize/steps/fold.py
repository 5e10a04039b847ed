"""Scale folding, shared by AWQ and SmoothQuant: move a per-channel scale between two ops.

For a smoothing pair (prev -> linears), folding a scale s (one per output channel of prev)
divides prev's output by s and multiplies the matching input columns of every linear by s:
    linear(prev(x) / s) with W * s  ==  linear(prev(x)) with W
so the model computes the same function while the linears' inputs become easier to quantize
(SmoothQuant) or their important columns get a finer grid (AWQ).

prev is a norm (RMSNorm / LayerNorm weight and bias; Gemma's RMSNorm multiplies by 1 + weight,
hence `norm_offset`) or a linear whose output rows feed the linears (v_proj -> o_proj,
up_proj -> down_proj). With grouped-query attention o_proj's inputs are the v heads repeated,
so one v channel feeds several o_proj columns: `follower_index` gives that map. A mixture's
router reads the same norm as its experts: it takes the scale too (a passenger), unquantized.
"""
from __future__ import annotations

import torch
from torch import nn

from lowbit.calibrate.arch import SmoothPair, is_linear, linear_weight


def prev_channels(prev: nn.Module) -> int:
    """How many channels prev outputs, i.e. the length of a scale folded into it."""
    if is_linear(prev):
        return linear_weight(prev).shape[0]
    weight = getattr(prev, "weight", None)
    if weight is None or weight.dim() != 1:
        raise TypeError(f"{type(prev).__name__} is neither a linear nor a norm with a 1-d weight")
    return weight.shape[0]


def follower_index(layer: nn.Module, linear_name: str, channels: int) -> torch.Tensor:
    """(in_features,) index of the prev channel feeding each input column of `linear_name`.

    The identity unless in_features is a multiple of `channels` (GQA: v heads repeated for o_proj);
    then the head size comes from the attention module that owns the linear (its `head_dim`).
    """
    in_features = linear_weight(layer.get_submodule(linear_name)).shape[1]
    if in_features == channels:
        return torch.arange(channels)
    owner_name = linear_name.rpartition(".")[0]
    head_dim = getattr(layer.get_submodule(owner_name), "head_dim", None) if owner_name else None
    if in_features % channels or head_dim is None or channels % head_dim:
        raise ValueError(
            f"cannot fold a {channels}-channel scale into {linear_name} ({in_features} inputs): "
            "expected equal sizes, or grouped-query heads with a known head_dim"
        )
    repeats = in_features // channels
    column = torch.arange(in_features)
    head, offset = column // head_dim, column % head_dim
    return (head // repeats) * head_dim + offset  # query head h reads kv head h // repeats


def reduce_to_prev(stat: torch.Tensor, index: torch.Tensor, channels: int) -> torch.Tensor:
    """Per-input-column statistic (in_features,) -> per-prev-channel (channels,), by max."""
    out = torch.full((channels,), float("-inf"), dtype=stat.dtype)
    return out.scatter_reduce(0, index, stat, reduce="amax")


@torch.no_grad()
def fold_scale(layer: nn.Module, pair: SmoothPair, scale: torch.Tensor, norm_offset: float = 0.0) -> None:
    """Divide prev's output channels by `scale` and multiply the linears' input columns by it."""
    prev = layer.get_submodule(pair.prev)
    channels = prev_channels(prev)
    if scale.shape != (channels,):
        raise ValueError(f"scale for {pair.prev} must have shape ({channels},), got {tuple(scale.shape)}")
    if not torch.all(scale > 0):
        raise ValueError(f"scale for {pair.prev} must be positive everywhere")
    for name in pair.linears:
        linear = layer.get_submodule(name)
        if not is_linear(linear):
            raise TypeError(f"{name} is {type(linear).__name__}; fold scales before quantizing it")
        index = follower_index(layer, name, channels)
        _scale_input_columns(linear, scale[index])
    for name in pair.passengers:
        _scale_passenger(layer.get_submodule(name), name, scale)
    if is_linear(prev):
        _scale_output_rows(prev, 1.0 / scale)
    else:
        _scale_norm(prev, 1.0 / scale, norm_offset)


def _scale_input_columns(linear: nn.Module, s: torch.Tensor) -> None:
    w = linear_weight(linear)  # a view: scaling it scales the module's weight
    w.mul_(s.to(w.device, w.dtype).unsqueeze(0))


def _scale_passenger(module: nn.Module, name: str, s: torch.Tensor) -> None:
    """A router reads prev's output through its (experts, channels) weight: its columns take the scale
    (routers are linears or hold such a weight and apply it with F.linear; a bias stays as it is)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != len(s):
        raise TypeError(f"{name} ({type(module).__name__}) has no (out, {len(s)}) weight to take the scale")
    weight.data.mul_(s.to(weight.device, weight.dtype).unsqueeze(0))


def _scale_output_rows(linear: nn.Module, s: torch.Tensor) -> None:
    w = linear_weight(linear)
    w.mul_(s.to(w.device, w.dtype).unsqueeze(1))
    if linear.bias is not None:
        linear.bias.data.mul_(s.to(linear.bias.device, linear.bias.dtype))


def _scale_norm(norm: nn.Module, s: torch.Tensor, offset: float) -> None:
    w = norm.weight.data
    # effective multiplier is (offset + w): scale it, then store it back without the offset
    w.copy_(((w.double() + offset) * s.to(w.device).double() - offset).to(w.dtype))
    bias = getattr(norm, "bias", None)
    if bias is not None:
        bias.data.mul_(s.to(bias.device, bias.dtype))
