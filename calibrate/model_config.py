"""What a model's config.json says before any weight is read: whether it is a decoder-only causal LM
with its head (what lowbit quantizes), and whether it runs its own code (auto_map), which lowbit
runs only when asked and then carries into every checkpoint it writes.

Facts come from the file, not from loading: transformers' AutoModelForCausalLM turns a BERT
encoder into BertLMHeadModel, and a headless LlamaModel into LlamaForCausalLM, each with a random
head, and carries on.
"""
from __future__ import annotations

import json
from pathlib import Path

CAUSAL_LMS = "lowbit quantizes decoder-only causal language models (…ForCausalLM with their LM head)"
ASK_FOR_CODE = ("the recipe key `trust_remote_code: true` (lowbit export: --trust-remote-code) runs that code; "
                "review it first: it runs as Python on this machine")
CODE_AUTO_CLASSES = ("AutoConfig", "AutoModelForCausalLM", "AutoModel")  # what loading the model imports


def check_model_source(model: str, trust_remote_code: bool, local_files_only: bool = False) -> list[str]:
    """Before any weight is read: the model is a decoder-only causal LM, and its own code, if it
    has some, is allowed and found. Returns the code's file names (empty when it runs none)."""
    config = read_config(model, local_files_only)
    check_decoder_lm(config, model)
    return check_model_code(config, model, trust_remote_code)


def read_config(path: str, local_files_only: bool = False) -> dict:
    """config.json of a local folder, or of a hub id (from the Hugging Face cache, else fetched)."""
    folder = Path(path)
    if folder.is_dir():
        file = folder / "config.json"
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"{file}: not readable JSON ({' '.join(str(err).split())[:200]})") from None
    else:
        from huggingface_hub import hf_hub_download

        with open(hf_hub_download(path, "config.json", local_files_only=local_files_only), encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config.json holds a {type(config).__name__}, not a mapping")
    return config


def check_decoder_lm(config: dict, model: str) -> None:
    """Refuse an encoder-decoder, an encoder or a headless base model, naming what config.json says."""
    if config.get("is_encoder_decoder"):
        raise ValueError(f"{model}: config.json's is_encoder_decoder is true (model_type "
                         f"{config.get('model_type')!r}), an encoder-decoder model; {CAUSAL_LMS}")
    if "AutoModelForCausalLM" in _auto_map(config):
        return  # the model's own code names its causal LM class
    names = [n for n in config.get("architectures") or [] if isinstance(n, str)]
    kinds = [_not_causal(name, config) for name in names]
    if names and all(kinds):
        raise ValueError(f"{model}: config.json's architectures is {names}, {kinds[0]}; {CAUSAL_LMS}")


def _not_causal(name: str, config: dict) -> str:
    """What the class `name` is when it is no causal LM with a head, else ''. Wrapper classes such
    as Gemma3ForConditionalGeneration are transformers' causal LMs for their model type: kept."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES)

    if name in _class_names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return ""
    if name in _class_names(MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        return "a masked language model (an encoder)"
    if name.endswith("Model") and name in _class_names(MODEL_MAPPING_NAMES):
        if config.get("model_type") in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            return "an encoder (a base model of a masked-LM family)"
        if config.get("tie_word_embeddings") is False:
            return "a base model without its LM head (and tie_word_embeddings is false: no head to share)"
    return ""


def _class_names(mapping) -> set[str]:
    return {n for v in mapping.values() for n in ([v] if isinstance(v, str) else v)}


def _auto_map(config: dict) -> dict:
    auto_map = config.get("auto_map")
    return auto_map if isinstance(auto_map, dict) else {}


def check_model_code(config: dict, model: str, trust_remote_code: bool) -> list[str]:
    """The file names of the model's own code (empty when loading it runs none); refuses code the
    user did not allow, and code lowbit could not carry into the checkpoint."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    modules = code_modules(config, model)
    if not modules:
        return []
    if not trust_remote_code:
        if config.get("model_type") in CONFIG_MAPPING_NAMES:
            return []  # transformers' own classes load it; auto_map is not used
        files = ", ".join(f"{m}.py" for m in modules)
        raise ValueError(f"{model}: config.json's auto_map needs the model's own code ({files}) and its "
                         f"model_type {config.get('model_type')!r} is not one transformers knows; {ASK_FOR_CODE}")
    if not Path(model).is_dir():
        raise ValueError(f"{model}: its own code (config.json's auto_map) is carried into the checkpoint "
                         f"only from a local folder; download it first (`hf download {model} --local-dir DIR`, "
                         "then --model DIR)")
    return code_files(Path(model), modules)


def code_modules(config: dict, model: str) -> list[str]:
    """The modules config.json's auto_map names for loading the model (configuration_x, modeling_x)."""
    modules: list[str] = []
    for key, ref in _auto_map(config).items():
        if key not in CODE_AUTO_CLASSES:
            continue
        if not isinstance(ref, str) or ref.count(".") != 1 or "--" in ref:
            raise ValueError(f"{model}: config.json's auto_map[{key!r}] is {str(ref)[:120]!r}; lowbit carries a "
                             "model's own code from its folder only: expected 'module_file.ClassName'")
        module = ref.split(".")[0]
        if module not in modules:
            modules.append(module)
    return modules


def code_files(folder: Path, modules: list[str]) -> list[str]:
    """`modules`' files in `folder` and the files they import from it (`from .x import y`, as
    transformers reads them), in order; a missing one is refused, naming who imports it."""
    from transformers.dynamic_module_utils import get_relative_imports

    files: list[str] = []
    todo = [(m, "config.json's auto_map") for m in modules]
    while todo:
        module, named_by = todo.pop(0)
        name = f"{module}.py"
        if name in files:
            continue
        if not module.isidentifier():
            raise ValueError(f"{folder}: {named_by} imports {module!r}; lowbit carries a model's own code "
                             "as plain .py files beside config.json")
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: missing; {named_by} needs it (the model's own code)")
        files.append(name)
        todo += [(m, name) for m in sorted(get_relative_imports(folder / name))]
    return files
