"""Perplexity of a model that does not fit in memory: every window passes one decoder layer at a
time, each layer read from the safetensors shards and dropped after (calibrate/streaming.py).

Same protocol, same windows, same batches of WINDOWS_PER_BATCH and the same kernels as the resident
`perplexity`, so the figure is the same (the tests compare them); only the order of work changes:
all batches through layer 0, then all through layer 1, and so on. The walk (StreamedHidden: the
final hidden states of every window, then logits one batch at a time) serves kl_streamed.py too.

Memory, with T tokens evaluated (max_tokens, plus a BOS per window), hidden size d, b bytes per
value of the compute dtype: the hidden states of every window, T·d·b (Llama-3-8B, 16384 tokens,
float32: 0.27 GB), one decoder layer's weights (8B: 0.87 GB in float32), and, while the windows
enter the layers, the token embedding, while they leave, the final norm and LM head with one
batch's final hidden states and a chunk of logits (evaluate/logits.py: LOGITS_CHUNK_BYTES).
Llama-3-8B: one 128k x 4096 matrix, 2.1 GB in float32, whatever the depth; resident, the whole
model, 32 GB in float32. Time: each layer's weights are read once.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from lowbit.calibrate.arch import arch_for, decoder_layers
from lowbit.calibrate.progress import Progress
from lowbit.calibrate.streaming import ShardedWeights, buffers_to, empty_model, materialize, outer_modules, release
from lowbit.calibrate.walker import LayerInputs, capture_first_layer_inputs, layer_forward, pass_through

from .config import PerplexityProtocol
from .logits import BatchLogits, batch_logits
from .perplexity import bos_id, eval_tokens, scored_nll, summary, window_batches, windows


@torch.no_grad()
def streamed_perplexity(path, tokenizer, protocol: PerplexityProtocol, device=None,
                        dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> dict:
    """`perplexity` of the model in folder `path` without ever holding more than one decoder layer."""
    ids = eval_tokens(tokenizer, protocol)
    prefix = [bos_id(tokenizer)] if protocol.bos else []
    spans = windows(len(ids), protocol)
    batches = list(window_batches(ids, prefix, spans))
    streamed = StreamedHidden(path, batches, device, dtype, trust_remote_code, "perplexity (streamed)")
    nll, count = 0.0, 0
    with streamed.head() as batches_logits:
        for logits, (_, _, labels) in zip(batches_logits, batches):
            batch_nll, batch_count = scored_nll(logits, labels)
            nll, count = nll + batch_nll, count + batch_count
    return summary(nll, count, spans, prefix, protocol)


class StreamedHidden:
    """The final hidden states (before the final norm) of every batch of windows of the model in
    folder `path`, computed one decoder layer at a time; `head()` turns them into logits one batch
    at a time with only the final norm and LM head resident. Streamed perplexity and KL share it."""

    def __init__(self, path, batches, device=None, dtype: torch.dtype = torch.float32,
                 trust_remote_code: bool = False, label: str = "streamed"):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype, self.batches = dtype, batches
        self.model = empty_model(path, dtype, trust_remote_code)
        buffers_to(self.model, self.device)
        self.weights = ShardedWeights(path, self.model)
        arch = arch_for(self.model)
        self.outer = outer_modules(self.model, arch.layers)
        head = self.model.get_output_embeddings()
        with resident(self.model, [(n, m) for n, m in self.outer if m is not head], self.weights, dtype, self.device):
            inputs = capture(self.model, arch, batches, self.device)
        self.layers = decoder_layers(self.model, arch)
        progress = Progress(label, len(self.layers), "layers")
        for index, layer in enumerate(self.layers):
            materialize(self.model, layer, f"{arch.layers}.{index}", self.weights, dtype, self.device)
            inputs.use_layer(index)
            inputs.hidden = layer_forward(layer, inputs, self.device)
            release(self.model, layer)
            progress.step()
        self.hidden = inputs.hidden  # one (windows, width, hidden) tensor per batch

    @contextmanager
    def head(self):
        """Inside the block, an iterator of each batch's BatchLogits (computed as it is drawn, so one
        batch's final hidden states exist at a time, its logits drawn a chunk of tokens at a time);
        the final norm and head hold weights only inside it."""
        embedding = self.model.get_input_embeddings()
        outer = [(n, m) for n, m in self.outer if m is not embedding]
        with resident(self.model, outer, self.weights, self.dtype, self.device):
            yield (head_logits(self.model, self.layers, hidden, mask, self.device)
                   for hidden, (_, mask, _) in zip(self.hidden, self.batches))


@contextmanager
def resident(model, modules, weights: ShardedWeights, dtype, device):
    """The given (name, module) pairs hold their weights inside the block, and not after it."""
    for name, module in modules:
        materialize(model, module, name, weights, dtype, device)
    try:
        yield
    finally:
        for _, module in modules:
            release(model, module)


def capture(model, arch, batches, device) -> LayerInputs:
    """What the model hands decoder layer 0 (and each layer's kwargs), one micro-batch per batch of
    windows (batches may differ in width, so each is captured on its own)."""
    merged = None
    for window_ids, mask, _ in batches:
        one = capture_first_layer_inputs(model, arch, window_ids, micro_batch=len(window_ids),
                                         attention_mask=mask, device=device)
        if merged is None:
            merged = one
            continue
        merged.hidden += one.hidden
        merged.token_mask += one.token_mask
        for kept, new in zip(merged.layer_kwargs, one.layer_kwargs):
            kept += new
    return merged


def head_logits(model, layers, hidden, mask, device) -> BatchLogits:
    """The model's own forward from the last layer's outputs on (final norm, LM head, any logit
    soft-capping): the first layer hands back `hidden`, every other one passes it on. The token
    embedding is not needed: zeros of its shape stand in for it, as the layers ignore them."""
    layers[0].forward = lambda *args, **kwargs: hidden
    for layer in layers[1:]:
        layer.forward = pass_through
    try:
        return batch_logits(model, lambda extra: model(inputs_embeds=torch.zeros_like(hidden),
                                                       attention_mask=mask.to(device), use_cache=False, **extra),
                            "streamed reference")
    finally:
        for layer in layers:
            del layer.forward
