"""A memory-lean CPU runtime: a model holding what a checkpoint stores, not what is fastest to run.

`compact(model)` after loading a quantized checkpoint:
- weight-only integer linears (symmetric, no act-order index) keep their codes packed densely in
  int32 words, as compressed-tensors stores them (4 bits a weight, not the int8 byte a QuantLinear
  keeps), and their scales in the 16-bit dtype they were stored in; each forward unpacks the codes
  (a byte each, for the duration of the matmul) and widens WEIGHT_ROWS rows of them at a time to
  float (only a block of a weight is ever float);
- linears a plan keeps 16-bit hold their weight in the stored 16-bit dtype, widened per forward;
- the token embedding (and the output head tied to it) stays in its stored 16-bit dtype; lookups
  are cast to float32, and the head multiplies a block of vocabulary rows at a time (a 16-bit
  matmul on the CPU copies the whole transposed table first: 54 MiB on smollm2-135m);
- attention runs one query head at a time against its key/value head (grouped-query models):
  transformers' SDPA path repeats every cached key and value for each query head it serves
  (36 MiB on smollm2-135m at 8192 tokens, float32) where a mask is given, as in chunked prefill.
So the model holds the bytes the fit's memory model counts (evaluate/memory.py). Slower than the
QuantLinear path; it exists to run where memory, not time, is what runs out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.quantize.grids.integer import dequantize_codes, pack_codes, unpack_codes
from lowbit.quantize.runtime.buffers import RuntimeModule
from lowbit.quantize.runtime.qlinear import QuantLinear


WEIGHT_ROWS = 256  # output rows widened at once: 0.6 MiB of float32 at 576 columns, 14 MiB at 14336


def _blockwise(x: torch.Tensor, rows: int, widen, bias, block_rows: int = WEIGHT_ROWS) -> torch.Tensor:
    """x @ W.T with W's rows widened block_rows at a time by widen(slice) (float, (block, in))."""
    parts = []
    for start in range(0, rows, block_rows):
        block = slice(start, min(start + block_rows, rows))
        parts.append(F.linear(x, widen(block).to(x.dtype), None if bias is None else bias[block].to(x.dtype)))
    return torch.cat(parts, dim=-1)


class PackedLinear(RuntimeModule):
    """Integer codes packed as stored, 16-bit scales; dequantized per forward."""

    FLOAT_CAST_BUFFERS = ("bias",)  # a float cast reaches the bias; scales keep their stored dtype

    def __init__(self, module: QuantLinear):
        super().__init__()
        self.in_features, self.out_features, self.scheme = module.in_features, module.out_features, module.scheme
        unsigned = (module.weight_codes.to(torch.int32) - module.scheme.qmin)
        self.register_buffer("weight_packed", pack_codes(unsigned, module.scheme.bits))
        self.register_buffer("weight_scale", _narrowest_exact(module.weight_scale))
        self.register_buffer("bias", None if module.bias is None else _narrowest_exact(module.bias))

    def _widen(self, codes: torch.Tensor, rows: slice) -> torch.Tensor:
        """Rows of the unsigned codes (unpacked) as float weights."""
        return dequantize_codes(codes[rows].to(torch.int16) + self.scheme.qmin, self.weight_scale[rows], None, self.scheme)

    def dequantized_weight(self) -> torch.Tensor:
        return self._widen(unpack_codes(self.weight_packed, self.scheme.bits, self.in_features), slice(None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = unpack_codes(self.weight_packed, self.scheme.bits, self.in_features)  # once per forward
        return _blockwise(x, self.out_features, lambda rows: self._widen(codes, rows), self.bias)


class HalfLinear(nn.Module):
    """A float linear whose weight stays in its stored 16-bit dtype, widened for each matmul."""

    def __init__(self, module: nn.Linear, weight: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = module.in_features, module.out_features
        self.register_buffer("weight", weight)
        self.register_buffer("bias", None if module.bias is None else module.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _blockwise(x, self.out_features, lambda rows: self.weight[rows], self.bias)


HEAD_ROWS = 2048  # vocabulary rows widened at once: 4.5 MiB of float32 at hidden 576, 32 MiB at 4096


class HalfHead(nn.Module):
    """An output head whose weight stays 16-bit (shared with the embedding when tied), widened
    HEAD_ROWS rows at a time."""

    def __init__(self, weight: nn.Parameter, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the logits a generation step keeps: one position
        return _blockwise(x, self.weight.shape[0], lambda rows: self.weight[rows], self.bias, HEAD_ROWS)


def head_by_head_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           is_causal=None, **kwargs):
    """SDPA one query head at a time against the key/value head it shares (no repeated K/V);
    transformers' attention-function signature, (batch, heads, tokens, dim) in, (batch, tokens,
    heads, dim) out."""
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError("the lean runtime's attention takes neither softcap nor position bias")
    groups = query.shape[1] // key.shape[1]
    causal = query.shape[2] > 1 and attention_mask is None and (is_causal if is_causal is not None else True)
    heads = [F.scaled_dot_product_attention(query[:, h : h + 1], key[:, h // groups : h // groups + 1],
                                            value[:, h // groups : h // groups + 1], attn_mask=attention_mask,
                                            dropout_p=dropout, scale=scaling, is_causal=causal)
             for h in range(query.shape[1])]
    return torch.cat(heads, dim=1).transpose(1, 2).contiguous(), None


LEAN_ATTENTION = "lowbit_head_by_head"


def _narrowest_exact(t: torch.Tensor) -> torch.Tensor:
    """t in bfloat16 or float16 where that holds every value exactly (it was stored so), else as is."""
    for dtype in (torch.bfloat16, torch.float16):
        narrow = t.to(dtype)
        if torch.equal(narrow.to(t.dtype), t):
            return narrow
    return t


def _packable(module: nn.Module) -> bool:
    return (isinstance(module, QuantLinear) and module.input_quant is None and module.scheme.symmetric
            and module.scheme.strategy != "tensor" and module.weight_g_idx is None)


def _to_float32(module, args, output):
    return output.float()


def compact(model: nn.Module) -> dict:
    """Make a loaded model memory-lean in place (see the module docstring); returns what changed."""
    packed = [name for name, m in model.named_modules() if _packable(m)]
    for name in packed:
        _replace(model, name, PackedLinear(model.get_submodule(name)))
    head = model.get_output_embeddings()
    narrowed = 0
    for name, m in list(model.named_modules()):
        if type(m) is nn.Linear and m is not head:
            weight = _narrowest_exact(m.weight.detach())
            if weight.dtype != m.weight.dtype:
                _replace(model, name, HalfLinear(m, weight))
                narrowed += 1
    embedding = model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    table = _narrowest_exact(embedding.weight.data)
    if table.dtype != embedding.weight.dtype:
        embedding.weight = nn.Parameter(table, requires_grad=False)
        embedding.register_forward_hook(_to_float32)
        if tied:
            model.set_output_embeddings(HalfHead(embedding.weight, head.bias))
    if type(head) is nn.Linear and not tied:  # its own 16-bit copy
        weight = _narrowest_exact(head.weight.detach())
        if weight.dtype != head.weight.dtype:
            model.set_output_embeddings(HalfHead(nn.Parameter(weight, requires_grad=False), head.bias))
    attention = _use_head_by_head_attention(model)
    return {"packed_linears": len(packed), "half_linears": narrowed,
            "embedding_dtype": str(embedding.weight.dtype).removeprefix("torch."), "attention": attention}


def _use_head_by_head_attention(model: nn.Module) -> str:
    """Switch SDPA models to head_by_head_attention (sdpa's boolean masks); others keep theirs."""
    current = model.config._attn_implementation
    if current != "sdpa":
        return current
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(LEAN_ATTENTION, head_by_head_attention)
    AttentionMaskInterface.register(LEAN_ATTENTION, sdpa_mask)
    model.set_attn_implementation(LEAN_ATTENTION)
    return LEAN_ATTENTION


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
