"""Logits drawn a chunk of tokens at a time (evaluate/logits.py): the same perplexity and KL as
full-vocabulary logits on every architecture's head (Gemma's soft-capping included), a model
whose head lowbit cannot reproduce falls back to its full logits, and, in a fresh process, the
evaluation's memory stays within a stated bound at a vocabulary where full logits would not."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from lowbit.evaluate import logits as logits_mod
from lowbit.evaluate.config import KLConfig, PerplexityProtocol
from lowbit.evaluate.kl import kl_batches, kl_divergence, token_kl
from lowbit.evaluate.perplexity import perplexity
from tiny_models import make_tiny_model

PROTO = PerplexityProtocol(context_len=64, stride=64, max_tokens=300)


class _CharTokenizer:
    """Enough tokenizer for eval_tokens: bytes of the text mod a tiny vocabulary."""
    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        ids = torch.tensor([[3 + b % 500 for b in text.encode()[:4096]]])
        return type("Enc", (), {"input_ids": ids})()


def full_logits_perplexity(model, tokenizer, protocol) -> float:
    """The former computation: every batch's full logits, one cross-entropy."""
    _, batches = kl_batches(tokenizer, protocol, KLConfig(max_tokens=protocol.max_tokens))
    nll, count = 0.0, 0
    for inputs, mask, labels in batches:
        logits = model(input_ids=inputs, attention_mask=mask).logits.float()
        target = labels[:, 1:]
        nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1),
                               ignore_index=-100, reduction="sum").item()
        count += int((target != -100).sum())
    return float(torch.tensor(nll / count).exp())


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "opt", "gpt2"])
def test_chunked_perplexity_equals_full_logits(model_type, monkeypatch):
    model = make_tiny_model(model_type)
    if model_type == "gemma2":  # soft-capping that bites: random logits are far below the default cap
        model.config.final_logit_softcapping = 0.5
    monkeypatch.setattr(logits_mod, "LOGITS_CHUNK_BYTES", 4 * 512 * 7)  # 7 tokens a chunk: many chunks
    with torch.no_grad():
        expected = full_logits_perplexity(model, _CharTokenizer(), PROTO)
        got = perplexity(model, _CharTokenizer(), PROTO)["perplexity"]
    assert got == pytest.approx(expected, rel=1e-5)


def test_gemma_softcap_is_found_not_assumed():
    """The transform is the one that reproduces the model's own logits: with a soft-cap the
    identity fails and the cap is chosen; without one the identity is."""
    model = make_tiny_model("gemma2")
    inputs = torch.randint(3, 500, (2, 16))
    for cap, expected in ((0.5, "softcap"), (None, "none")):
        model.config.final_logit_softcapping = cap
        with torch.no_grad():
            batch = logits_mod.batch_logits(model, lambda extra: model(input_ids=inputs, **extra))
        assert batch.post.startswith(expected)


class _ScaledHead(torch.nn.Module):
    """A causal LM that multiplies its logits by 3 after the head: nothing in its config says so."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * 3
        return out


def test_unknown_head_falls_back_to_full_logits():
    model = _ScaledHead(make_tiny_model("llama"))
    inputs = torch.randint(3, 500, (2, 16))
    with pytest.warns(UserWarning, match="full logits"), torch.no_grad():
        batch = logits_mod.batch_logits(model, lambda extra: model(input_ids=inputs, **extra))
    assert batch.transform is None and batch.post == "unknown" and batch.full.shape == (2, 16, 512)
    scored = torch.ones(2, 15, dtype=torch.bool)
    chunks = torch.cat(list(batch.scored_chunks(scored)))
    with torch.no_grad():
        expected = model(input_ids=inputs).logits[:, :-1].reshape(-1, 512)
    assert torch.equal(chunks, expected)


def test_chunked_kl_equals_full_logits_kl(monkeypatch):
    ref, noisy = make_tiny_model("llama"), make_tiny_model("llama", seed=1)
    monkeypatch.setattr(logits_mod, "LOGITS_CHUNK_BYTES", 4 * 512 * 5)
    cfg = KLConfig(max_tokens=200)
    with torch.no_grad():
        got = kl_divergence(ref, noisy, _CharTokenizer(), PROTO, cfg)
        protocol, batches = kl_batches(_CharTokenizer(), PROTO, cfg)
        kls = []
        for inputs, mask, labels in batches:
            scored = labels[:, 1:] != -100
            a = ref(input_ids=inputs, attention_mask=mask).logits[:, :-1][scored]
            b = noisy(input_ids=inputs, attention_mask=mask).logits[:, :-1][scored]
            kls.append(token_kl(a, b))
    expected = torch.cat(kls).double()
    assert got["tokens"] == len(expected)
    assert got["kl_mean"] == pytest.approx(expected.mean().item(), rel=1e-4)


PROBE = textwrap.dedent("""
    import json, sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from lowbit.evaluate import logits
    from lowbit.evaluate.config import KLConfig, PerplexityProtocol
    from lowbit.evaluate.kl import kl_divergence
    from lowbit.evaluate.memory import measure_peak
    from lowbit.evaluate.perplexity import perplexity

    class Tok:  # token ids spread over the whole vocabulary
        bos_token_id, eos_token_id = 1, 2
        def __call__(self, text, **kw):
            g = torch.Generator().manual_seed(0)
            return type("E", (), {"input_ids": torch.randint(3, 65536, (1, 4096), generator=g)})()

    if sys.argv[1] == "unbounded":  # the former peak: one chunk holds every scored token
        logits.LOGITS_CHUNK_BYTES = 2**40
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=65536, tie_word_embeddings=True)
    ref, model = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    proto = PerplexityProtocol(context_len=512, stride=512, max_tokens=2048)
    def work():
        with torch.no_grad():
            perplexity(model, Tok(), proto)
            kl_divergence(ref, model, Tok(), proto, KLConfig(max_tokens=2048))
    _, peak = measure_peak(work, torch.device("cpu"))
    print(json.dumps(peak))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable VmHWM")
def test_evaluation_memory_is_bounded_in_a_fresh_process():
    """Perplexity and KL of 4 x 512-token windows at a 65k vocabulary: one batch's full logits are
    4 x 512 x 65536 x 4 bytes = 0.5 GiB, and the former path held several. Chunked, the rise over
    the loaded models stays under 8 chunks plus 64 MiB of activations, and the same probe with one
    unbounded chunk (the control) rises past that bound."""
    def rise(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])["increase_bytes"]

    bound = 8 * logits_mod.LOGITS_CHUNK_BYTES + 64 * 2**20
    chunked, unbounded = rise("chunked"), rise("unbounded")
    assert chunked < bound < unbounded, (chunked, bound, unbounded)
