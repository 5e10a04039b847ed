"""Handing a KV cache to a transformers forward, on every transformers 5.x.

transformers 5.17 names a forward's cache argument and output field `past_key_values`; newer 5.x
releases (5.25) name both `cache`. A forward ignores a cache passed under the wrong name (its **kwargs
swallow it) and makes a fresh one, so a caller that guessed the name would run without its cache
and never know: here the name is read from the forward's signature, and a forward that returns a
cache other than the one it was given is an error.
"""
from __future__ import annotations

import functools
import inspect

from torch import nn

CACHE_KEYWORDS = ("cache", "past_key_values")  # newest first


def cache_keyword(module: nn.Module) -> str:
    """The name under which `module.forward` (a model or a decoder layer) takes its KV cache."""
    forward = module.forward
    return _keyword_of(getattr(forward, "__func__", forward), type(module).__name__)


@functools.lru_cache(maxsize=256)  # read once per forward function: decode steps are timed
def _keyword_of(forward, owner: str) -> str:
    params = inspect.signature(forward).parameters
    for name in CACHE_KEYWORDS:
        if name in params:
            return name
    raise ValueError(f"{owner}.forward takes its KV cache as neither of {list(CACHE_KEYWORDS)}: "
                     "lowbit cannot hand it a cache")


def returned_cache(output):
    """The cache a forward or generate() returned, under whichever name its output class declares."""
    fields = getattr(output, "__dataclass_fields__", {})
    for name in CACHE_KEYWORDS:
        if name in fields:  # declared fields only: newer releases keep a warning `past_key_values` alias
            return getattr(output, name)
    return None


def cached_forward(model: nn.Module, input_ids, cache=None, **kwargs):
    """model(input_ids) reading and extending `cache` -> (output, the cache to pass next time).

    `cache=None` lets the model make its own (or lets a hook such as lowbit's quantized KV cache
    supply one); a cache that was passed must come back, or the forward ran without it."""
    keyword = cache_keyword(model)
    output = model(input_ids=input_ids, use_cache=True, **{keyword: cache}, **kwargs)
    got, name = returned_cache(output), type(model).__name__
    if got is None:
        raise ValueError(f"{name}.forward returned no KV cache (as any of {list(CACHE_KEYWORDS)}) with use_cache=True")
    if cache is not None and got is not cache:
        raise ValueError(f"{name}.forward was given a {type(cache).__name__} as `{keyword}` and returned a "
                         f"different {type(got).__name__}: it ran without the cache it was given")
    return output, got
