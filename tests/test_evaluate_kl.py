"""KL divergence and top-1 agreement: the math on known distributions, and on models."""
import math

import pytest
import torch

from lowbit.evaluate.config import KLConfig, PerplexityProtocol
from lowbit.evaluate.kl import kl_divergence, kl_protocol, summarize, token_kl, top1_agree


def test_kl_of_identical_distributions_is_zero():
    logits = torch.randn(3, 7, 50)
    assert torch.allclose(token_kl(logits, logits), torch.zeros(3, 7), atol=1e-6)


def test_kl_matches_hand_computed_value():
    p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.5, 0.25])
    # 0.5 ln 2 + 0.25 ln(1/2) + 0 = 0.25 ln 2
    assert token_kl(p.log(), q.log()).item() == pytest.approx(0.25 * math.log(2), rel=1e-5)


def test_kl_is_invariant_to_logit_shift_and_asymmetric():
    ref, out = torch.randn(4, 10), torch.randn(4, 10)
    assert torch.allclose(token_kl(ref + 3.0, out - 1.0), token_kl(ref, out), atol=1e-5)
    p, q = torch.tensor([0.9, 0.1]).log(), torch.tensor([0.5, 0.5]).log()
    assert token_kl(p, q).item() != pytest.approx(token_kl(q, p).item(), rel=1e-3)


def test_kl_matches_torch_kl_div():
    ref, out = torch.randn(5, 20), torch.randn(5, 20)
    expected = torch.nn.functional.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                          reduction="none").sum(-1)
    assert torch.allclose(token_kl(ref, out), expected, atol=1e-5)


def test_top1_agreement_and_summary():
    ref = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    out = torch.tensor([[0.0, 4.0, 1.0], [0.0, 3.0, 0.0]])
    agree = top1_agree(ref, out)
    assert agree.tolist() == [True, False]
    kl = torch.arange(100, dtype=torch.float)
    s = summarize(kl, torch.ones(100, dtype=torch.bool))
    assert s["kl_mean"] == pytest.approx(49.5)
    assert s["kl_p99"] == pytest.approx(98.01)
    assert s["top1_agreement"] == 1.0 and s["tokens"] == 100


def test_kl_protocol_keeps_windows_and_cuts_tokens():
    proto = PerplexityProtocol(context_len=64, stride=64, max_tokens=1024)
    assert kl_protocol(proto, KLConfig(max_tokens=256)).max_tokens == 256
    assert kl_protocol(proto, KLConfig(max_tokens=8)).max_tokens == 64  # at least one window
    assert kl_protocol(proto, KLConfig(max_tokens=4096)).max_tokens == 1024


class _CharTokenizer:
    """Enough tokenizer for eval_tokens: bytes of the text mod a tiny vocabulary."""
    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        ids = torch.tensor([[3 + b % 500 for b in text.encode()[:4096]]])
        return type("Enc", (), {"input_ids": ids})()


def test_models_identical_give_zero_and_different_give_positive(tiny_llama):
    import copy

    proto = PerplexityProtocol(context_len=64, stride=64, max_tokens=256)
    cfg = KLConfig(max_tokens=128)
    same = kl_divergence(tiny_llama, tiny_llama, _CharTokenizer(), proto, cfg)
    assert same["kl_mean"] == pytest.approx(0.0, abs=1e-6) and same["top1_agreement"] == 1.0
    assert same["tokens"] == 128  # with BOS every one of the first max_tokens tokens is scored once
    noisy = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    diff = kl_divergence(tiny_llama, noisy, _CharTokenizer(), proto, cfg)
    assert diff["kl_mean"] > 1e-4 and diff["kl_p99"] >= diff["kl_mean"]
