"""Checks run right after the model loads, so a run that cannot finish fails before any work."""
from __future__ import annotations

from lowbit.calibrate.checks import check_finite_weights
from lowbit.evaluate.perplexity import bos_id


def preflight(recipe, model, tokenizer) -> None:
    check_finite_weights(model)  # NaN/inf weights: every scale would be NaN (streamed: per layer, as read)
    preflight_tokenizer(recipe, tokenizer)


def preflight_tokenizer(recipe, tokenizer) -> None:
    if recipe.evaluate.perplexity.bos:
        bos_id(tokenizer)  # raises, naming evaluate.perplexity.bos, if the tokenizer has no BOS/EOS
