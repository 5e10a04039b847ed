"""Evaluation options and the pinned perplexity protocol."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PerplexityProtocol:
    """Pinned so that figures from different runs compare; recorded in results.json."""

    dataset: str = "wiki"  # built-in corpora use their evaluation part
    context_len: int = 512  # tokens per window, BOS included
    stride: int = 512  # >= context_len - BOS: disjoint windows; smaller: sliding, each token scored once
    max_tokens: int = 16384  # tokens of the evaluation text used (before windowing)
    bos: bool = True  # prepend the tokenizer's BOS (EOS if it has none) to every window; not scored

    def __post_init__(self):
        if not 1 <= self.stride <= self.context_len:
            raise ValueError(f"stride must be between 1 and context_len ({self.context_len}), got {self.stride}")
        if self.context_len < 2 or self.max_tokens < self.context_len:
            raise ValueError("need context_len >= 2 and max_tokens >= context_len")


@dataclass(frozen=True)
class EvaluateConfig:
    perplexity: PerplexityProtocol = field(default_factory=PerplexityProtocol)
    baseline: bool = True  # also measure the unquantized model (cached per model and protocol)
