"""The baseline cache: a figure is reused only for the same code, weights and protocol."""
from __future__ import annotations

import os

import pytest

from lowbit.evaluate import baseline
from lowbit.evaluate.config import PerplexityProtocol


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights-v1")
    (folder / "config.json").write_text("{}")
    return folder


def measured(calls: list):
    def measure():
        calls.append(1)
        return {"perplexity": 10.0 + len(calls)}
    return measure


def test_same_model_and_code_reuse_the_figure(model_dir):
    calls = []
    first = baseline.cached_baseline(str(model_dir), PerplexityProtocol(), measured(calls))
    again = baseline.cached_baseline(str(model_dir), PerplexityProtocol(), measured(calls))
    assert (first["cached"], again["cached"], len(calls)) == (False, True, 1)
    assert again["perplexity"] == first["perplexity"]


def test_new_weights_with_the_same_size_and_mtime_miss(model_dir):
    calls = []
    weights = model_dir / "model.safetensors"
    baseline.cached_baseline(str(model_dir), PerplexityProtocol(), measured(calls))
    st = weights.stat()
    weights.write_bytes(b"weights-v2")  # same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a copy tool may keep mtimes; content decides
    assert not baseline.cached_baseline(str(model_dir), PerplexityProtocol(), measured(calls))["cached"]
    assert len(calls) == 2


def test_new_code_versions_or_protocol_miss(model_dir, monkeypatch):
    calls = []
    baseline.cached_baseline(str(model_dir), PerplexityProtocol(), measured(calls))
    assert not baseline.cached_baseline(str(model_dir), PerplexityProtocol(max_tokens=1024), measured(calls))["cached"]
    versions = {**baseline.code_versions(), "transformers": "0.0-other"}
    monkeypatch.setattr(baseline, "code_versions", lambda: versions)
    assert not baseline.cached_baseline(str(model_dir), PerplexityProtocol(), measured(calls))["cached"]
    assert len(calls) == 3


def test_file_hash_is_memoized_and_matches_hashlib(model_dir):
    import hashlib

    weights = model_dir / "model.safetensors"
    assert baseline.file_sha256(weights) == hashlib.sha256(b"weights-v1").hexdigest()
    memo = list((model_dir.parent / "cache" / "hashes").iterdir())
    assert len(memo) == 1
    memo[0].write_text("memoized")  # a second call reads the memo, not the file
    assert baseline.file_sha256(weights) == "memoized"
