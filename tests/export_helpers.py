"""Shared helpers for the export tests: tiny quantized models and logits comparisons."""
from __future__ import annotations

from unittest import mock

import torch

from tiny_models import make_tiny_model
from lowbit.calibrate.arch import arch_for, linear_weight
from lowbit.export import checkpoint
from lowbit.quantize.steps import rtn
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps.context import StepContext

W4_GROUP = IntScheme(bits=4, symmetric=True, strategy="group", group_size=32)


def quantized_tiny(scheme: IntScheme = W4_GROUP, model_type: str = "llama"):
    model = make_tiny_model(model_type)
    rtn.apply(StepContext(model, arch_for(model), ("lm_head",), lambda: None), rtn.RTNConfig(scheme))
    return model


def act_order_tiny(scheme: IntScheme = W4_GROUP, seed: int = 0):
    """A tiny llama whose linears use act-order groups: column j in group g_idx[j], g_idx a
    permutation of the plain grouping (as GPTQ's act-order produces), built by hand."""
    model = make_tiny_model("llama")
    gen = torch.Generator().manual_seed(seed)
    for name, module in [(n, m) for n, m in model.named_modules() if n.endswith("proj")]:
        w = linear_weight(module)
        in_f = w.shape[1]
        g_idx = (torch.arange(in_f) // scheme.group_size)[torch.randperm(in_f, generator=gen)]
        order = torch.argsort(g_idx, stable=True)  # columns of each group, gathered together
        qw = quantize_rtn(w[:, order], scheme)  # contiguous groups in the gathered order
        qw.codes = qw.codes[:, torch.argsort(order)]  # back to the original column order
        qw.g_idx = g_idx
        model.set_submodule(name, QuantLinear.from_quantized(qw, module.bias))
    return model


def load_without_tokenizer(folder):
    with mock.patch("transformers.AutoTokenizer.from_pretrained", return_value=None):
        return checkpoint.load(folder)


def token_ids(batch: int = 4, length: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


def compare_logits(reference, other, ids) -> tuple[float, float]:
    """(top-1 agreement, max |difference| relative to the reference's largest |logit|)."""
    with torch.no_grad():
        a, b = reference(ids).logits.float(), other(ids).logits.float()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return agree, ((a - b).abs().max() / a.abs().max()).item()


def rounded_like_export(model, dtype: torch.dtype = torch.bfloat16):
    """A copy of `model` whose float tensors went through `dtype` and back, as an export does:
    the reference a loaded checkpoint must match exactly."""
    import copy

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for t in twin.state_dict().values():  # what the file holds: not RoPE's inv_freq & co.
            if t.is_floating_point():
                t.copy_(t.to(dtype).float())
    return twin


def dense_in(model, dtype: torch.dtype = torch.bfloat16):
    """rounded_like_export, with each QuantLinear replaced by a Linear whose weight was dequantized
    in `dtype` (as transformers' dequantize=True load computes (q - zero) * scale)."""
    from torch import nn

    twin = rounded_like_export(model, dtype)
    for name, module in [(n, m) for n, m in twin.named_modules() if isinstance(m, QuantLinear)]:
        dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        qw = module.quantized_weight()
        dense.weight.data = _dequantize_in(qw, dtype).float()
        if module.bias is not None:
            dense.bias.data = module.bias.clone()
        twin.set_submodule(name, dense)
    return twin


def _dequantize_in(qw, dtype):
    """(codes - zero) * scale with the product rounded to dtype, like compressed-tensors."""
    q = qw.codes.float() if qw.zero is None else qw.codes.float() - qw.zero.float().repeat_interleave(
        qw.codes.shape[1] // qw.zero.shape[1], dim=1)
    scale = qw.scale.float().repeat_interleave(qw.codes.shape[1] // qw.scale.shape[1], dim=1)
    return (q.to(dtype) * scale.to(dtype))
