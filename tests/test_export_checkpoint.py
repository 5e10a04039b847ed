import errno
import json

import pytest
import torch

from faults import file_size_limit
from tiny_models import make_tiny_model
from lowbit.calibrate.arch import arch_for
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.export.files import OutOfSpaceError
from lowbit.quantize.steps import rtn
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps.context import StepContext


def quantized_tiny(model_type="llama", scheme=IntScheme(bits=4, strategy="group", group_size=32)):
    model = make_tiny_model(model_type)
    rtn.apply(StepContext(model, arch_for(model), ("lm_head",), lambda: None), rtn.RTNConfig(scheme))
    return model


@pytest.mark.parametrize("scheme", [IntScheme(bits=4, strategy="group", group_size=32),
                                    IntScheme(bits=4, symmetric=False, strategy="group", group_size=64),
                                    IntScheme(bits=8, strategy="channel")], ids=str)
def test_round_trip_restores_the_quantized_model(tmp_path, scheme):
    model = quantized_tiny(scheme=scheme)
    out = checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig(dtype="float32"))
    loaded, _ = _load_no_tokenizer(out)
    ids = torch.randint(3, 500, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-5)
    names = [n for n, m in loaded.named_modules() if isinstance(m, QuantLinear)]
    assert len(names) == 14
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    weights = next(iter(qc["config_groups"].values()))["weights"]
    assert weights["num_bits"] == scheme.bits and weights["symmetric"] == scheme.symmetric


def _load_no_tokenizer(folder):
    from unittest import mock

    with mock.patch("transformers.AutoTokenizer.from_pretrained", return_value=None):
        return checkpoint.load(folder)


def test_write_failure_names_the_file_and_leaves_no_checkpoint(tmp_path):
    """A real write failure: the weights outgrow this process's file-size limit (EFBIG), which
    safetensors reports as a SafetensorError; save() turns it into an OSError naming the file."""
    model = quantized_tiny()
    with file_size_limit(64 << 10), pytest.raises(OutOfSpaceError) as failure:
        checkpoint.save(model, None, tmp_path / "ckpt", ExportConfig())
    assert failure.value.errno == errno.EFBIG
    assert str(failure.value).startswith(f"cannot write {tmp_path}/.ckpt.partial-")
    assert str(failure.value).endswith("/model.safetensors: the file-size limit (ulimit -f) was hit (File too large)")
    assert list(tmp_path.iterdir()) == []  # neither the target nor a staging folder remains


def test_non_empty_output_is_refused_and_overwrite_never_replaces_a_users_folder(tmp_path):
    model = quantized_tiny()
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty.*--overwrite"):
        checkpoint.save(model, None, target, ExportConfig())
    assert (target / "precious.txt").read_text() == "keep me"
    with pytest.raises(FileExistsError, match="is not a lowbit output.*delete it yourself"):
        checkpoint.save(model, None, target, ExportConfig(), overwrite=True)  # not lowbit's: never replaced
    assert [p.name for p in target.iterdir()] == ["precious.txt"] and (target / "precious.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_bfloat16_export_halves_float_tensors(tmp_path):
    from lowbit.evaluate.memory import checkpoint_weight_bytes

    model = quantized_tiny()
    small = checkpoint.save(model, None, tmp_path / "bf16", ExportConfig(dtype="bfloat16"))
    big = checkpoint.save(model, None, tmp_path / "fp32", ExportConfig(dtype="float32"))
    assert checkpoint_weight_bytes(small) < checkpoint_weight_bytes(big)


def test_truncated_weights_file_is_reported(tmp_path):
    out = checkpoint.save(quantized_tiny(), None, tmp_path / "ckpt", ExportConfig())
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: unreadable or truncated"):
        _load_no_tokenizer(out)
