"""MXFP4 in a .gguf file: the `{mx: fp4}` grid repacked as GGML's MXFP4 blocks, losslessly: the
`gguf` package's dequantizer (llama.cpp's) reads the values lowbit's grid holds, and lowbit reads
the same codes and exponents back. A GGUF plan gives chosen linears MXFP4 (`types: {...: mxfp4}`),
as gpt-oss's released experts are."""
import json

import gguf
import numpy as np
import pytest
import torch

from tiny_models import run_on_tiny_llama
from lowbit.export.formats.gguf.modules import module_from_ggml, mx_weight, mxfp4_blocks
from lowbit.quantize.grids.gguf_plan import GGUFTypes
from lowbit.quantize.grids.mxfp4 import MXScheme
from lowbit.quantize.runtime.mxfp4_linear import MXFP4Linear


def test_ggml_mxfp4_blocks_hold_the_grids_values_bit_for_bit():
    w = torch.randn(24, 128) * torch.logspace(-3, 2, 128)  # scales over a wide range, subnormal E8M0 too
    w[3, :32] = 0.0  # an all-zero block: exponent 0
    mw = MXScheme().round(w)
    blocks = mxfp4_blocks(mw)
    assert blocks.shape == (24, 128 // 32 * 17) and blocks.dtype == torch.uint8
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(theirs.astype(np.float32), mw.dequantize().numpy())
    back = mx_weight(blocks, 128)
    assert torch.equal(back.codes, mw.codes) and torch.equal(back.exponents, mw.exponents)


def test_a_module_read_from_mxfp4_bytes_is_the_one_written():
    module = MXFP4Linear.from_weight(MXScheme().round(torch.randn(8, 64)), torch.randn(8))
    read = module_from_ggml(int(gguf.GGMLQuantizationType.MXFP4), mxfp4_blocks(module.mx_weight()), 64, 8, True)
    assert isinstance(read, MXFP4Linear)
    assert torch.equal(read.weight_packed, module.weight_packed) and torch.equal(read.weight_scale, module.weight_scale)
    with pytest.raises(ValueError, match=r"holds \(8, 17\) bytes of MXFP4; the model in config.json needs \(8, 34\)"):
        mx_weight(mxfp4_blocks(module.mx_weight())[:, :17], 64)


def test_a_gguf_plan_gives_mxfp4_where_its_types_say_and_keeps_rows_32_does_not_divide_16_bit():
    from lowbit.quantize.grids.plan import Slot

    plan = GGUFTypes("q8_0", types={"down_proj": "mxfp4"})
    grids, kept = plan.assign([Slot("model.layers.0.mlp.down_proj", 128, 0, 2),
                               Slot("model.layers.1.mlp.down_proj", 100, 1, 2),
                               Slot("model.layers.0.mlp.up_proj", 64, 0, 2)])
    assert grids["model.layers.0.mlp.down_proj"] == MXScheme()
    assert grids["model.layers.0.mlp.up_proj"].type == "q8_0"
    assert "not a multiple of 32" in kept["model.layers.1.mlp.down_proj"]
    assert plan.record(grids)["types"]["model.layers.0.mlp.down_proj"] == "mxfp4"
    with pytest.raises(ValueError, match="mxfp4, f16"):
        GGUFTypes("q8_0", types={"down_proj": "mxfp8"})


def test_a_gguf_run_with_mxfp4_linears_writes_mxfp4_tensors_and_reads_them_back(tmp_path, capsys):
    recipe = {"scheme": {"gguf": "q8_0", "types": {"down_proj": "mxfp4"}}, "steps": ["rtn"],
              "export": {"format": "gguf"}}
    code, out = run_on_tiny_llama(tmp_path, recipe)
    assert code == 0, capsys.readouterr().err
    tensors = {t.name: t for t in gguf.GGUFReader(str(out / "model.gguf")).tensors}
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "MXFP4"
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == "Q8_0"
    results = json.loads((out / "results.json").read_text())
    assert results["audit"]["passed"] and results["audit"]["schemes"]["mxfp4 (e2m1, e8m0 scale per 32)"] == 2

    from lowbit.export.reader import load
    model, _ = load(out)
    assert isinstance(model.get_submodule("model.layers.1.mlp.down_proj"), MXFP4Linear)
