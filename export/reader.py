"""Read a checkpoint into lowbit's runtime modules: lowbit's own exports in any registered format
and checkpoints other tools wrote in one (compressed-tensors, single or sharded; plain float)."""
from __future__ import annotations

from pathlib import Path

import torch

from lowbit.calibrate.checks import check_tensors_match
from lowbit.calibrate.experts import module_name, split_stored_experts, unfuse_experts
from lowbit.calibrate.model_config import check_model_source
from lowbit.quantize.runtime.modules import is_quantized_linear

from . import kv_scales
from .formats.hf_folder import read_safetensors
from .formats.registry import FORMATS, format_of

read_tensors = read_safetensors  # checkpoint.read_tensors: a safetensors folder's tensors


def load(folder: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """(model, tokenizer) with QuantLinear modules for every quantized linear in the checkpoint.

    Float tensors are cast to `dtype` for compute (float32 on CPU, where bf16 matmuls are slow).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder (no config.json)")
    check_model_source(str(folder), trust_remote_code)  # its own code allowed and present, before any runs
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    config_dict = config.to_dict()
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we build the runtime modules ourselves
    with no_init_weights():  # every tensor is overwritten from the file; skip random init
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
    unfuse_experts(model)  # lowbit writes experts under the hub's per-expert names
    fmt = format_of(config_dict)
    tensors = fmt.read_tensors(folder, model) if fmt is not None else read_tensors(folder)
    tensors = {module_name(config.model_type, k): t for k, t in tensors.items()}  # the hub's expert names
    tensors = split_stored_experts(model, tensors)
    _install_quantized(model, tensors, config_dict, f"{folder}/config.json")
    kv_scales.restore(model, config.to_dict(), tensors)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    _load_float(model, tensors, folder)
    model.eval()
    tokenizer = fmt.load_tokenizer(folder, trust_remote_code) if fmt is not None \
        else AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    return model, tokenizer


def _install_quantized(model, tensors, config: dict, where: str) -> None:
    fmt = format_of(config)
    if fmt is not None:
        fmt.read(model, tensors, config, where)
    elif config.get("quantization_config"):  # a float checkpoint (none) has nothing to install
        method = config["quantization_config"].get("quant_method")
        known = model.state_dict().keys()
        foreign = next((k for k in sorted(tensors) if k not in known), None)
        what = f"quantized tensors ({foreign.rpartition('.')[0]}, …) but " if foreign else ""
        raise ValueError(f"{where}: {what}quantization_config.quant_method is {method!r}; "
                         f"lowbit reads the formats {', '.join(map(repr, FORMATS))}")


def _load_float(model, tensors, folder) -> None:
    """The float tensors into `model`; one line names any missing, unexpected or of another shape
    (none is left as the random values from_config gave it)."""
    expected = model.state_dict()
    mismatched = [(k, tuple(t.shape), tuple(expected[k].shape)) for k, t in tensors.items()
                  if k in expected and t.shape != expected[k].shape]
    wrong = {k for k, _, _ in mismatched}
    result = model.load_state_dict({k: t for k, t in tensors.items() if k not in wrong}, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False) and not is_quantized_linear(model.get_output_embeddings()):
        model.tie_weights()
    quantized = {n for n, m in model.named_modules() if is_quantized_linear(m)}
    missing = [k for k in result.missing_keys
               if k not in wrong and k.rpartition(".")[0] not in quantized and not _tied(model, k)]
    check_tensors_match(folder, missing, result.unexpected_keys, mismatched)


def _tied(model, key: str) -> bool:
    """A key absent from the file because it is tied to one that was loaded (lm_head.weight)."""
    if key != "lm_head.weight" or not getattr(model.config, "tie_word_embeddings", False):
        return False
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight
