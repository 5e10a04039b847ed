"""The distill step: it lowers the quantized model's KL to the float model on its calibration tokens
and on tokens it never saw, changing scales and norms and never a code; linears it cannot train keep
their scales and are named; a run with it exports, passes its audit and loads in plain transformers;
recipes and models it cannot serve are refused with the key that says why; a run killed inside it
resumes to the bytes of one that was not. Two ranks: in test_distributed.py."""
from __future__ import annotations

import copy
import json
import re
import signal

import pytest
import torch
import torch.nn.functional as F

from export_helpers import token_ids
from test_export_dense import assert_plain_transformers_agrees
from faults import start_run_stopping_in
from tiny_models import SMALL_RUN, make_tiny_model, run_on_tiny_llama, save_tiny_llama
from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.final_hidden import post_processed_logits
from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf
from lowbit.quantize.grids.gguf_plan import GGUFTypes
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.grids.formats import LinearFormats
from lowbit.quantize.runtime.fp8_linear import FP8Linear
from lowbit.quantize.runtime.gguf_linear import GGUFLinear
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps import distill, rtn
from lowbit.quantize.steps.context import StepContext
from lowbit.recipes.schema import RecipeError, parse_recipe


def kl(reference, model, ids) -> float:
    """Mean KL(reference || model) of next-token distributions over every position."""
    with torch.no_grad():
        want, got = (F.log_softmax(m(ids).logits.float(), dim=-1) for m in (reference, model))
    return float(F.kl_div(got, want, log_target=True, reduction="none").sum(-1).mean())


def rounded_tiny(scheme=IntScheme(3, True, "group", 32)):
    """(float tiny llama, its copy rounded to nearest on `scheme`, a context that learns against the float one)."""
    reference = make_tiny_model("llama")
    model = copy.deepcopy(reference)
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: token_ids(batch=8, length=48),
                      reference=lambda: copy.deepcopy(reference))
    rtn.apply(ctx, rtn.RTNConfig(scheme=scheme))
    return reference, model, ctx


def held(model, kind) -> dict:
    return {name: (m.weight_codes.clone(), m.weight_scale.clone()) for name, m in model.named_modules()
            if isinstance(m, kind)}


def test_distill_lowers_the_kl_on_seen_and_unseen_tokens_changing_scales_and_norms_never_codes():
    reference, model, ctx = rounded_tiny()
    seen, unseen = token_ids(batch=8, length=48), token_ids(batch=8, length=48, seed=5)
    before = {"seen": kl(reference, model, seen), "unseen": kl(reference, model, unseen)}
    rounded = held(model, QuantLinear)
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    record = distill.apply(ctx, distill.DistillConfig(epochs=6, batch=2, learning_rate=0.02, norm_learning_rate=0.01,
                                                      forward_dtype="float32"))
    after = {"seen": kl(reference, model, seen), "unseen": kl(reference, model, unseen)}
    assert after["seen"] < 0.8 * before["seen"] and after["unseen"] < before["unseen"], (before, after)
    assert record["scales"] == 14 and record["fixed"] == [] and record["norms"] == 5 and record["steps"] == 24
    assert record["kl_last_epoch"] < record["kl_first_epoch"]
    learned = held(model, QuantLinear)
    assert all(torch.equal(learned[n][0], codes) for n, (codes, _) in rounded.items())
    assert all(not torch.equal(learned[n][1], scale) and learned[n][1].dtype == torch.float32
               and bool((learned[n][1] > 0).all()) for n, (_, scale) in rounded.items())
    assert all(not torch.equal(p, norms[n]) for n, p in model.named_parameters() if "norm" in n)
    trained = [m.weight_scale for m in model.modules() if isinstance(m, QuantLinear)]
    trained += [p for n, p in model.named_parameters() if "norm" in n]
    assert all(torch.equal(t, t.bfloat16().float()) for t in trained)  # what the bf16 checkpoint holds, exactly
    assert not any(p.requires_grad is False for p in model.parameters())  # the model's own flags are restored
    assert all("forward" not in vars(m) for m in model.modules())  # every linear computes as its class does again


def test_linears_on_other_grids_keep_their_scales_and_are_named():
    _, model, ctx = rounded_tiny(LinearFormats({"down_proj": "fp8_e4m3"}, "int4_g32"))
    fp8 = {n: m.weight_scale.clone() for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    record = distill.apply(ctx, distill.DistillConfig(batch=4, forward_dtype="float32"))
    assert sorted(record["fixed"]) == sorted(fp8) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert record["scales"] == 12
    assert all(torch.equal(model.get_submodule(n).weight_scale, s) for n, s in fp8.items())


def gguf_fields(model) -> dict:
    return {name: m.gguf_weight() for name, m in model.named_modules() if isinstance(m, GGUFLinear)}


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "iq4_nl"])
def test_on_ggml_blocks_distill_learns_the_float16_block_scales_and_keeps_every_level(kind):
    reference, model, ctx = rounded_tiny(GGUFTypes(kind, pure=True))
    seen = token_ids(batch=8, length=48)  # the context's calibration samples
    before, rounded = kl(reference, model, seen), gguf_fields(model)
    record = distill.apply(ctx, distill.DistillConfig(epochs=4, batch=2, learning_rate=0.005, norm_learning_rate=0.002,
                                                      forward_dtype="float32"))
    assert record["scales"] == 14 and record["fixed"] == []
    assert kl(reference, model, seen) < 0.9 * before
    for name, gw in gguf_fields(model).items():
        was = rounded[name]
        assert torch.equal(gw.levels, was.levels), name
        assert not torch.equal(gw.d, was.d) and gw.d.dtype == torch.float16, name
        assert torch.equal(gw.d.sign(), was.d.sign()), name  # a block's scale keeps its sign
        assert (gw.dmin is None) == (was.dmin is None) and (gw.dmin is None or not torch.equal(gw.dmin, was.dmin))
        module = model.get_submodule(name)
        assert torch.equal(module(torch.eye(module.in_features)).T, gw.dequantize())  # decoded from the new bytes


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "iq4_xs", "q8_0"])
def test_the_learned_view_of_every_block_type_starts_at_its_bytes_and_stores_what_it_learned(kind):
    """At t = 0 the view computes the linear's own weight; after a step what it stores is what it
    computed, and only d (and dmin) moved: levels and 6-bit sub-block scales stay."""
    from lowbit.quantize.steps.distill_params import BlockScales

    module = GGUFLinear.from_weight(quantize_gguf(torch.randn(8, 512), GGUFScheme(kind)), None)
    view = BlockScales(module)
    assert torch.equal(view.weight(), module.dequantized_weight())
    with torch.no_grad():
        for t in view.factors:
            t.uniform_(-0.05, 0.05)
    computed, was = view.weight().detach(), module.gguf_weight()
    view.keep(view.learned())
    now = module.gguf_weight()
    assert torch.equal(module.dequantized_weight(), computed)
    assert torch.equal(now.levels, was.levels) and not torch.equal(now.d, was.d)
    assert all(torch.equal(getattr(now, f), getattr(was, f)) for f in ("sub_scale", "sub_min")
               if getattr(was, f) is not None)


def test_distill_with_nothing_quantized_says_what_it_needs():
    model = make_tiny_model("llama")
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: token_ids(batch=2, length=16),
                      reference=lambda: make_tiny_model("llama"))
    with pytest.raises(ValueError, match="distill: no linear holds weight-only scales to learn"):
        distill.apply(ctx, distill.DistillConfig())


def test_a_recipe_that_distills_before_any_weight_step_is_refused_naming_the_step():
    with pytest.raises(RecipeError, match=r"mine.yaml: steps\[0\].distill: must come after a weight step"):
        parse_recipe({"steps": [{"distill": {}}, {"rtn": {}}]}, "mine.yaml")


@pytest.mark.parametrize("key", ["final_logit_softcapping", "logit_scale"])
def test_a_model_whose_logits_are_post_processed_is_refused_naming_the_key(key):
    from transformers import LlamaConfig

    config = LlamaConfig(**{key: 30.0})
    with pytest.raises(ValueError, match=f"distill: the model's config sets {key}=30.0"):
        post_processed_logits(config, "distill")


def test_a_run_that_distills_exports_passes_its_audit_and_loads_in_plain_transformers(tmp_path):
    recipe = {"scheme": {"bits": 4, "strategy": "group", "group_size": 32},
              "steps": [{"rtn": {}}, {"distill": {"batch": 1}}], "export": {"format": "dense"}}
    code, out = run_on_tiny_llama(tmp_path, recipe)
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    # a float export: its audit checked the 14 quantized linears in memory, and reports them as the file holds them
    assert results["audit"]["passed"] is True and results["audit"]["checked"] == 0
    assert sum("written dequantized" in why for why in results["audit"]["ignored"].values()) == 14
    assert [s["name"] for s in results["steps"]] == ["rtn", "distill"] and results["steps"][1]["steps"] == 2
    assert_plain_transformers_agrees(out, tmp_path)


def test_a_streamed_run_refuses_distill_naming_the_step():
    from lowbit.app.streamed import streaming_folder

    recipe = parse_recipe({"model": "smollm2-135m", "calibration": {"streaming": True},
                           "scheme": {"bits": 4, "strategy": "group", "group_size": 32},
                           "steps": [{"rtn": {}}, {"distill": {}}]}, "mine.yaml")
    with pytest.raises(ValueError, match=r"steps\[1\].distill cannot run streamed: distill trains the whole model"):
        streaming_folder(recipe)


def test_a_run_killed_in_distill_resumes_to_the_bytes_of_one_that_was_not(tmp_path):
    """SIGKILL once distill has begun (rtn's layers done): --resume learns again from them and writes
    what an uninterrupted run writes, and nothing was published meanwhile."""
    from lowbit.app.cli import main

    recipe = tmp_path / "distill.yaml"
    recipe.write_text(json.dumps({"scheme": {"bits": 4, "strategy": "group", "group_size": 32},
                                  "steps": [{"rtn": {}}, {"distill": {"batch": 1, "epochs": 2}}]}))
    args = ["run", str(recipe), "--model", str(save_tiny_llama(tmp_path / "tiny")), *[f"--set={s}" for s in SMALL_RUN]]
    assert main([*args, "--output", str(tmp_path / "whole")]) == 0
    killed = tmp_path / "killed"
    run = start_run_stopping_in("lowbit.quantize.steps.distill.descend", [*args, "--output", str(killed)], tmp_path)
    run.send_signal(signal.SIGKILL)
    assert run.wait(timeout=60) == -signal.SIGKILL and not killed.exists()
    assert main([*args, "--output", str(killed), "--resume"]) == 0
    assert (killed / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_each_epoch_draws_every_sample_once_in_a_fresh_order():
    order = [picked.tolist() for picked in distill.sample_order(8, 2, 12, seed=0)]  # 3 epochs of 4 steps
    epochs = [sum(order[i * 4:(i + 1) * 4], []) for i in range(3)]
    assert [sorted(e) for e in epochs] == [list(range(8))] * 3 and epochs[0] != epochs[1]


def test_distill_on_some_of_the_samples_learns_on_those_and_runs_the_float_model_on_those_only():
    reference = make_tiny_model("llama")
    model = copy.deepcopy(reference)
    seen_rows = []

    def counted_reference():
        teacher = copy.deepcopy(reference)
        teacher.model.embed_tokens.register_forward_hook(lambda m, args, out: seen_rows.append(args[0].clone()))
        return teacher

    samples = token_ids(batch=8, length=16)
    ctx = StepContext(model, arch_for(model), ("lm_head",), lambda: samples, reference=counted_reference)
    rtn.apply(ctx, rtn.RTNConfig(scheme=IntScheme(4, True, "group", 32)))
    record = distill.apply(ctx, distill.DistillConfig(samples=3, batch=2, epochs=2, forward_dtype="float32"))
    assert record["steps"] == 4  # 2 epochs of ceil(3 / 2)
    taught = torch.cat(seen_rows)
    assert len(taught) == 3 and torch.equal(distill.drawn(samples, 3, seed=0), taught)  # by the seed, in order
    assert not torch.equal(taught, samples[:3])  # drawn at random, not the first ones
    assert torch.equal(distill.drawn(samples, 0, seed=0), samples) and torch.equal(distill.drawn(samples, 9, 0), samples)


def test_a_negative_sample_count_is_refused_naming_the_key():
    says = "mine.yaml: steps[1].distill: distill: samples must be 0 (all) or a positive count, got -1"
    with pytest.raises(RecipeError, match=re.escape(says)):
        parse_recipe({"steps": [{"rtn": {}}, {"distill": {"samples": -1}}]}, "mine.yaml")
