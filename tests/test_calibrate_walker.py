"""The layer-wise walker reproduces the full model when nothing is changed."""
from __future__ import annotations

import pytest
import torch

from lowbit.calibrate.arch import arch_for, decoder_layers
from lowbit.calibrate.walker import capture_first_layer_inputs, record_linear_inputs, walk


def _last_layer_outputs(model, arch, ids, mask=None):
    """What the last decoder layer returns in an ordinary full forward."""
    captured = {}
    last = decoder_layers(model, arch)[-1]
    handle = last.register_forward_hook(lambda m, a, out: captured.setdefault("out", out))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    handle.remove()
    out = captured["out"]
    return out[0] if isinstance(out, tuple) else out


def test_walk_reproduces_full_forward(tiny_model):  # llama, qwen2, gemma3_text, opt
    model = tiny_model
    arch = arch_for(model)
    ids = torch.randint(3, 512, (5, 24), generator=torch.Generator().manual_seed(1))
    seen = []
    result = walk(model, arch, ids, lambda i, name, layer, inputs: seen.append(name) or i,
                  micro_batch=2)
    expected = _last_layer_outputs(model, arch, ids)
    assert list(result) == list(range(len(decoder_layers(model, arch))))
    assert seen == [f"{arch.layers}.{i}" for i in range(len(result))]
    assert len(result.hidden) == 3  # micro-batches of 2, 2, 1
    torch.testing.assert_close(torch.cat(result.hidden), expected, rtol=1e-4, atol=1e-5)


def test_gemma3_layers_get_their_own_kwargs():
    """Gemma 3 alternates sliding-window and global layers with different rotary tables."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              vocab_size=512, layer_types=["sliding_attention", "full_attention"],
                              sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    arch = arch_for(model)
    ids = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(2))
    result = walk(model, arch, ids, lambda *a: None)
    torch.testing.assert_close(torch.cat(result.hidden), _last_layer_outputs(model, arch, ids),
                               rtol=1e-4, atol=1e-5)


def test_record_linear_inputs_shares_inputs_and_drops_padding(tiny_llama):
    arch = arch_for(tiny_llama)
    ids = torch.randint(3, 512, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding: 4 pad tokens in the second sample
    inputs = capture_first_layer_inputs(tiny_llama, arch, ids, micro_batch=2, attention_mask=mask)
    calls = []
    layer = decoder_layers(tiny_llama, arch)[0]
    names = list(arch.groups[0])  # q, k, v share one input
    record_linear_inputs(layer, names, inputs, None, lambda n, x: calls.append((n, x)))
    assert [n for n, _ in calls] == names
    assert calls[0][1] is calls[1][1] is calls[2][1]
    assert calls[0][1].shape == (16, 128)  # 20 tokens, 4 of them padding


def test_while_alive_holds_no_tensor_and_forgets_a_freed_one():
    """The walker's input cache and the Hessians' sharing map go with the forward's tensors: an
    expert's down_proj input must be freed once it has run, not at the end of the layer's forward."""
    import weakref

    from lowbit.calibrate.walker import WhileAlive

    cache = WhileAlive()
    x = torch.ones(4, 3)
    rows = x[:2] * 2  # a value made from its key (the unpadded rows) lives as long as the key
    cache.put(x, rows)
    assert cache.get(x) is rows and cache.get(rows) is None
    key, value = weakref.ref(x), weakref.ref(rows)
    del x, rows
    assert key() is None and value() is None and not cache._entries
    y = torch.zeros(2, 2)
    cache.put(y, y)  # a key that is its own value: held weakly too
    assert cache.get(y) is y
    held = weakref.ref(y)
    del y
    assert held() is None and not cache._entries
    assert cache.get(torch.zeros(2, 2)) is None  # a new tensor, perhaps at a freed one's id


def test_record_linear_inputs_names_missing_linears(tiny_llama):
    arch = arch_for(tiny_llama)
    ids = torch.randint(3, 512, (1, 8))
    inputs = capture_first_layer_inputs(tiny_llama, arch, ids)
    layer = decoder_layers(tiny_llama, arch)[0]
    layer.extra = torch.nn.Linear(128, 128)  # a linear the forward never calls
    with pytest.raises(RuntimeError, match="extra"):
        record_linear_inputs(layer, ["self_attn.q_proj", "extra"], inputs, None, lambda n, x: None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_walk_on_cuda_matches_cpu_and_leaves_layers_home(tiny_llama):
    arch = arch_for(tiny_llama)
    ids = torch.randint(3, 512, (6, 40), generator=torch.Generator().manual_seed(5))
    devices = []
    cpu = walk(tiny_llama, arch, ids, lambda *a: None)
    cuda = walk(tiny_llama, arch, ids, lambda i, n, layer, inputs: devices.append(
        {p.device.type for p in layer.parameters()}), device="cuda")
    assert devices == [{"cuda"}] * len(devices)  # the current layer runs on the device
    assert {p.device.type for p in tiny_llama.parameters()} == {"cpu"}  # and goes back home
    torch.testing.assert_close(torch.cat([h.cpu() for h in cuda.hidden]), torch.cat(cpu.hidden),
                               rtol=1e-3, atol=1e-4)
