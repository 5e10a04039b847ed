"""rotate: an orthogonal rotation of the residual stream folded into the weights (QuaRot's and
SpinQuant's R1), before any quantization step.

With x' = x Q for every hidden state: the embedding becomes E Q, each linear reading the residual
stream W Q, each linear writing to it Qᵀ W (its bias b Q), and an RMSNorm whose weight is first
folded into the linears it feeds computes norm(x Q) = norm(x) Q, so the model computes the same
function. Nothing is left to do at runtime: the checkpoint is a plain model every runtime loads.
What changes is what the grids see: Q spreads each channel's outliers over all channels, so each
row's largest weight sits closer to the rest and a 4-bit or 3-bit step loses less.

A tied LM head is untied first (the head takes the final norm's weight, the embedding does not), so a
tied model's checkpoint gains a vocab x hidden head in 16 bits unless the recipe quantizes it.
Before returning, the step checks that the rotated model's logits on calibration tokens equal the
original's within `tolerance` (relative to the largest logit), and stops the run where they do not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lowbit.calibrate.arch import linear_weight
from lowbit.quantize.rotation import orthogonal
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.spec import StepSpec

# pre-norm decoders whose RMSNorms (weight only) each feed only linears, and whose residual stream is
# written only by o_proj and down_proj: the rotation folds into them exactly
ROTATABLE = ("llama", "mistral", "qwen2", "qwen3")
READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
WRITERS = ("self_attn.o_proj", "mlp.down_proj")
ROWS_AT_ONCE = 4096


@dataclass(frozen=True)
class RotateConfig:
    kind: Literal["hadamard", "random"] = "hadamard"  # randomized Hadamard, or a random orthogonal matrix
    seed: int = 0  # the draw of the Hadamard's column signs, or of the random matrix
    check_tokens: int = 128  # tokens of the first calibration sample the logits are compared on
    tolerance: float = 1e-4  # largest |logit change| / largest |logit| the rotated float model may show

    def __post_init__(self):
        if self.check_tokens < 1 or not 0 < self.tolerance < 1:
            raise ValueError(f"rotate: check_tokens must be >= 1 and tolerance in (0, 1), got {self.check_tokens}, "
                             f"{self.tolerance}")


def apply(ctx: StepContext, cfg: RotateConfig) -> dict:
    model, config = ctx.model, ctx.model.config.get_text_config()
    check_rotatable(model, ctx.arch.layers)
    tokens = ctx.batches[:1, :cfg.check_tokens]
    before = logits(model, tokens)
    q = orthogonal(config.hidden_size, cfg.kind, cfg.seed)
    untied = untie_head(model)
    rotate_model(model, ctx.arch.layers, q)
    error = ((logits(model, tokens) - before).abs().max() / before.abs().max()).item()
    if not error <= cfg.tolerance:
        raise ValueError(f"rotate: the rotated float model's logits differ from the original's by {error:.2e} of the "
                         f"largest logit, above tolerance {cfg.tolerance:g}: this model does not compute the same "
                         "function rotated (a norm or a linear the rotation does not know of)")
    return {"rotation": cfg.kind, "size": config.hidden_size, "seed": cfg.seed, "untied_head": untied,
            "logits_relative_error": error}


def check_rotatable(model: nn.Module, layers_path: str) -> None:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ROTATABLE:
        raise ValueError(f"rotate: supports the model types {', '.join(ROTATABLE)} (pre-norm decoders whose norms "
                         f"feed only linears); this model is {model_type!r}")
    linears = WRITERS + tuple(n for names in READERS.values() for n in names)
    for name, module in model.named_modules():
        if name.startswith(layers_path + ".") and name.endswith(linears) and type(module) is not nn.Linear:
            raise ValueError(f"rotate: {name} is already quantized; list rotate before every weight step")


@torch.no_grad()
def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(input_ids=tokens.to(device), use_cache=False).logits.double()


def untie_head(model: nn.Module) -> bool:
    """Give a tied LM head its own copy of the embedding; whether it was tied."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embedding.weight:
        return False
    head.weight = nn.Parameter(embedding.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    return True


@torch.no_grad()
def rotate_model(model: nn.Module, layers_path: str, q: torch.Tensor) -> None:
    """Every residual reader W -> W diag(norm weight) Q, writer W -> Qᵀ W, embedding E -> E Q."""
    rotate_columns(model.get_input_embeddings().weight, q)
    for layer in model.get_submodule(layers_path):
        for norm_name, reader_names in READERS.items():
            readers = [layer.get_submodule(n) for n in reader_names]
            fold_norm(layer.get_submodule(norm_name), readers)
            for reader in readers:
                rotate_columns(linear_weight(reader), q)
        for writer in (layer.get_submodule(n) for n in WRITERS):
            rotate_rows(writer, q)
    decoder = model.get_submodule(layers_path.rpartition(".")[0])
    head = model.get_output_embeddings()
    fold_norm(decoder.norm, [head])
    rotate_columns(head.weight, q)


def fold_norm(norm: nn.Module, linears: list[nn.Module]) -> None:
    """The norm's weight into the columns of the linears it feeds; the norm's weight then 1."""
    if getattr(norm, "bias", None) is not None:
        raise ValueError(f"rotate: {type(norm).__name__} has a bias; only weight-only RMSNorms fold")
    for linear in linears:
        weight = linear_weight(linear)
        weight.copy_((weight.double() * norm.weight.double()).to(weight.dtype))
    norm.weight.fill_(1.0)


def rotate_columns(weight: torch.Tensor, q: torch.Tensor) -> None:
    """W -> W Q: a matrix whose rows are read against (or are) hidden states; in float64, a slice of
    rows at a time (a 129k-row embedding would take 7 GB whole)."""
    q = q.to(weight.device)
    for rows in weight.split(ROWS_AT_ONCE):
        rows.copy_((rows.double() @ q).to(rows.dtype))


def rotate_rows(linear: nn.Module, q: torch.Tensor) -> None:
    """W -> Qᵀ W and b -> b Q: a linear whose output is added to the residual stream."""
    weight = linear_weight(linear)
    q = q.to(weight.device)
    weight.copy_((q.T @ weight.double()).to(weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_((linear.bias.double() @ q).to(linear.bias.dtype))


SPEC = StepSpec("rotate", RotateConfig, apply,
                "rotate the residual stream by a randomized Hadamard matrix folded into the weights (before "
                "quantizing): outliers spread over all channels",
                streamed=lambda cfg: "rotate changes the embedding and the head, which a streamed run reads as they "
                                     "are (set calibration.streaming: false)",
                runs_first=True)
