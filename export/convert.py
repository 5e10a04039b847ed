"""`lowbit export`: rewrite a checkpoint (lowbit's or another tool's) in another format."""
from __future__ import annotations

import json
from pathlib import Path

from .checkpoint import is_checkpoint, save
from .config import DTYPES, ExportConfig
from .formats.hf_folder import model_code
from .manifest import MANIFEST, verify_manifest
from .output_folder import check_apart, check_output_dir, check_output_name
from .reader import load

PROVENANCE = ("recipe.yaml",)  # carried over; figures (results.json) describe the source, not the copy


def convert(source: str | Path, output: str | Path, fmt: str, overwrite: bool = False,
            dtype: str | None = None, gguf_type: str | None = None, embedding_type: str | None = None,
            trust_remote_code: bool = False) -> Path:
    source = Path(source)
    if not is_checkpoint(source):
        raise FileNotFoundError(f"{source}: not a checkpoint folder (needs config.json and model.safetensors, "
                                "model.safetensors.index.json or model.gguf)")
    check_output_name(Path(output), "--output", str(output))
    check_apart(Path(output), [("source checkpoint", source)])
    check_output_dir(Path(output), overwrite)
    cfg = ExportConfig(format=fmt, dtype=dtype or _source_dtype(source),  # checks fmt
                       type=gguf_type, embedding_type=embedding_type)
    problems = verify_manifest(source) if (source / MANIFEST).is_file() else []
    if problems:
        raise ValueError(f"{source} does not match its {MANIFEST}: {'; '.join(problems[:3])}")
    model, tokenizer = load(source, trust_remote_code=trust_remote_code)
    extra = {name: (source / name).read_text(encoding="utf-8") for name in PROVENANCE if (source / name).is_file()}
    extra.update(model_code(source, trust_remote_code))  # the model's own code travels with it
    return save(model, tokenizer, output, cfg, extra_files=extra, overwrite=overwrite)


def _source_dtype(source: Path) -> str:
    """Keep the source's float dtype when it is one an export can write, else the default."""
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "")
    return dtype if dtype in DTYPES else ExportConfig.dtype
