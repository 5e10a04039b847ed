"""KL divergence of next-token distributions against the unquantized model, and top-1 agreement.

KL(P_baseline || P_quantized) per scored token, on the same windows as perplexity (the first
`kl.max_tokens` tokens of its evaluation text); reported as mean and p99 over tokens.
"""
from __future__ import annotations

import dataclasses

import torch

from .config import KLConfig, PerplexityProtocol
from .perplexity import bos_id, eval_tokens, model_batch_logits, window_batches, windows


def token_kl(ref_logits: torch.Tensor, logits: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """KL(softmax(ref) || softmax(logits)) along the last dimension, in nats; shape (...).
    In float32 rounding alone gives ~1e-7 nats; float64 resolves the tiny KLs of one linear."""
    ref_logp = torch.log_softmax(ref_logits.to(dtype), dim=-1)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)  # clamp: rounding below 0


def top1_agree(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """True where both put their highest probability on the same token; shape (...)."""
    return ref_logits.argmax(-1) == logits.argmax(-1)


def summarize(kl: torch.Tensor, agree: torch.Tensor) -> dict:
    """Mean / p99 / max KL and top-1 agreement over a flat set of tokens."""
    kl = kl.double().flatten()
    return {
        "kl_mean": kl.mean().item(),
        "kl_p99": torch.quantile(kl, 0.99).item(),
        "kl_max": kl.max().item(),
        "top1_agreement": agree.double().mean().item(),
        "tokens": kl.numel(),
    }


def kl_protocol(protocol: PerplexityProtocol, cfg: KLConfig) -> PerplexityProtocol:
    """The perplexity protocol cut to the first kl.max_tokens tokens (at least one window)."""
    tokens = max(min(cfg.max_tokens, protocol.max_tokens), protocol.context_len)
    return dataclasses.replace(protocol, max_tokens=tokens)


@torch.no_grad()
def kl_divergence(reference, model, tokenizer, protocol: PerplexityProtocol, cfg: KLConfig) -> dict:
    """Compare `model` with `reference` (the unquantized model) token by token."""
    protocol, batches = kl_batches(tokenizer, protocol, cfg)
    ref_logits = (model_batch_logits(reference, inputs, mask, "KL reference") for inputs, mask, _ in batches)
    return compare_batches(ref_logits, model, batches, protocol)


def kl_batches(tokenizer, protocol: PerplexityProtocol, cfg: KLConfig) -> tuple[PerplexityProtocol, list]:
    """The KL protocol and its (inputs, mask, labels) batches of windows, for either reference."""
    protocol = kl_protocol(protocol, cfg)
    ids = eval_tokens(tokenizer, protocol)
    prefix = [bos_id(tokenizer)] if protocol.bos else []
    return protocol, list(window_batches(ids, prefix, windows(len(ids), protocol)))


@torch.no_grad()
def compare_batches(ref_logits, model, batches: list, protocol: PerplexityProtocol) -> dict:
    """KL and top-1 agreement of `model` against `ref_logits`, an iterable of each batch's reference
    BatchLogits drawn in step with the batches: the model runs batch by batch too, and both heads
    run over the scored tokens a chunk at a time, so neither model's full-vocabulary logits of a
    batch ever exist; only the scored tokens' KLs are kept."""
    kls, agrees = [], []
    for ref_batch, (inputs, mask, labels) in zip(ref_logits, batches):
        scored = labels[:, 1:] != -100  # positions whose next token is scored
        ours = model_batch_logits(model, inputs, mask, "KL")
        for ref, out in zip(ref_batch.scored_chunks(scored), ours.scored_chunks(scored)):
            ref = ref.to(out.device)
            kls.append(token_kl(ref, out).cpu())
            agrees.append(top1_agree(ref, out).cpu())
        del ref_batch, ours
    return {**summarize(torch.cat(kls), torch.cat(agrees)), "max_tokens": protocol.max_tokens}
