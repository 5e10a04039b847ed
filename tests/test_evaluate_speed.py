"""Speed measurement plumbing on a tiny model (behaviour, not timings)."""
import torch

from lowbit.evaluate.config import SpeedConfig
from lowbit.evaluate.memory import ModelShape, kv_cache_bytes, resident_tensor_bytes
from lowbit.evaluate.speed import compare_speed, decode_step_bytes, timed_generation


def test_timed_generation_times_every_step(tiny_llama):
    run = timed_generation(tiny_llama, torch.randint(3, 500, (2, 9)), new_tokens=5)
    assert run["prefill_s"] > 0 and len(run["step_s"]) == 4


def test_decode_step_bytes_counts_weights_and_kv(tiny_llama):
    shape = ModelShape.from_config(tiny_llama.config)
    emb = tiny_llama.get_input_embeddings().weight
    expected = resident_tensor_bytes(tiny_llama) - emb.numel() * 4 + kv_cache_bytes(shape, 40, 2, 4)
    assert decode_step_bytes(tiny_llama, batch=2, context=40) == expected


def test_compare_speed_reports_each_model_and_batch(tiny_llama):
    cfg = SpeedConfig(enabled=True, prompt_len=8, new_tokens=3, batch_sizes=(1, 2), warmup=0, repeats=1)
    out = compare_speed({"model": tiny_llama, "baseline": tiny_llama}, cfg)
    assert out["bandwidth_gbs"] > 0
    for name in ("model", "baseline"):
        assert set(out[name]) == {"1", "2"}
        row = out[name]["2"]
        assert row["decode_tok_s"] == 2 / row["tpot_s"]
        assert abs(row["roofline_decode_tok_s"] * row["roofline_tpot_s"] - 2) < 1e-9


def test_speed_times_quantized_linears_with_the_backend_kernels(tiny_llama):
    from lowbit.calibrate.hardware import cpu_info
    from lowbit.quantize.runtime import cpu_kernels
    from lowbit.quantize.runtime.qlinear import QuantLinear
    from lowbit.quantize.grids.integer import IntScheme
    from lowbit.quantize.steps.rtn import RTNConfig, apply as rtn_apply
    from lowbit.quantize.steps.context import StepContext
    from lowbit.calibrate.arch import arch_for

    rtn_apply(StepContext(tiny_llama, arch_for(tiny_llama), ("lm_head",), lambda: None),
              RTNConfig(scheme=IntScheme(4, True, "group", 32)))
    cfg = SpeedConfig(enabled=True, prompt_len=8, new_tokens=3, batch_sizes=(1,), repeats=1, warmup=0)
    out = compare_speed({"model": tiny_llama}, cfg)
    used = out["backends"]["model"]
    assert sum(used.values()) == sum(isinstance(m, QuantLinear) for m in tiny_llama.modules())
    assert out["cpu"] == cpu_info().describe()  # the variant the run was timed with, and if forced
    isa = cpu_info().isa  # the variant auto picks; none (ARM, forced): the reference, saying why
    if isa == "none":
        assert all(k.startswith("reference (no CPU kernel variant") for k in used)
    elif cpu_kernels.load(isa) is not None:
        assert set(used) == {f"cpu_{isa}"}
    assert all(m.kernel is None for m in tiny_llama.modules() if isinstance(m, QuantLinear))  # reference after
    reference = compare_speed({"model": tiny_llama}, SpeedConfig(**{**cfg.__dict__, "backend": "reference"}))
    assert reference["backends"]["model"] == {"reference": sum(used.values())}
