"""GGUF from the command line: `lowbit export --format gguf --type` rounds a float checkpoint by
llama.cpp's reference quantizer (with its fallback where rows do not split into the type's block),
`lowbit eval` treats the result like any checkpoint, and bad input or a failed write is refused."""
from __future__ import annotations

import errno
import json

import numpy as np
import pytest

from export_helpers import quantized_tiny
from faults import file_size_limit
from gguf_models import float_tiny, gguf_tiny, smollm2_tokenizer
from test_evaluate_results import QUICK_EVAL
from tiny_models import make_tiny_model, save_tiny_llama
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.export.files import OutOfSpaceError
from lowbit.export.formats.gguf.reader import gguf_tensor_bytes
from lowbit.quantize.grids.gguf import fallback_type
from lowbit.quantize.grids.kv import KVCacheConfig
from lowbit.quantize.runtime.kv_cache import attach
from lowbit.quantize.runtime.gguf_linear import GGUFLinear
from lowbit.app.cli import main


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def test_fallback_type_is_llama_cpps_rule():
    assert fallback_type("q4_k", 512) == "q4_k" and fallback_type("q6_k", 256) == "q6_k"
    assert fallback_type("q4_k", 544) == "q5_0" and fallback_type("q6_k", 544) == "q8_0"  # 17 blocks of 32
    assert fallback_type("q4_k", 48) is None and fallback_type("q4_0", 48) is None  # not even 32: float
    assert fallback_type("q8_0", 96) == "q8_0"
    with pytest.raises(ValueError, match="GGUF type must be one of"):
        fallback_type("q3_k", 256)


def test_float_checkpoint_exported_with_type_is_llama_cpps_rtn(tmp_path, tokenizer, capsys):
    import gguf

    model = float_tiny("llama", len(tokenizer), intermediate=544)  # down_proj rows: 544 = 17 x 32
    source = checkpoint.save(model, tokenizer, tmp_path / "float", ExportConfig(format="dense", dtype="float32"))
    out = tmp_path / "gguf"
    assert main(["export", str(source), "--format", "gguf", "--type", "q4_k", "--embedding-type", "q8_0",
                 "--output", str(out)]) == 0
    assert "wrote gguf checkpoint" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(out / "model.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == "Q5_0" and types["blk.1.attn_v.weight"] == "Q4_K"
    assert types["token_embd.weight"] == "Q8_0" and types["output.weight"] == "Q4_K"  # untied head: a linear
    assert types["blk.0.attn_norm.weight"] == "F32"
    data = {t.name: np.array(t.data) for t in reader.tensors}
    down = model.model.layers[0].mlp.down_proj.weight.detach().numpy()
    assert np.array_equal(data["blk.0.ffn_down.weight"], gguf.quants.quantize(down, gguf.GGMLQuantizationType.Q5_0))
    embed = model.model.embed_tokens.weight.detach().numpy()
    assert np.array_equal(data["token_embd.weight"], gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0))
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_S

    loaded, _ = checkpoint.load(out)
    assert isinstance(loaded.lm_head, GGUFLinear) and loaded.lm_head.scheme.type == "q4_k"
    assert loaded.model.layers[0].mlp.down_proj.scheme.type == "q5_0"
    card = json.loads((out / "config.json").read_text())["quantization_config"]
    assert card == {"quant_method": "gguf", "file": "model.gguf", "type": "q4_k", "embedding_type": "q8_0"}


def test_eval_of_a_gguf_checkpoint_counts_the_file_s_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    source = save_tiny_llama(tmp_path / "tiny")  # hidden 128: Q4_0's 32-blocks
    out, report = tmp_path / "gguf", tmp_path / "eval"
    assert main(["export", str(source), "--format", "gguf", "--type", "q4_0", "--embedding-type", "q8_0",
                 "--output", str(out)]) == 0
    assert main(["eval", str(out), "--baseline", str(source), "--output", str(report), *QUICK_EVAL]) == 0
    results = json.loads((report / "results.json").read_text())
    memory, quality = results["memory"], results["quality"]
    assert memory["weight_bytes"] == gguf_tensor_bytes(out / "model.gguf")
    # 4.5 bits per weight (Q4_0 linears) and 8.5 (Q8_0 embedding) against 16; norms stay F32
    assert memory["weight_bytes"] < 8.5 / 16 * memory["baseline_weight_bytes"]
    assert memory["fit"] and quality["perplexity"] > 1 and quality["kl"]["kl_mean"] > 0


def test_a_failed_write_names_model_gguf_and_leaves_no_checkpoint(tmp_path, tokenizer):
    """A real write failure: the file outgrows this process's file-size limit (EFBIG)."""
    model = gguf_tiny("llama")
    with file_size_limit(1 << 20), pytest.raises(OutOfSpaceError) as failure:
        checkpoint.save(model, tokenizer, tmp_path / "ckpt", ExportConfig(format="gguf"))
    assert failure.value.errno == errno.EFBIG
    assert str(failure.value).endswith("/model.gguf: the file-size limit (ulimit -f) was hit (File too large)")
    assert list(tmp_path.iterdir()) == []  # neither the target nor a staging folder remains


def test_grids_gguf_cannot_hold_are_refused_naming_the_layer(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.self_attn\.q_proj is a QuantLinear, which "
                                         r"GGUF cannot hold\. .*gguf recipe"):
        checkpoint.save(quantized_tiny(), tokenizer, tmp_path / "a", ExportConfig(format="gguf"))
    with pytest.raises(ValueError, match=r"supports the architectures \['deepseek_v3', 'glm4_moe', 'gpt_oss', 'llama', "
                                         r"'llama4_text', 'mixtral', 'olmoe', 'qwen2', 'qwen2_moe', 'qwen3_moe'\]; "
                                         r"this model is 'opt'"):
        checkpoint.save(make_tiny_model("opt"), tokenizer, tmp_path / "b", ExportConfig(format="gguf"))
    with pytest.raises(ValueError, match="carries its tokenizer; none was given"):
        checkpoint.save(gguf_tiny("llama"), None, tmp_path / "c", ExportConfig(format="gguf"))
    with_cache = gguf_tiny("llama")
    attach(with_cache, KVCacheConfig(format="int8", strategy="token"))  # a dynamic quantized KV cache
    with pytest.raises(ValueError, match="cannot hold lowbit's quantized KV cache .*--cache-type-k"):
        checkpoint.save(with_cache, tokenizer, tmp_path / "d", ExportConfig(format="gguf"))
    assert not any(tmp_path.iterdir())


def test_a_tokenizer_gguf_cannot_describe_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, "[UNK]")))
    with pytest.raises(ValueError, match="writes byte-level BPE tokenizers .*this one is 'WordLevel'"):
        checkpoint.save(gguf_tiny("llama", vocab_size=512), words, tmp_path / "w", ExportConfig(format="gguf"))


def test_bad_export_options_are_refused():
    with pytest.raises(ValueError, match="export.type 'q3_k' is not a GGUF type; valid: q8_0, q4_0"):
        ExportConfig(format="gguf", type="q3_k")
    with pytest.raises(ValueError, match="export.embedding_type applies to format gguf only"):
        ExportConfig(format="dense", embedding_type="q8_0")


def test_a_truncated_gguf_file_is_reported(tmp_path, tokenizer):
    out = checkpoint.save(gguf_tiny("llama"), tokenizer, tmp_path / "ckpt", ExportConfig(format="gguf"))
    data = (out / "model.gguf").read_bytes()
    (out / "model.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.gguf: unreadable or truncated GGUF file"):
        checkpoint.load(out)
    (out / "model.gguf").unlink()
    with pytest.raises(FileNotFoundError, match="model.gguf: GGUF file missing"):
        checkpoint.load(out)
