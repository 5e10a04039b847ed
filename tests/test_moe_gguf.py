"""GGUF files of mixtures of experts (#32): each layer's routed experts are llama.cpp's stacked
`blk.N.ffn_{gate,up,down}_exps` tensors, routers stay F32, and both lowbit's reader and plain
transformers (`gguf_file=`, in a fresh process) load the file back to the same logits."""
import json
import subprocess
import sys
import textwrap

import gguf
import pytest
import torch

from test_moe import expected_linears, lowbit_logits
from tiny_models import SMALL_RUN
from tiny_moe import EXPERTS, LLAMA3_ROPE, expert_layers, experts_at, save_tiny_moe
from lowbit.quantize.runtime.gguf_linear import GGUFLinear
from lowbit.app.cli import main

RUN_SETS = [f"--set={s}" for s in SMALL_RUN]
# transformers' GGUF reader takes no expert widths from the file (its key table has none), so the tiny
# models use its config defaults there: Qwen3-MoE 768, Qwen2-MoE 1408 (shared expert 5632). Qwen3-MoE
# at hidden 256 so that Q4_K's 256-weight super-blocks fit the gate/up rows; llama.cpp's qwen3moe graph
# always renormalizes the top-k weights (norm_topk_prob true, as the released models have it)
CASES = {
    "qwen3_moe": ("gguf-q4_k-gptq", dict(hidden_size=256, head_dim=64, moe_intermediate_size=768,
                                         norm_topk_prob=True)),
    "qwen2_moe": ("gguf-q4_0", dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632)),
    # experts as wide as intermediate_size; llama.cpp's olmoe graph wants as many k/v heads as q heads.
    # transformers reads no OLMoE GGUF file: llama.cpp itself checks it (test_moe_llama_cpp.py)
    "olmoe": ("gguf-q4_0", dict(num_key_value_heads=4)),
    # a dense first layer, sigmoid routing with a selection bias and a shared expert; llama.cpp picks
    # from all experts at once (one group); attention with biases and q/k norms, half of each head rotated
    "glm4_moe": ("gguf-q4_0", dict(moe_intermediate_size=64, n_group=1, topk_group=1, attention_bias=True)),
    # experts as wide as intermediate_size, with biases (stacked as the weights are), attention sinks,
    # YaRN rope; transformers reads no gpt-oss GGUF file: llama.cpp itself checks it (test_moe_llama_cpp.py)
    "gpt_oss": ("gguf-q4_0", dict(intermediate_size=128)),
    # a dense first layer, then routed experts under feed_forward scored on their input and a shared
    # expert; Llama 3's RoPE scaling as llama.cpp's rope_freqs tensor. transformers reads no Llama 4 GGUF
    "llama4_text": ("gguf-q4_0", dict(intermediate_size=128, rope_parameters=LLAMA3_ROPE)),
    # latent attention with kv_b_proj whole (llama.cpp's MHA path), sigmoid routing over 2 expert groups
    # of which the router keeps 1, a shared expert, a dense first layer
    "deepseek_v3": ("gguf-q4_0", dict(moe_intermediate_size=128, n_group=2, topk_group=1)),
}
TRANSFORMERS_READS = ("qwen3_moe", "qwen2_moe")
RELOAD = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], gguf_file="model.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        print(json.dumps(model(torch.tensor(json.loads(sys.argv[2]))).logits.tolist()))
""")


def transformers_gguf_logits(folder, ids) -> torch.Tensor:
    done = subprocess.run([sys.executable, "-c", RELOAD, str(folder), json.dumps(ids.tolist())],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.tensor(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("model_type", list(CASES))
def test_experts_are_stacked_as_llama_cpp_reads_them_and_reload_everywhere(model_type, tmp_path, capsys):
    recipe, overrides = CASES[model_type]
    source = save_tiny_moe(tmp_path / "source", model_type, **overrides)
    out = tmp_path / "run"
    assert main(["run", recipe, "--model", str(source), "--output", str(out), *RUN_SETS]) == 0
    assert "audit       passed" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["audit"]["checked"] == expected_linears(model_type)

    hidden, inner = overrides.get("hidden_size", 64), overrides.get("moe_intermediate_size", 128)
    tensors = {t.name: t for t in gguf.GGUFReader(str(out / "model.gguf")).tensors}
    sparse = expert_layers(model_type)
    assert not any(".experts." in n for n in tensors)  # no per-expert tensor left
    assert not any(f"blk.{layer}.ffn_gate." in n for n in tensors for layer in sparse)
    for layer in sparse:
        for proj, shape in (("gate", [hidden, inner, EXPERTS]), ("up", [hidden, inner, EXPERTS]),
                            ("down", [inner, hidden, EXPERTS])):  # GGML order: row length first
            t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert t.shape.tolist() == shape
            assert t.tensor_type.name in ("Q4_K", "Q6_K", "Q4_0")
        assert tensors[f"blk.{layer}.ffn_gate_inp.weight"].tensor_type.name == "F32"
        if model_type == "deepseek_v3":  # whole, as lowbit quantized its rows: no k_b/v_b cut
            assert f"blk.{layer}.attn_kv_b.weight" in tensors and f"blk.{layer}.attn_k_b.weight" not in tensors
        if model_type == "gpt_oss":
            for proj, rows in (("gate", inner), ("up", inner), ("down", hidden)):
                bias = tensors[f"blk.{layer}.ffn_{proj}_exps.bias"]
                assert bias.shape.tolist() == [rows, EXPERTS] and bias.tensor_type.name == "F32"
            assert tensors[f"blk.{layer}.attn_sinks.weight"].shape.tolist() == [4]  # one per query head

    assert ("rope_freqs.weight" in tensors) == (model_type == "llama4_text")  # Llama 3's RoPE divisors

    from lowbit.export.reader import load
    model, _ = load(out)
    assert isinstance(model.get_submodule(f"model.layers.1.{experts_at(model_type)}.{EXPERTS - 1}.down_proj"),
                      GGUFLinear)
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(2))
    if model_type not in TRANSFORMERS_READS:
        return
    ours, theirs = lowbit_logits(out, ids), transformers_gguf_logits(out, ids)
    # both dequantize the same blocks: float rounding apart (measured 3e-7 of the logit scale)
    assert float((ours - theirs).abs().max()) <= 1e-4 * float(ours.abs().max())


def test_a_layer_whose_experts_have_different_types_is_refused_naming_them(tmp_path, capsys):
    source = save_tiny_moe(tmp_path / "source", "qwen3_moe", norm_topk_prob=True)
    plan = "scheme={gguf: q4_0, types: {model.layers.1.mlp.experts.2.down_proj: q8_0}}"
    code = main(["run", "gguf-q4_0", "--model", str(source), "--output", str(tmp_path / "run"), *RUN_SETS,
                 f"--set={plan}"])
    printed = capsys.readouterr()
    assert code == 2
    assert ("llama.cpp stores the experts of model.layers.1.mlp.experts.down_proj as one tensor of one type; "
            "these differ from the others' gguf q4_0: model.layers.1.mlp.experts.2.down_proj: gguf q8_0") in printed.err
    assert "[rtn]" not in printed.out + printed.err and not (tmp_path / "run").exists()  # before any work


def test_experts_of_one_layer_stacked_with_two_types_are_refused_on_write(tmp_path):
    """The writer's own check, for a model quantized outside a recipe run."""
    from lowbit.calibrate.models import load_model
    from lowbit.export import checkpoint
    from lowbit.export.config import ExportConfig
    from lowbit.quantize.grids.gguf import GGUFScheme, quantize_gguf
    from lowbit.quantize.grids.gguf_packing import pack

    model, tokenizer, _ = load_model(str(save_tiny_moe(tmp_path / "source", "qwen3_moe", norm_topk_prob=True)))
    for e, kind in enumerate(["q4_0", "q4_0", "q8_0", "q4_0"]):
        name = f"model.layers.1.mlp.experts.{e}.down_proj"
        linear = model.get_submodule(name)
        module = GGUFLinear(linear.in_features, linear.out_features, GGUFScheme(kind), False)
        module.weight.copy_(pack(quantize_gguf(linear.weight.data, GGUFScheme(kind), name)))
        model.set_submodule(name, module)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj\.weight: llama\.cpp stores a "
                                         r"layer's experts as one tensor of one type.*expert 2: Q8_0"):
        checkpoint.save(model, tokenizer, tmp_path / "out", ExportConfig(format="gguf", dtype="float32"))


@pytest.mark.parametrize("model_type,overrides,said", [
    ("qwen3_moe", dict(norm_topk_prob=False), ("norm_topk_prob: false", "qwen3moe")),
    ("olmoe", dict(num_key_value_heads=2), ("num_key_value_heads equal to num_attention_heads", "has 2")),
    ("gpt_oss", dict(layer_types=["full_attention", "sliding_attention"]), ("every other layer from the first",
                                                                         "layer_types")),
    ("gpt_oss", dict(swiglu_limit=5.0), ("clamps the SwiGLU at 7.0", "swiglu_limit 5.0")),
])
def test_a_model_llama_cpp_would_compute_differently_stops_before_any_work(model_type, overrides, said, tmp_path,
                                                                          capsys):
    source = save_tiny_moe(tmp_path / "source", model_type, **overrides)
    code = main(["run", "gguf-q4_0", "--model", str(source), "--output", str(tmp_path / "run"), *RUN_SETS])
    printed = capsys.readouterr()
    assert code == 2
    assert all(part in printed.err for part in said)
    assert "[rtn]" not in printed.out + printed.err and not (tmp_path / "run").exists()


# widths at which every expert row takes Q4_K's 256-weight super-blocks (hidden and expert width 256)
Q4_K_WIDTHS = {
    "qwen3_moe": dict(hidden_size=256, head_dim=64, moe_intermediate_size=256, norm_topk_prob=True),
    "mixtral": dict(hidden_size=256, intermediate_size=256),
    "olmoe": dict(hidden_size=256, intermediate_size=256, num_key_value_heads=4),
    "qwen2_moe": dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256),
    "deepseek_v3": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, n_group=2, topk_group=1),
    "glm4_moe": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64),
    "gpt_oss": dict(hidden_size=256, intermediate_size=256, head_dim=64),
    "llama4_text": dict(hidden_size=256, intermediate_size=256, intermediate_size_mlp=256, head_dim=64),
}


@pytest.mark.parametrize("model_type", list(Q4_K_WIDTHS))
def test_a_q4_k_recipe_quantizes_every_expert_of_every_family_llama_cpp_runs(model_type, tmp_path, capsys):
    """gguf-q4_k-gptq on each family llama.cpp runs: every expert solved and audited, each layer's
    experts stacked in Q4_K or Q6_K (llama.cpp's Q4_K_M rules), the stored bytes those the run
    predicted, and lowbit's reader loads the file back (llama.cpp runs these families' files in
    test_moe_llama_cpp.py)."""
    from lowbit.export.formats.gguf.reader import gguf_tensor_bytes
    from lowbit.export.reader import load

    source = save_tiny_moe(tmp_path / "source", model_type, **Q4_K_WIDTHS[model_type])
    out = tmp_path / "run"
    assert main(["run", "gguf-q4_k-gptq", "--model", str(source), "--output", str(out), *RUN_SETS]) == 0
    assert "audit       passed" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["audit"]["checked"] == expected_linears(model_type)
    reader = gguf.GGUFReader(str(out / "model.gguf"))
    stacks = {t.name: t.tensor_type.name for t in reader.tensors if "_exps.weight" in t.name}
    assert len(stacks) == 3 * len(expert_layers(model_type)) and set(stacks.values()) <= {"Q4_K", "Q6_K"}, stacks
    assert "Q4_K" in stacks.values()
    assert results["memory"]["predicted"]["weights"] == pytest.approx(gguf_tensor_bytes(out / "model.gguf"), rel=0.02)
    model, _ = load(out)
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
