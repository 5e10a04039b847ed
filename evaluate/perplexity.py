"""Perplexity under a pinned, recorded protocol (see PerplexityProtocol)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lowbit.calibrate.data import load_text
from lowbit.calibrate.progress import Progress

from .config import PerplexityProtocol
from .logits import BatchLogits, batch_logits

WINDOWS_PER_BATCH = 4


def bos_id(tokenizer) -> int:
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("perplexity protocol has bos: true but the tokenizer has neither a BOS nor "
                         "an EOS token; set evaluate.perplexity.bos=false")
    return token


def eval_tokens(tokenizer, protocol: PerplexityProtocol) -> torch.Tensor:
    text = load_text(protocol.dataset, "eval")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if len(ids) < protocol.context_len:
        raise ValueError(f"evaluation text {protocol.dataset!r} has {len(ids)} tokens, fewer than "
                         f"one window of {protocol.context_len}")
    return ids[: protocol.max_tokens]


def windows(n_tokens: int, protocol: PerplexityProtocol) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) spans of the token stream; each token is scored once."""
    body = protocol.context_len - int(protocol.bos)
    stride = min(protocol.stride, body)
    spans, scored_to = [], 0 if protocol.bos else 1
    begin = 0
    while scored_to < n_tokens:
        end = min(begin + body, n_tokens)
        spans.append((begin, end, scored_to))
        scored_to = end
        begin += stride
    return spans


def window_batches(ids: torch.Tensor, prefix: list[int], spans: list[tuple[int, int, int]]):
    """(inputs, attention_mask, labels) per batch of windows; labels are -100 where not scored."""
    for i in range(0, len(spans), WINDOWS_PER_BATCH):
        batch = spans[i : i + WINDOWS_PER_BATCH]
        width = max(e - b for b, e, _ in batch) + len(prefix)
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (b, e, first) in enumerate(batch):
            seq = torch.tensor(prefix + ids[b:e].tolist())
            inputs[row, : len(seq)], mask[row, : len(seq)] = seq, 1
            scored = slice(len(prefix) + first - b, len(seq))
            labels[row, scored] = seq[scored]
        yield inputs, mask, labels


@torch.no_grad()
def perplexity(model, tokenizer, protocol: PerplexityProtocol) -> dict:
    ids = eval_tokens(tokenizer, protocol)
    prefix = [bos_id(tokenizer)] if protocol.bos else []
    nll, count = 0.0, 0
    spans = windows(len(ids), protocol)
    progress = Progress("perplexity", len(spans), "windows")
    for inputs, mask, labels in window_batches(ids, prefix, spans):
        batch_nll, batch_count = scored_nll(model_batch_logits(model, inputs, mask, "perplexity"), labels)
        nll, count = nll + batch_nll, count + batch_count
        progress.advance(len(inputs))
    return summary(nll, count, spans, prefix, protocol)


def model_batch_logits(model, inputs: torch.Tensor, mask: torch.Tensor, label: str) -> BatchLogits:
    """One batch of windows through `model` on its device, its logits to be drawn in chunks."""
    device = next(model.parameters()).device  # no use_cache: the config decides (a quantized KV cache applies)
    return batch_logits(model, lambda extra: model(input_ids=inputs.to(device), attention_mask=mask.to(device),
                                                   **extra), label)


def scored_nll(batch: BatchLogits, labels: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL of a batch of windows over its scored labels (float32 logits, one
    chunk of tokens at a time), and their count."""
    scored = labels[:, 1:] != -100
    targets = labels[:, 1:][scored]
    nll, done = 0.0, 0
    for logits in batch.scored_chunks(scored):
        part = targets[done : done + len(logits)].to(logits.device)
        nll += F.cross_entropy(logits, part, reduction="sum").item()
        done += len(logits)
    return nll, len(targets)


def summary(nll: float, count: int, spans: list, prefix: list[int], protocol: PerplexityProtocol) -> dict:
    return {
        "perplexity": math.exp(nll / count),
        "nll_per_token": nll / count,
        "tokens_scored": count,
        "windows": len(spans),
        "bos_token_id": prefix[0] if prefix else None,
        "stride_effective": min(protocol.stride, protocol.context_len - int(protocol.bos)),
    }
