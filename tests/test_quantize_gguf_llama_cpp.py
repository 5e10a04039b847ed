"""lowbit's reference rounding writes the bytes llama.cpp's own `llama-quantize` writes (no imatrix),
type by type, the I-quants and K-quants included: against the committed output of llama-quantize
(tests/llama_quantize_bytes.safetensors, made by tests/llama_quantize_bytes.py), and against the
built tool itself where it is built; and lowbit's file types give each tensor the type
llama-quantize gives it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from llama_quantize_bytes import FIXTURE, TYPES, hard_matrix, llama_cpp_tools, quantized_by_llama_cpp, write_llama
from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf
from lowbit.quantize.grids.gguf_packing import pack

QUANTIZE = llama_cpp_tools.tool("llama-quantize")


def lowbit_bytes(W: torch.Tensor, kind: str) -> np.ndarray:
    return pack(quantize_gguf(W, GGUFScheme(kind))).numpy()


def differing_rows(mine: np.ndarray, theirs: np.ndarray) -> list[int]:
    assert mine.shape == theirs.shape
    return np.nonzero((mine != theirs).any(axis=1))[0].tolist()


@pytest.mark.parametrize("kind", TYPES)
def test_reference_rounding_equals_llama_quantize_byte_for_byte(kind):
    stored = load_file(str(FIXTURE))
    assert torch.equal(stored["input"], hard_matrix())  # the fixture is of the matrix the generator draws
    assert differing_rows(lowbit_bytes(stored["input"], kind), stored[kind].numpy()) == []


@pytest.mark.skipif(QUANTIZE is None, reason="llama.cpp's tools are not built: python bench/llama_cpp_tools.py")
def test_the_built_llama_quantize_still_writes_the_committed_bytes_and_lowbits():
    W = hard_matrix(seed=1)  # a matrix the fixture does not hold
    stored = load_file(str(FIXTURE))
    live = quantized_by_llama_cpp(hard_matrix())
    assert all(np.array_equal(live[kind], stored[kind].numpy()) for kind in TYPES)
    fresh = quantized_by_llama_cpp(W)
    assert {kind: differing_rows(lowbit_bytes(W, kind), fresh[kind]) for kind in TYPES} == {k: [] for k in TYPES}


LLAMA_CPP_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}


@pytest.mark.skipif(QUANTIZE is None, reason="llama.cpp's tools are not built: python bench/llama_cpp_tools.py")
@pytest.mark.parametrize("file_type", ["q4_k_m", "iq4_nl", "iq4_xs"])
@pytest.mark.parametrize("kv_heads", [2, 8])  # 4 and 1 query heads per KV head
def test_file_types_give_each_tensor_llama_quantizes_type(tmp_path, file_type, kv_heads):
    import subprocess

    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowbit.calibrate.arch import arch_for
    from lowbit.quantize.grids.gguf_plan import GGUFTypes
    from lowbit.quantize.targets import slots

    layers, hidden, ffn = 16, 256, 768  # ffn_down rows of 768: 256 divides them; a fallback shows in none
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=kv_heads, vocab_size=64)
    model = LlamaForCausalLM(config)
    names = [f"model.layers.{i}.{part}" for i in range(layers) for part in LLAMA_CPP_NAMES]
    grids, kept = GGUFTypes(file_type).assign(slots(model, arch_for(model), names))
    assert not kept
    mine = {f"blk.{n.split('.')[2]}.{LLAMA_CPP_NAMES[n.split('.', 3)[3]]}.weight": g.type for n, g in grids.items()}
    tensors = {name: np.full(tuple(model.get_submodule(hf).weight.shape), 0.01, np.float32)
               for hf, name in zip(grids, mine)}  # (rows, columns): what llama.cpp's type rules read
    tensors["token_embd.weight"] = np.full((64, hidden), 0.01, np.float32)
    write_llama(tmp_path / "f32.gguf", tensors, hidden=hidden, ffn=ffn, layers=layers, heads=8, kv_heads=kv_heads)
    done = subprocess.run([str(QUANTIZE), str(tmp_path / "f32.gguf"), str(tmp_path / "q.gguf"), file_type.upper(), "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    written = gguf.GGUFReader(tmp_path / "q.gguf").tensors
    theirs = {t.name: t.tensor_type.name.lower() for t in written if t.name in mine}
    assert theirs == mine
