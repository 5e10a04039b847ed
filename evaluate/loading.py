"""The model an evaluation measures: a checkpoint folder as written, or a plain model."""
from __future__ import annotations

from pathlib import Path

from lowbit.calibrate.models import load_model
from lowbit.export import checkpoint

from .memory import checkpoint_weight_bytes, model_weight_bytes


def load_target(target: str | Path, trust_remote_code: bool, allow_pickle: bool):
    """(model, tokenizer, weight bytes): a checkpoint's bytes as its files hold them; a plain
    model's as a 16-bit checkpoint."""
    if checkpoint.is_checkpoint(Path(target)):
        model, tokenizer = checkpoint.load(target, trust_remote_code=trust_remote_code)
        return model, tokenizer, checkpoint_weight_bytes(target)
    model, tokenizer, _ = load_model(str(target), trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    return model, tokenizer, model_weight_bytes(model, bytes_per_param=2)
