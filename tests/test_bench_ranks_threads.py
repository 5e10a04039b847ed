"""bench/ranks_threads.py's comparison of checkpoints: packed nibbles are compared code by code, a
different tensor set is refused, and its record renders as a results table. (Its three `lowbit run`s
are what tests/test_distributed.py checks byte for byte at a smaller scale.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import ranks_threads  # noqa: E402
import results_tables  # noqa: E402


def packed(nibbles: list[int]) -> torch.Tensor:
    word = sum(n << (4 * i) for i, n in enumerate(nibbles))
    return torch.tensor([word - (1 << 32) if word >= 1 << 31 else word], dtype=torch.int32)


def test_packed_codes_are_compared_one_nibble_at_a_time(tmp_path):
    first, other = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    scale = torch.ones(1)
    save_file({"l.weight_packed": packed([1, 2, 3, 4, 5, 6, 7, 15]), "l.weight_scale": scale}, first)
    save_file({"l.weight_packed": packed([1, 2, 3, 4, 5, 6, 7, 14]), "l.weight_scale": scale * 2}, other)
    codes_a, codes_b = ranks_threads.codes(first), ranks_threads.codes(other)
    assert codes_a["l.weight_packed"].tolist() == [1, 2, 3, 4, 5, 6, 7, 15]
    assert set(codes_a) == {"l.weight_packed"}  # float scales are not codes
    assert ranks_threads.identical_share(codes_a, codes_b) == 7 / 8


def test_checkpoints_with_other_tensors_are_refused_by_name():
    with pytest.raises(SystemExit, match="b.weight_packed"):
        ranks_threads.identical_share({"a.weight_packed": torch.zeros(2)}, {"b.weight_packed": torch.zeros(2)})


def test_its_record_renders_every_way(tmp_path):
    import json

    rows = [dict(way="1 process, 1 thread", seconds=10.0, model_safetensors_sha256="abc", perplexity=18.99721,
                 codes_identical_to_first=1.0),
            dict(way="1 process, 2 threads (the default)", seconds=9.0, model_safetensors_sha256="def",
                 perplexity=18.95612, codes_identical_to_first=0.9434)]
    path = tmp_path / "ranks_threads-x.json"
    path.write_text(json.dumps({"command": "python bench/ranks_threads.py", "date": "2026-12-06",
                                "recipe": "w4a16-gptq", "model": "smollm2-135m", "samples": 16, "rows": rows}))
    page = results_tables.render_all([path], tmp_path)[tmp_path / "ranks_threads.md"]
    assert "| 1 process, 2 threads (the default) | 94.3400% | def | 18.9561 | 9.0 |" in page
    assert "`w4a16-gptq` on smollm2-135m, 16 calibration samples." in page
