"""What a .gguf file calls things: the architectures lowbit writes (and the configs llama.cpp's
graphs would compute another model from), their tensor names (the `gguf` package's TensorNameMap,
as llama.cpp's convert_hf_to_gguf.py uses it) and the q/k row order llama.cpp expects. The
hyperparameter metadata is metadata.py's.

A mixture of experts' routed experts are one 3-D tensor per projection in a .gguf file
(`blk.N.ffn_gate_exps` [experts, rows, cols], expert 0 first), as llama.cpp's converter stacks the
hub's per-expert tensors; lowbit's per-expert linears are stacked on write and split on read."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from .rope import head_dim, rope_freqs


@dataclass(frozen=True)
class GGUFArch:
    name: str  # general.architecture, and the MODEL_ARCH member's value
    permute_qk: bool  # llama.cpp's llama graph rotates interleaved pairs: q/k rows are reordered on write
    # a mixture of experts: whether llama.cpp's graph renormalizes the top-k routing weights (it
    # reads no setting for it, so the model's norm_topk_prob must agree); None for a dense model
    norm_topk: Optional[bool] = None
    # llama.cpp's graph requires output.weight (it reads no tied output from token_embd): a tied
    # model's output is written out as its own tensor
    output_required: bool = False
    # llama.cpp's graph holds k's norm as wide as q's (OLMoE's q_norm and k_norm span all heads):
    # it loads only models with as many key/value heads as query heads
    kv_heads_equal: bool = False
    # transformers' gguf_file= loader reads this architecture (its GGUF_CONFIG_MAPPING); where it does
    # not, the checkpoint folder carries the tokenizer's own files for lowbit and transformers to read
    transformers_reads: bool = True
    # DeepSeek-style routing (GLM-4.5): sigmoid scores, a selection bias (`exp_probs_b`), leading dense
    # layers, shared experts counted; llama.cpp reads the top-k normalization and scale from the file
    sigmoid_routing: bool = False
    # gpt-oss: YaRN RoPE, sliding-window attention on every other layer (the first one sliding),
    # attention sinks, experts with biases and OpenAI's clamped SwiGLU, whose width llama.cpp always reads
    gpt_oss: bool = False
    # Llama 4: MoE layers every `interleave_moe_layer_step`, top-k logits through a sigmoid onto the
    # expert's input, a shared expert as wide as the routed ones; chunked attention, no RoPE on every
    # fourth layer, q/k L2 norms, which llama.cpp's graph fixes rather than reads
    llama4: bool = False
    # RoPE types llama.cpp reads for this graph beside the default (llama3: a rope_freqs tensor)
    ropes: tuple = ()
    # DeepSeek's latent attention, written for llama.cpp's MHA path: kv_b_proj whole (`attn_kv_b`), as
    # lowbit quantized its rows; llama.cpp's MLA path wants it cut per head with k's half transposed,
    # which quantized rows cannot give without rounding again
    latent_attention: bool = False

    @property
    def moe(self) -> bool:
        return self.norm_topk is not None or self.sigmoid_routing or self.llama4


ARCHS = {
    "llama": GGUFArch("llama", permute_qk=True, ropes=("llama3",)),
    "qwen2": GGUFArch("qwen2", permute_qk=False),  # NEOX rope: rows kept as they are
    "qwen3_moe": GGUFArch("qwen3moe", permute_qk=False, norm_topk=True),
    "qwen2_moe": GGUFArch("qwen2moe", permute_qk=False, norm_topk=False, output_required=True),
    "mixtral": GGUFArch("llama", permute_qk=True, norm_topk=True, ropes=("llama3",)),  # llama.cpp's llama graph
    # NEOX rope (rows as they are), softmax routing never renormalized, q/k norms over all heads
    "olmoe": GGUFArch("olmoe", permute_qk=False, norm_topk=False, output_required=True, kv_heads_equal=True,
                      transformers_reads=False),
    "glm4_moe": GGUFArch("glm4moe", permute_qk=False, transformers_reads=False, sigmoid_routing=True),
    # NEOX rope; softmax over the top-k router logits (renormalized by construction)
    "gpt_oss": GGUFArch("gpt-oss", permute_qk=False, norm_topk=True, output_required=True, transformers_reads=False,
                        gpt_oss=True, ropes=("yarn",)),
    # RoPE on interleaved pairs (rope_interleave), as llama.cpp's: rows kept as they are
    "deepseek_v3": GGUFArch("deepseek2", permute_qk=False, transformers_reads=False, sigmoid_routing=True,
                            latent_attention=True, ropes=("yarn",)),
    # RoPE on interleaved pairs, as llama.cpp's: rows kept as they are
    "llama4_text": GGUFArch("llama4", permute_qk=False, transformers_reads=False, llama4=True, ropes=("llama3",)),
}
SWIGLU_LIMIT = 7.0  # llama.cpp's gpt-oss graph clamps the gate and up at ±7 (alpha 1.702), as released
ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # float32 always, as llama.cpp's converter keeps them
# a routed expert's linear weight or bias in lowbit's modules: (experts module).(index).(projection).(kind)
EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>[a-z_0-9]+)\.(?P<kind>weight|bias)$")


def arch_of(config, where: str) -> GGUFArch:
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHS:
        raise ValueError(f"{where}: GGUF export supports the architectures {sorted(ARCHS)}; this model is "
                         f"{model_type!r}")
    arch = ARCHS[model_type]
    rope = getattr(config, "rope_parameters", None) or {}
    ropes = ("default", *arch.ropes)
    if rope.get("rope_type", "default") not in ropes:
        raise ValueError(f"{where}: GGUF export writes {' or '.join(ropes)} RoPE for {model_type}; this model's "
                         f"rope_parameters.rope_type is {rope.get('rope_type')!r}")
    if arch.gpt_oss:
        check_gpt_oss(config, where)
    if arch.llama4:
        check_llama4(config, where)
    norm = getattr(config, "norm_topk_prob", None)  # absent: the family's own fixed routing (Mixtral's)
    if arch.norm_topk is not None and norm is not None and bool(norm) != arch.norm_topk:
        raise ValueError(f"{where}: llama.cpp's {arch.name} graph {'always' if arch.norm_topk else 'never'} "
                         f"renormalizes the top-k routing weights; this model's config.json has norm_topk_prob: "
                         f"{str(bool(norm)).lower()}, so llama.cpp would compute another model")
    if arch.latent_attention and not getattr(config, "rope_interleave", True):
        raise ValueError(f"{where}: llama.cpp's {arch.name} graph rotates interleaved pairs; this model's config.json "
                         "has rope_interleave: false, so llama.cpp would compute another model")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if arch.kv_heads_equal and kv_heads not in (None, heads):
        raise ValueError(f"{where}: llama.cpp's {arch.name} graph normalizes keys over all {heads} heads' width, "
                         f"so it loads only models with num_key_value_heads equal to num_attention_heads; this "
                         f"model's config.json has {kv_heads}")
    return arch


def check_gpt_oss(config, where: str) -> None:
    """What llama.cpp's gpt-oss graph fixes rather than reads: sliding layers alternate from the
    first, and the SwiGLU clamp."""
    kinds = list(getattr(config, "layer_types", None) or [])
    pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]
    if kinds and kinds != pattern:
        raise ValueError(f"{where}: llama.cpp's gpt-oss graph slides the attention window on every other layer from "
                         f"the first; this model's config.json has layer_types {kinds}, so llama.cpp would compute "
                         "another model")
    limit = getattr(config, "swiglu_limit", SWIGLU_LIMIT)
    if float(limit) != SWIGLU_LIMIT:
        raise ValueError(f"{where}: llama.cpp's gpt-oss graph clamps the SwiGLU at {SWIGLU_LIMIT}; this model's "
                         f"config.json has swiglu_limit {limit}, so llama.cpp would compute another model")


def check_llama4(config, where: str) -> None:
    """What llama.cpp's llama4 graph fixes rather than reads (llama-model.cpp, llama4.cpp): MoE
    layers every interleave step, no RoPE on every fourth layer, 8192-token attention chunks on the
    others, temperature tuning with floor 8192 and scale 0.1 where there is no RoPE, and q/k L2 norms
    unless the model has 128 experts."""
    layers, step = config.num_hidden_layers, config.interleave_moe_layer_step
    fixed = {
        "moe_layers": list(range(step - 1, layers, step)),
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
        "attention_chunk_size": 8192,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "use_qk_norm": config.num_local_experts != 128,
    }
    for key, value in fixed.items():
        found = getattr(config, key, None)
        if (list(found) if isinstance(found, (list, tuple)) else found) != value:
            raise ValueError(f"{where}: llama.cpp's llama4 graph computes {key} {value} for this model; its "
                             f"config.json has {found}, so llama.cpp would compute another model")


def transformers_reads(config) -> bool:
    """Whether transformers' gguf_file= loader rebuilds this model from the file: its architecture is
    in that loader's table, and the file needs no rope_freqs tensor (the loader drops Llama 3's RoPE
    scaling and would compute another model)."""
    return ARCHS[config.model_type].transformers_reads and rope_freqs(config) is None


class TensorNames:
    """Hugging Face state-dict names <-> .gguf tensor names for one model."""

    def __init__(self, arch: GGUFArch, num_layers: int):
        import gguf

        member = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch.name)
        self._map = gguf.get_tensor_name_map(member, num_layers)

    def gguf_name(self, hf_name: str) -> str | None:
        """The .gguf name, or None for a tensor llama.cpp does not store (RoPE's inv_freq). The router's
        selection bias (`e_score_correction_bias`, a buffer) is the map's `e_score_correction.bias`."""
        hf_name = re.sub(r"\.e_score_correction_bias$", ".e_score_correction.bias", hf_name)
        hf_name = re.sub(r"\.sinks$", ".sinks.weight", hf_name)  # gpt-oss's attention sinks: `attn_sinks.weight`
        return self._map.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def stacked_name(hf_name: str) -> Optional[tuple[str, int]]:
    """(the experts' stacked tensor name, this expert's index) for a routed expert's linear weight
    or bias (`model.layers.1.mlp.experts.3.gate_proj.weight` -> `model.layers.1.mlp.experts.gate_proj.weight`,
    3); None for any other tensor."""
    m = EXPERT_TENSOR.match(hf_name)
    return None if m is None else (f"{m['experts']}.{m['proj']}.{m['kind']}", int(m["index"]))


def is_router(gguf_name: str) -> bool:
    return gguf_name.removesuffix(".weight").rpartition(".")[2] in ROUTERS


def qk_row_order(config, hf_name: str, arch: GGUFArch) -> torch.Tensor | None:
    """The row permutation llama.cpp's converter applies to a llama q_proj/k_proj weight (and bias):
    each head's rows [0, d/2) and [d/2, d) interleaved. None for every other tensor. Rows only, so a
    packed GGML row (whole blocks along in_features) moves as one piece."""
    if not arch.permute_qk:
        return None
    if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        heads = config.num_attention_heads
    elif hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        heads = config.num_key_value_heads
    else:
        return None
    rows = heads * head_dim(config)
    # convert_hf_to_gguf: w.reshape(heads, 2, d/2, ...).swapaxes(1, 2).reshape(w.shape)
    return torch.arange(rows).reshape(heads, 2, -1).transpose(1, 2).reshape(-1)


def inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.argsort(order)
