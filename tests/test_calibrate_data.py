import json

import pytest
import torch

from lowbit.calibrate.corpora import corpus_documents, corpus_text
from lowbit.calibrate.data import CalibrationConfig, calibration_batches, load_text


class CharTokenizer:
    """One token per byte: enough to test batching without a real vocabulary."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        class Out:
            input_ids = torch.tensor([list(text.encode("utf-8"))])
        return Out()


@pytest.mark.parametrize("name", ["wiki", "news"])
def test_builtin_corpus_parts_are_disjoint_and_deterministic(name):
    calib, evaluation = corpus_text(name, "calib"), corpus_text(name, "eval")
    assert len(calib) > 3 * len(evaluation) > 0
    calib_docs, eval_docs = set(calib.split("\n\n")), set(evaluation.split("\n\n"))
    assert not calib_docs & eval_docs
    assert len(calib_docs) + len(eval_docs) == len(set(corpus_documents(name)))
    assert corpus_text(name, "eval") == evaluation


def test_wiki_text_is_prose_without_markup():
    text = corpus_text("wiki", "eval")
    assert len(text) > 300_000
    for marker in ("[[", "]]", "{{", "'''", "==", "<ref"):
        assert marker not in text, marker


def test_unknown_part_and_corpus_are_refused():
    with pytest.raises(ValueError, match="valid"):
        corpus_text("wiki", "test")
    with pytest.raises(ValueError, match="built-in"):
        corpus_text("wikipedia", "eval")


def test_batches_are_seeded_and_deterministic():
    cfg = CalibrationConfig(dataset="news", samples=6, seq_len=64, seed=3)
    a = calibration_batches(cfg, CharTokenizer())
    b = calibration_batches(cfg, CharTokenizer())
    c = calibration_batches(CalibrationConfig(dataset="news", samples=6, seq_len=64, seed=4), CharTokenizer())
    assert a.shape == (6, 64) and torch.equal(a, b) and not torch.equal(a, c)


def test_local_txt_and_jsonl_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    rows = [{"text": f"record {i} " * 20} for i in range(5)]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_text(str(tmp_path / "a.txt")).startswith("hello world")
    assert "record 4" in load_text(str(tmp_path / "b.jsonl"))
    batches = calibration_batches(CalibrationConfig(dataset=str(tmp_path / "b.jsonl"), samples=2, seq_len=16),
                                  CharTokenizer())
    assert batches.shape == (2, 16)


def test_jsonl_errors_name_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object with a 'text' field"):
        load_text(str(tmp_path / "bad.jsonl"))


def test_too_little_text_is_a_clear_error(tmp_path):
    (tmp_path / "tiny.txt").write_text("short")
    cfg = CalibrationConfig(dataset=str(tmp_path / "tiny.txt"), samples=4, seq_len=64)
    with pytest.raises(ValueError, match="fewer than one sample of seq_len 64"):
        calibration_batches(cfg, CharTokenizer())


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(str(tmp_path / "nope.txt"))
