"""GGUF metadata for RoPE scaling and for what llama.cpp's graphs fix rather than read (#32): Llama
3's RoPE as llama.cpp's rope_freqs tensor, Llama 4's fixed layer patterns, DeepSeek's rotation order.
llama.cpp itself runs the files in test_moe_llama_cpp.py."""
import gguf
import pytest
import torch

from gguf_models import gguf_tiny, smollm2_tokenizer
from tiny_moe import LLAMA3_ROPE, moe_config
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.export.formats.gguf.names import arch_of
from lowbit.export.formats.gguf.rope import rope_freqs



def test_rope_freqs_are_the_divisors_transformers_applies():
    """transformers' own Llama 3 inverse frequencies equal the default ones divided by the file's tensor."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=LLAMA3_ROPE)
    divisors = rope_freqs(config)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = 64
    default = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    assert divisors.shape == (dim // 2,) and divisors.min() == 1.0 and divisors.max() == 8.0  # all three regimes
    assert ((1.0 < divisors) & (divisors < 8.0)).any()
    torch.testing.assert_close(default / divisors, scaled.float(), rtol=1e-5, atol=0)
    assert rope_freqs(LlamaConfig(hidden_size=256, num_attention_heads=4)) is None


def test_a_llama_with_llama3_rope_writes_its_divisors_and_reads_back(tmp_path):
    tokenizer = smollm2_tokenizer()
    model = gguf_tiny("llama", rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)
    out = checkpoint.save(model, tokenizer, tmp_path / "ckpt", ExportConfig(format="gguf", dtype="float32"))
    tensors = {t.name: t for t in gguf.GGUFReader(str(out / "model.gguf")).tensors}
    torch.testing.assert_close(torch.from_numpy(tensors["rope_freqs.weight"].data.copy()), rope_freqs(model.config))
    # transformers' gguf_file= loader would drop the scaling: the folder says so and carries the tokenizer
    assert (out / "tokenizer.json").is_file()
    loaded, _ = checkpoint.load(out)
    ids = torch.randint(3, 4000, (1, 96), generator=torch.Generator().manual_seed(0))  # past 64: scaling shows
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("key,value", [("no_rope_layers", [1, 1, 1, 1]), ("attention_chunk_size", 4096),
                                       ("use_qk_norm", False), ("floor_scale", 4096)])
def test_llama4_settings_llama_cpp_fixes_are_refused_naming_the_key(key, value):
    config = moe_config("llama4_text", smollm2_tokenizer(), num_hidden_layers=4)
    arch_of(config, "here")  # as the released models have it: accepted
    setattr(config, key, value)
    with pytest.raises(ValueError, match=f"here: llama.cpp's llama4 graph computes {key} "):
        arch_of(config, "here")


def test_deepseek_rotation_of_half_split_heads_is_refused():
    config = moe_config("deepseek_v3", smollm2_tokenizer(), rope_interleave=False)
    with pytest.raises(ValueError, match="rope_interleave: false"):
        arch_of(config, "here")
