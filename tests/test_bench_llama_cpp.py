"""bench/gguf_vs_llama_cpp.py reads llama-perplexity's summary as llama.cpp prints it (its printf formats,
tools/perplexity/perplexity.cpp) and refuses a --lowbit folder that holds no GGUF file, by name."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import gguf_vs_llama_cpp as llama_cpp  # noqa: E402  (named so: a bench/llama_cpp.py would shadow llama-cpp-python)


def test_scores_are_read_from_llama_perplexitys_summary():
    summary = "\n".join([
        "Mean PPL(Q)                   : %10.6lf ± %10.6lf" % (12.758012, 0.2),
        "Mean PPL(base)                : %10.6lf ± %10.6lf" % (11.616301, 0.2),
        "Mean    KLD: %10.6lf ± %10.6lf" % (0.107043, 0.001),
        "Maximum KLD: %10.6lf" % 4.2,
        "Same top p: %6.3lf ± %5.3lf %%" % (83.308, 0.2),
    ])
    assert llama_cpp.parse_scores(summary) == {"perplexity": 12.758012, "kld_mean": 0.107043, "same_top": 0.83308}
    with pytest.raises(RuntimeError, match="KLD"):
        llama_cpp.parse_scores(summary.replace("Mean    KLD", "Mean KL"))


def test_a_lowbit_folder_without_a_gguf_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"--lowbit {tmp_path}: no model.gguf"):
        llama_cpp.lowbit_file(tmp_path)


def test_the_memo_keeps_a_files_figures_until_the_file_or_the_protocol_changes(tmp_path):
    made = tmp_path / "q4_0.gguf"
    made.write_bytes(b"one")
    memo = llama_cpp.Memo(tmp_path / "memo.json", {"chunks": 40})
    assert memo.get("scores", made) is None and memo.get("scores", tmp_path / "absent.gguf") is None
    memo.put("scores", made, {"kld_mean": 0.1})
    assert llama_cpp.Memo(tmp_path / "memo.json", {"chunks": 40}).get("scores", made) == {"kld_mean": 0.1}
    assert llama_cpp.Memo(tmp_path / "memo.json", {"chunks": 8}).get("scores", made) is None
    made.write_bytes(b"other bytes")
    assert llama_cpp.Memo(tmp_path / "memo.json", {"chunks": 40}).get("scores", made) is None
