"""Handing a KV cache to a forward on any transformers 5.x: the keyword the installed release takes,
the cache it returns, and a forward that ran without the cache it was given caught."""
from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache

from lowbit.calibrate.cached_forward import cache_keyword, cached_forward, returned_cache
from lowbit.quantize.grids.kv import KVCacheConfig
from lowbit.quantize.runtime import kv_cache


def _ids(tokens, seed=0):
    return torch.randint(3, 500, (1, tokens), generator=torch.Generator().manual_seed(seed))


def test_the_keyword_is_the_one_the_installed_forward_declares(tiny_llama):
    for module in (tiny_llama, tiny_llama.model, tiny_llama.model.layers[0]):
        declared = inspect.signature(module.forward).parameters
        assert cache_keyword(module) in declared
        assert set(declared) & {"cache", "past_key_values"} == {cache_keyword(module)}  # one of them, not both


@torch.no_grad()
def test_a_passed_cache_comes_back_extended_and_decoding_from_it_matches_one_forward(tiny_llama):
    ids = _ids(12)
    full = tiny_llama(input_ids=ids, use_cache=False).logits
    out, cache = cached_forward(tiny_llama, ids[:, :8])  # the model makes its own cache
    first = cache
    for t in range(8, 12):
        out, cache = cached_forward(tiny_llama, ids[:, t : t + 1], cache)
        assert torch.allclose(out.logits[:, -1], full[:, t], atol=1e-4)  # the history was read from it
    assert cache is first and cache.get_seq_length() == 12


@torch.no_grad()
def test_generate_output_names_the_cache_it_decoded_with(tiny_llama):
    got = tiny_llama.generate(_ids(5), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(returned_cache(got), DynamicCache) and returned_cache(got).get_seq_length() == 7


@torch.no_grad()
def test_a_forward_that_swaps_the_given_cache_is_an_error(tiny_llama):
    # the quantized-KV hook replaces an empty DynamicCache with its own: the forward really runs
    # without the cache the caller holds, which is what a caller that keeps its own must not miss
    kv_cache.attach(tiny_llama, KVCacheConfig("int8", "token"))
    given = DynamicCache(config=tiny_llama.config)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.forward was given a DynamicCache .* returned a "
                                         r"different QuantizedKVCache"):
        cached_forward(tiny_llama, _ids(4), given)
    assert given.get_seq_length() == 0
    _, supplied = cached_forward(tiny_llama, _ids(4))  # no cache given: the hook's is the model's own
    assert isinstance(supplied, kv_cache.QuantizedKVCache) and supplied.get_seq_length() == 4


def test_a_forward_without_a_cache_argument_is_named():
    with pytest.raises(ValueError, match=r"Linear.forward takes its KV cache as neither of \['cache', 'past_key_v"):
        cache_keyword(torch.nn.Linear(2, 2))
