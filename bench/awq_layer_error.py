"""Per-layer output error of RTN vs AWQ (scale only / scale + clip) then RTN, on smollm2-135m.

Diagnostic for the AWQ search: prints the decoder-layer output MSE for layers 0, 5, 15 on 8
calibration samples, with each layer quantized alone on float inputs. Run from the repository
with `python bench/awq_layer_error.py` (lowbit installed)
"""
import copy

import torch
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.calibrate.models import load_model
from lowbit.calibrate.arch import arch_for, decoder_layers, linear_weight
from lowbit.calibrate.data import calibration_batches, CalibrationConfig
from lowbit.calibrate.walker import capture_first_layer_inputs, layer_forward
from lowbit.quantize.steps import awq

torch.manual_seed(0)
model, tok, _ = load_model("smollm2-135m")
arch = arch_for(model)
ids = calibration_batches(CalibrationConfig(samples=8, seq_len=512), tok)
inputs = capture_first_layer_inputs(model, arch, ids)
cfgs = {"scale+clip": awq.AWQConfig(scheme=IntScheme(4, True, "group", 64), grid=10, clip_grid=10, max_tokens=1024),
        "scale only": awq.AWQConfig(scheme=IntScheme(4, True, "group", 64), grid=10, clip=False, max_tokens=1024)}
def rtn_layer(layer):
    for n in arch.linears:
        w = linear_weight(layer.get_submodule(n)); w.copy_(quantize_rtn(w, cfgs["scale only"].scheme).dequantize())
for i in [0, 5, 15]:
    layer = decoder_layers(model, arch)[i]; inputs.use_layer(i)
    ref = layer_forward(layer, inputs)
    def err(l): return sum((a-b).pow(2).mean().item() for a,b in zip(layer_forward(l, inputs), ref))
    l = copy.deepcopy(layer); rtn_layer(l); e_rtn = err(l)
    out = {}
    for name, cfg in cfgs.items():
        l = copy.deepcopy(layer)
        sample = awq.leading_sequences(inputs, cfg.max_tokens)
        r = awq.scale_layer(l, arch, f"x.{i}", sample, None, cfg, ())
        if cfg.clip: awq.clip_layer(l, arch, f"x.{i}", sample, None, cfg, ())
        rtn_layer(l); out[name] = err(l)
    print(i, "rtn", e_rtn, out, r, flush=True)
