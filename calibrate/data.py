"""Text sources (built-in corpora, local files, `datasets`) and seeded calibration token batches."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch

from .corpora import CORPORA, corpus_text
from .experts import MOE_MODES, ExpertCalibration
from .messages import short_repr, shown_name


@dataclass(frozen=True)
class CalibrationConfig:
    dataset: str = "wiki"  # built-in corpus, a .txt/.jsonl path, or a `datasets` name
    samples: int = 128
    seq_len: int = 512
    seed: int = 0
    split: str = "train"  # `datasets` only
    dataset_config: Optional[str] = None  # `datasets` only
    text_column: str = "text"  # .jsonl and `datasets`
    # where the layer forwards and statistics run: auto (a GPU when there is one), cpu, cuda, cuda:N;
    # the model waits on the CPU (or on disk, streamed) and each layer moves there in turn
    device: str = "auto"
    # true: the model is never resident, each decoder layer is read from its safetensors shards when
    # reached and written out when done; auto: only when it would not fit in memory in float32
    streaming: Literal["auto", True, False] = "auto"
    # where the activations wait between decoder layers (calibrate/offload.py): auto (the device when
    # they fit there, else CPU memory, else disk), device, cpu, or disk (files in the run's resume folder)
    offload: Literal["auto", "device", "cpu", "disk"] = "auto"
    # mixtures of experts (calibrate/experts.py): what each expert's statistics see, every token of its
    # layer (all_experts) or those the router sends it (routed); the layer's output follows the router
    moe: Literal["all_experts", "routed"] = ExpertCalibration.mode
    # a routed expert that fewer calibration tokens reached is rounded to nearest, and named
    moe_min_tokens: int = ExpertCalibration.min_tokens

    def __post_init__(self):
        from .hardware import check_device_name
        from .offload import OFFLOADS

        check_device_name(self.device, "calibration.device")
        if self.offload not in OFFLOADS:
            raise ValueError(f"calibration.offload must be one of {', '.join(OFFLOADS)}, "
                             f"got {short_repr(self.offload)}")
        if self.moe not in MOE_MODES:
            raise ValueError(f"calibration.moe must be one of {', '.join(MOE_MODES)}, got {short_repr(self.moe)}")
        if isinstance(self.moe_min_tokens, bool) or not isinstance(self.moe_min_tokens, int) or self.moe_min_tokens < 0:
            raise ValueError(f"calibration.moe_min_tokens must be a whole number >= 0, got {short_repr(self.moe_min_tokens)}")
        if self.samples < 1 or self.seq_len < 2:
            raise ValueError(f"calibration needs samples >= 1 and seq_len >= 2, got samples {self.samples} "
                             f"and seq_len {self.seq_len}")

    def experts(self) -> ExpertCalibration:
        return ExpertCalibration(self.moe, self.moe_min_tokens)


def load_text(dataset: str, part: str = "calib", split: str = "train",
              dataset_config: Optional[str] = None, text_column: str = "text") -> str:
    """All text of a source as one string. `part` picks the built-in corpora's calib/eval half."""
    if dataset in CORPORA:
        return corpus_text(dataset, part)
    path = Path(dataset)
    if path.suffix in (".txt", ".jsonl"):
        if not path.exists():
            raise FileNotFoundError(f"calibration/evaluation text file {path} does not exist")
        if path.suffix == ".txt":
            return path.read_text(encoding="utf-8")
        return "\n\n".join(_jsonl_texts(path, text_column))
    return _datasets_text(dataset, split, dataset_config, text_column)


def _jsonl_texts(path: Path, column: str) -> list[str]:
    texts = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or column not in record:
            raise ValueError(f"{path}:{lineno}: expected an object with a {short_repr(column)} field")
        texts.append(str(record[column]))
    return texts


def _datasets_text(name, split, config, column) -> str:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # the datasets library raises many types; keep its message
        raise ValueError(
            f"could not load dataset {short_repr(name)} (config {short_repr(config)}, "
            f"split {short_repr(split)}): {err}. "
            f"Built-in corpora need no network: {sorted(CORPORA)}; local .txt/.jsonl files work too."
        ) from err
    if column not in ds.column_names:
        raise ValueError(f"dataset {short_repr(name)} has no column {short_repr(column)}; columns: {ds.column_names}")
    return "\n\n".join(t for t in ds[column] if t)


def calibration_batches(cfg: CalibrationConfig, tokenizer) -> torch.Tensor:
    """(samples, seq_len) token ids: windows cut at seeded random offsets of the tokenized text."""
    text = load_text(cfg.dataset, "calib", cfg.split, cfg.dataset_config, cfg.text_column)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if len(ids) < cfg.seq_len + 1:
        empty = " (the text is empty)" if not text.strip() else ""
        raise ValueError(
            f"calibration data {shown_name(cfg.dataset)} has {len(ids)} tokens{empty}, fewer than one sample of "
            f"seq_len {cfg.seq_len}; use more text or a smaller calibration.seq_len"
        )
    gen = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, len(ids) - cfg.seq_len, (cfg.samples,), generator=gen)
    return torch.stack([ids[s : s + cfg.seq_len] for s in starts.tolist()])
