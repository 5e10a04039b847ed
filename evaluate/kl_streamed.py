"""KL of a model against a reference that does not fit in memory: the reference's windows pass one
decoder layer at a time (perplexity_streamed.StreamedHidden), keeping only the final hidden states;
then, with only its final norm and LM head resident, each batch's reference logits are computed and
compared with the evaluated model's logits for the same batch (kl.compare_batches), so neither
model's logits for all windows are ever held. Same windows, batches and kernels as the resident
`kl_divergence`, so the same figures (the tests compare them).

Memory, with the evaluated model resident (its weights W), T tokens evaluated (kl.max_tokens plus
a BOS per window), hidden size d, vocabulary V, b bytes per value of the compute dtype, batches of
B = WINDOWS_PER_BATCH windows of L = context_len tokens: W, plus T·d·b of reference hidden states,
plus the larger of one reference decoder layer (while the windows pass the layers) and its final
norm and head, V·d·b, with one batch's comparison (while they leave): both models' final hidden
states of one batch and their logits a chunk of tokens at a time (evaluate/logits.py: at most
8 x LOGITS_CHUNK_BYTES), as resident KL too. Llama-3-8B (d 4096, V 128256, float32, 4096 tokens in
9 windows of 512): hidden states 0.07 GB, a layer 0.87 GB, the head 2.1 GB and 0.27 GB of logit
chunks at the peak, about 2.4 GB beside W, whatever the depth; a resident reference adds its
32 GB in float32 instead. Time: each reference layer's weights are read once; the evaluated model
runs once per batch, as resident.
"""
from __future__ import annotations

import torch

from .config import KLConfig, PerplexityProtocol
from .kl import compare_batches, kl_batches
from .perplexity_streamed import StreamedHidden


@torch.no_grad()
def streamed_kl_divergence(reference_path, model, tokenizer, protocol: PerplexityProtocol, cfg: KLConfig,
                           device=None, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> dict:
    """`kl_divergence` of `model` against the reference in folder `reference_path`, which is never
    loaded: at most one of its decoder layers, or its head, holds weights at a time."""
    protocol, batches = kl_batches(tokenizer, protocol, cfg)
    streamed = StreamedHidden(reference_path, batches, device, dtype, trust_remote_code, "KL reference (streamed)")
    with streamed.head() as ref_logits:
        return compare_batches(ref_logits, model, batches, protocol)
