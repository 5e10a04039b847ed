"""The hidden states a causal LM hands its LM head, without its full-vocabulary logits."""
from __future__ import annotations

import inspect

import torch

# config keys of models whose logits are more than head(hidden): Gemma's soft-capping, Cohere's and Granite's scaling
POST_PROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def final_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, d): what the model's LM head receives for `ids`; the head itself runs on the last position only."""
    head = model.get_output_embeddings()
    kept = {}

    def keep_and_cut(module, args):
        kept["hidden"] = args[0]
        return (args[0][:, -1:],) + tuple(args[1:])

    handle = head.register_forward_pre_hook(keep_and_cut)
    # every position reaches the head's input (0: all; the hook cuts them), as models that slice first would not
    keep = {"logits_to_keep": 0} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    try:
        model(input_ids=ids, use_cache=False, **keep)
    finally:
        handle.remove()
    hidden = kept.get("hidden")
    if hidden is None or hidden.shape[:2] != ids.shape:
        raise ValueError(f"{type(model).__name__} did not call its LM head on every position's hidden state")
    return hidden


def post_processed_logits(config, step: str) -> None:
    """Refuse a model whose logits are post-processed after its head: `step` compares head outputs."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in POST_PROCESSING:
        value = getattr(cfg, key, None)
        if value not in (None, 0, 1, 1.0):
            raise ValueError(f"{step}: the model's config sets {key}={value}: its logits are post-processed after "
                             f"the LM head, which {step} does not reproduce yet")
