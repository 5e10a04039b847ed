"""Next-token logits a bounded number of tokens at a time.

A batch of windows' full-vocabulary logits is B·L·V floats (4 × 512 × 128k in float32: 1 GB), and
KL holds several such tensors at once. Here the model runs once per batch with its LM head given
only the last position (a pre-hook keeps the full final hidden states, B·L·d), and the head then
runs over the scored positions LOGITS_CHUNK_BYTES of float32 logits at a time. What the model does
to the head's output (Gemma's soft-capping, Cohere's and Granite's logit scaling) is found by
trying the candidates its config names against the model's own last-position logits of every
batch; a model where none agrees gets its full logits computed as before (correct, unbounded).

Evaluation's memory beyond the model(s) is then one batch's decoder activations and final hidden
states plus a few logit chunks (at most 8 × LOGITS_CHUNK_BYTES in KL), whatever the vocabulary.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

LOGITS_CHUNK_BYTES = 32 * 2**20  # float32 logits per chunk: 65 tokens at a 128k vocabulary


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk so that one chunk's float32 logits fit in LOGITS_CHUNK_BYTES."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab))


def _identity(z):
    return z


def head_transforms(config) -> list[tuple[str, Callable]]:
    """What a model may do to its LM head's output, most common first (its config names them)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = [("none", _identity)]
    if getattr(cfg, "final_logit_softcapping", None):  # Gemma 2/3/4
        cap = float(cfg.final_logit_softcapping)
        out.append((f"softcap {cap}", lambda z: torch.tanh(z / cap) * cap))
    for name in ("logit_scale", "logits_scaling"):  # Cohere multiplies; Granite divides; some multiply
        value = getattr(cfg, name, None)
        if isinstance(value, (int, float)) and value not in (0, 1):
            out += [(f"× {name}", lambda z, v=float(value): z * v), (f"÷ {name}", lambda z, v=float(value): z / v)]
    return out


@dataclass
class BatchLogits:
    """One batch's final hidden states and how to turn any of them into the model's logits.
    `transform` None: the model's head could not be reproduced; `full` holds its own logits."""

    head: nn.Module
    vocab: int
    hidden: Optional[torch.Tensor]  # (B, W, d), what the model hands its LM head
    transform: Optional[Callable]
    full: Optional[torch.Tensor] = None  # (B, W, V) when the head is not reproduced
    post: str = "none"  # which of head_transforms' candidates reproduced the model's logits

    def scored_chunks(self, scored: torch.Tensor) -> Iterator[torch.Tensor]:
        """float32 logits (n, V) of the positions where `scored` (B, W-1) is true, predicting the
        next token, chunk_rows(V) positions at a time, in row-major order."""
        source = self.full if self.transform is None else self.hidden
        picked = source[:, :-1][scored.to(source.device)]
        rows = chunk_rows(self.vocab)
        for start in range(0, len(picked), rows):
            part = picked[start : start + rows]
            yield part.float() if self.transform is None else self.transform(self.head(part)).float()


@torch.no_grad()
def batch_logits(model, run: Callable[[dict], object], label: str = "") -> BatchLogits:
    """Run the model once (`run(extra_kwargs)` returns its output) with its LM head fed only the
    last position, keeping the full final hidden states; the head's post-processing is the
    transform that reproduces the model's own last-position logits."""
    head = model.get_output_embeddings()
    kept = {}

    def keep_and_cut(module, args):
        kept["hidden"] = args[0]
        return (args[0][:, -1:],) + tuple(args[1:])

    handle = head.register_forward_pre_hook(keep_and_cut) if head is not None else None
    try:
        out = run(logits_to_keep(model, 0))
    finally:
        if handle is not None:
            handle.remove()
    hidden = kept.get("hidden")
    if hidden is None or hidden.dim() != 3:
        return _unreproduced(model, head, out.logits, label, "its LM head was not called on the hidden states",
                             rerun=lambda: run(logits_to_keep(model, 0)))
    own = out.logits[:, -1]
    mine = head(hidden[:, -1:])[:, -1]
    for name, transform in head_transforms(model.config):
        if _agree(transform(mine), own):
            return BatchLogits(head, own.shape[-1], hidden, transform, post=name)
    return _unreproduced(model, head, None, label, "no known logit post-processing matches its own logits",
                         rerun=lambda: run(logits_to_keep(model, 0)))


def logits_to_keep(model, positions: int) -> dict:
    """Forward kwargs under which the head computes the logits of the last `positions` positions
    (0: every one), where the model's forward takes logits_to_keep; {} (all of them) where not."""
    import inspect

    return {"logits_to_keep": positions} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _agree(mine: torch.Tensor, own: torch.Tensor) -> bool:
    """Equal up to rounding: the same head on the same hidden state, batched differently."""
    if mine.shape != own.shape:
        return False
    relative = 1e-4 if own.dtype == torch.float32 else 1e-2
    mine, own = mine.float(), own.float()
    scale = own.abs().max().item() + 1.0
    tolerance = relative * scale
    return math.isfinite(scale) and (mine - own).abs().max().item() <= tolerance


def _unreproduced(model, head, logits, label: str, why: str, rerun: Callable) -> BatchLogits:
    warnings.warn(f"lowbit: {label or type(model).__name__}: {why}; its full logits are computed per batch "
              "(evaluation memory grows with the vocabulary)")
    if logits is None or logits.shape[1] == 1:
        logits = rerun().logits
    return BatchLogits(head, logits.shape[-1], None, None, full=logits, post="unknown")
