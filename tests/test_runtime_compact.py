"""The memory-lean runtime: the same outputs from the bytes a checkpoint stores."""
from __future__ import annotations

import torch

from tiny_models import run_on_tiny_llama
from lowbit.evaluate.memory import resident_tensor_bytes
from lowbit.evaluate.peak_probe import prefill_and_decode
from lowbit.export import checkpoint
from lowbit.quantize.grids.formats import format_bytes
from lowbit.quantize.runtime.compact import PackedLinear, compact

PLAN = {"down_proj": "int3_g64", "o_proj": "int8", "v_proj": "f16"}


def _quantized_checkpoint(tmp_path):
    code, out = run_on_tiny_llama(tmp_path, {"scheme": {"formats": PLAN, "default": "int4_g64"},
                                             "steps": [{"rtn": {}}]}, seed=2)
    assert code == 0
    return out


def test_the_lean_model_holds_the_stored_bytes_and_computes_the_same(tmp_path):
    out = _quantized_checkpoint(tmp_path)
    model = checkpoint.load(out)[0].eval()
    ids = torch.randint(3, 5000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
    held_before = resident_tensor_bytes(model)
    changed = compact(model)
    assert changed == {"packed_linears": 12, "half_linears": 2, "embedding_dtype": "bfloat16",  # v_proj: f16
                       "attention": "lowbit_head_by_head"}
    assert all(m.weight.dtype == torch.bfloat16 for n, m in model.named_modules() if n.endswith("v_proj"))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still one table
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    for name, m in packed.items():  # codes as compressed-tensors stores them, 16-bit scales
        kind = next((k for p, k in PLAN.items() if name.endswith(p)), "int4_g64")
        stored = format_bytes(kind, m.out_features, m.in_features) - 16  # less weight_shape
        assert m.weight_packed.nbytes + m.weight_scale.nbytes == stored
    assert resident_tensor_bytes(model) < held_before / 1.8
    with torch.no_grad():
        after = model(input_ids=ids, use_cache=False).logits
    # identical weights, widened to float32 as before; attention head by head in another order
    assert torch.allclose(after, before, atol=1e-4, rtol=1e-4)


def test_a_chunked_prefill_fills_the_same_cache_as_one_forward(tmp_path):
    model = checkpoint.load(_quantized_checkpoint(tmp_path))[0].eval()
    ids = torch.randint(3, 5000, (1, 48), generator=torch.Generator().manual_seed(1))
    whole = prefill_and_decode(model, ids, decode_tokens=2)
    chunked = prefill_and_decode(model, ids, decode_tokens=2, chunk=16)
    assert whole == chunked == 2 * 2 * 50 * 64 * 4  # K+V x layers x tokens x kv width x float32


def test_head_by_head_attention_over_a_chunked_prefill_is_sdpa_s(tmp_path):
    """The last chunk of a prefill attends over the cache with a mask: the case the lean runtime
    changes; its logits match transformers' SDPA path, with a float and with a quantized cache."""
    from lowbit.calibrate.cached_forward import cached_forward
    from lowbit.quantize.grids.kv import KVCacheConfig
    from lowbit.quantize.runtime.kv_cache import attach

    out = _quantized_checkpoint(tmp_path)
    ids = torch.randint(3, 5000, (1, 48), generator=torch.Generator().manual_seed(2))
    for kv in (None, KVCacheConfig("int4", "token")):
        logits = []
        for lean in (False, True):
            model = checkpoint.load(out)[0].eval()
            if kv is not None:
                attach(model, kv)
            if lean:
                compact(model)
            with torch.no_grad():
                _, cache = cached_forward(model, ids[:, :32])  # the model's own: quantized where attached
                logits.append(cached_forward(model, ids[:, 32:], cache)[0].logits)
        assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_an_untied_head_keeps_its_own_16_bit_copy():
    from tiny_models import make_tiny_model

    model = make_tiny_model("llama")
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie
    model.to(torch.bfloat16).to(torch.float32).eval()  # float32 weights a 16-bit file would give
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        changed = compact(model)
        after = model(input_ids=ids).logits
    head, table = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert changed["half_linears"] == 14 and head.dtype == table.dtype == torch.bfloat16 and head is not table
    assert torch.allclose(after, before, atol=0.05, rtol=0.02)
