"""The layer-wise walker: run calibration data through a model one decoder layer at a time.

`walk` captures what the model hands its decoder layers, then for each layer in turn lets a
callback observe (and quantize) it and recomputes the layer's outputs with whatever weights it
now holds, so later layers calibrate on what they will really see. Only the current layer is
moved to the compute device; the rest of the model stays where it is.

Capture runs the model once per micro-batch with every decoder layer's `forward` swapped for a
pass-through and a forward pre-hook recording each layer's keyword arguments (attention mask,
rotary position embeddings, ...); the last layer's hook raises a private exception, so the final
norm and the LM head never run. Keyword arguments are kept per layer because some families pass
layers different ones (Gemma 2/3: sliding-window vs global masks and rotary tables); the tensors
are shared between layers, so this costs little.

Peak memory, with S samples, L tokens each, hidden size d, intermediate size f, micro-batch m
and b bytes per activation (4 for float32):
  hidden states         2·S·L·d·b   (a layer's inputs and its outputs, both held while it runs)
  one micro-batch       ~m·L·(4d + 3f)·b of activations inside the layer, plus attention scores
                        m·heads·L²·b when the attention implementation materialises them (eager)
  per-layer kwargs      small: masks (m·L² booleans, or None when causal and unpadded) and
                        rotary tables (m·L·head_dim·b), shared by the layers
  the model itself      as loaded (only the current layer must sit on the compute device)
smollm2-135m, S=64, L=512, d=576, f=1536, m=8, float32: ~150 MB of hidden states, ~110 MB per
micro-batch, on top of the 540 MB model.

With `forward_dtype` the layer forwards run under autocast (bf16 matmuls; hidden states between
layers keep their dtype). With a `store` (LayerStore) every finished layer is checkpointed and a
resumed walk restores the layers an interrupted one finished instead of recomputing them. Each
layer is loaded from a `source` (calibrate/layer_source.py) when the walk reaches it and let go once
it is finished (and saved): by default the model in memory (MemoryLayers: the layer moved to the
device and back); a streamed run's source reads a skeleton's layers from the shards, so one
layer's weights are resident at a time.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .arch import Arch, decoder_layers
from .experts import recording
from .layer_source import LayerSource, LayerStore, MemoryLayers
from .offload import Offload
from .progress import Progress


class _StopForward(Exception):
    """Raised from a hook to end a forward pass once the needed inputs have been recorded."""


@dataclass
class LayerInputs:
    hidden: list[torch.Tensor]  # one (batch, seq, hidden) tensor per micro-batch
    kwargs: list[dict]  # per micro-batch: what the model passes the current decoder layer
    # per micro-batch (batch, seq) bool, True for real tokens; None where nothing is padded
    token_mask: list[Optional[torch.Tensor]] = field(default_factory=list)
    # per layer, per micro-batch kwargs (layers of one model may get different masks/rotaries)
    layer_kwargs: list[list[dict]] = field(default_factory=list)
    # forwards run under autocast to this dtype (None: as loaded); parameters keep their dtype
    forward_dtype: Optional[torch.dtype] = None

    def use_layer(self, index: int) -> None:
        """Point `kwargs` at what the model passes decoder layer `index`."""
        if self.layer_kwargs:
            self.kwargs = self.layer_kwargs[index]


class WalkResult(list):
    """walk()'s per-layer results; `.hidden` holds the last layer's outputs per micro-batch."""

    hidden: list[torch.Tensor]


def to_device(value, device):
    """Tensors (also inside tuples, lists and dicts) moved to `device`; anything else as is."""
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def _input_device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


@torch.no_grad()
def capture_first_layer_inputs(model, arch: Arch, batches: torch.Tensor, micro_batch: int = 8,
                               attention_mask: Optional[torch.Tensor] = None,
                               device=None, offload: Optional[Offload] = None) -> LayerInputs:
    """Hidden states entering decoder layer 0 and the kwargs each layer receives, per micro-batch.

    batches: (samples, seq_len) token ids; attention_mask (same shape, 1 = real token) marks padding.
    With an offload the hidden states wait where it says (calibrate/offload.py), else on `device`.
    """
    layers = decoder_layers(model, arch)
    inputs = LayerInputs(offload.new() if offload else [], [], [], [[] for _ in layers])
    home = offload.home(device) if offload else device
    records: dict[int, tuple] = {}

    def make_hook(index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            records[index] = (hidden, rest)
            if index == len(layers) - 1:
                raise _StopForward
        return hook

    handles = [layer.register_forward_pre_hook(make_hook(i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    for layer in layers:  # pass-through: only the kwargs of layers after the first are needed
        layer.forward = pass_through
    try:
        for start in range(0, batches.shape[0], micro_batch):
            ids = batches[start : start + micro_batch]
            mask = None if attention_mask is None else attention_mask[start : start + micro_batch]
            records.clear()
            try:
                model(input_ids=ids.to(_input_device(model)),
                      attention_mask=None if mask is None else mask.to(_input_device(model)),
                      use_cache=False)
            except _StopForward:
                pass
            inputs.hidden.append(to_device(records[0][0], home))
            for i in range(len(layers)):
                inputs.layer_kwargs[i].append(to_device(records[i][1], device))
            inputs.token_mask.append(None if mask is None or bool(mask.all()) else mask.bool())
    finally:
        for handle, layer in zip(handles, layers):
            handle.remove()
            del layer.forward  # back to the class's forward
    inputs.use_layer(0)
    return inputs


def pass_through(hidden_states, *args, **kwargs):
    """A decoder layer's forward that hands its input on: set on a layer to skip it."""
    return hidden_states


def first_output(output):
    """The hidden states of a module's output (decoder layers and attention return tuples)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def forward_context(inputs: LayerInputs, device=None):
    """Autocast to inputs.forward_dtype for the layer's forwards (bf16 matmuls run ~2x faster
    than fp32 on CPUs with AVX512-BF16/AMX, ~5x slower where torch emulates bf16: callers pick
    the dtype from hardware.cpu_info().bf16_native), or nothing when it is None."""
    if inputs.forward_dtype in (None, torch.float32):
        return contextlib.nullcontext()
    device_type = torch.device(device).type if device is not None else inputs.hidden[0].device.type
    return torch.autocast(device_type, dtype=inputs.forward_dtype)


@torch.no_grad()
def layer_forward(layer: nn.Module, inputs: LayerInputs, device=None, into=None) -> list[torch.Tensor]:
    """The layer's outputs per micro-batch, computed with the weights it holds now, where the inputs
    wait (appended to `into`, an offload container, when given; else a new list)."""
    outputs = [] if into is None else into
    with forward_context(inputs, device):
        for hidden, kwargs in zip(inputs.hidden, inputs.kwargs):
            out = first_output(layer(to_device(hidden, device), **to_device(kwargs, device)))
            outputs.append(out.to(hidden.device, hidden.dtype))
    return outputs


@torch.no_grad()
def record_linear_inputs(layer: nn.Module, names: list[str], inputs: LayerInputs, device,
                         fn: Callable[[str, torch.Tensor], None], outputs: Optional[list] = None) -> None:
    """Run the layer, calling fn(name, x2d) with each named linear's input (tokens, in_features).

    Padded tokens are left out. Linears that receive the same tensor in one forward (q/k/v,
    gate/up) are handed the same x2d object, so a caller can accumulate statistics once. The
    forward stops as soon as every named linear has been seen. A routed expert may see no token
    (calibrate/experts.py: its linears get unpadded tokens already, and fn is never called for it).
    Given `outputs` (a list, or an offload container), the forward runs to the end and the layer's
    output per micro-batch is appended to it, as layer_forward's: one forward serves both.
    """
    modules = {n: layer.get_submodule(n) for n in names}
    routed = {n for n, m in modules.items() if getattr(m, "inputs_masked", False)}
    wanted = set(names)
    for hidden, kwargs, mask in zip(inputs.hidden, inputs.kwargs, _masks(inputs)):
        seen: set[str] = set()
        flat = WhileAlive()  # x -> x2d, each dropped with its x: an expert's down input goes once it has run

        def make_hook(name: str):
            as_given = mask is None or name in routed

            def hook(module, args):
                x = args[0]
                x2d = flat.get(x)
                if x2d is None:
                    x2d = x if x.dim() == 2 and as_given else x.reshape(-1, x.shape[-1])
                    x2d = x2d if as_given else x2d[mask.reshape(-1).to(x.device)]
                    flat.put(x, x2d)
                fn(name, x2d)
                seen.add(name)
                if seen >= wanted and outputs is None:
                    raise _StopForward
            return hook

        handles = [modules[n].register_forward_pre_hook(make_hook(n)) for n in names]
        try:
            with forward_context(inputs, device), recording(mask):
                out = layer(to_device(hidden, device), **to_device(kwargs, device))
            if outputs is not None:
                outputs.append(first_output(out).to(hidden.device, hidden.dtype))
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if not wanted - routed <= seen:
            raise RuntimeError(f"linears {sorted(wanted - routed - seen)} were never called in the layer's "
                               "forward; check the architecture table's group names")


class WhileAlive:
    """A mapping from tensors, by identity, whose entries go when their tensor does: it holds no
    tensor alive (a forward's inputs to each of 128 experts' down projections held until the
    forward ends took 0.8 GB at Qwen3-30B-A3B widths), and a freed tensor's reused id never finds
    the old entry. A value that is its key is held weakly too."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}  # id(key) -> (weakref to key, value or None: the key itself)

    def get(self, key: torch.Tensor):
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            return None
        return key if entry[1] is None else entry[1]

    def put(self, key: torch.Tensor, value) -> None:
        ident = id(key)

        def drop(ref):
            if self._entries.get(ident, (None,))[0] is ref:
                del self._entries[ident]

        self._entries[ident] = (weakref.ref(key, drop), None if value is key else value)


def _masks(inputs: LayerInputs) -> list[Optional[torch.Tensor]]:
    return inputs.token_mask or [None] * len(inputs.hidden)


@torch.no_grad()
def walk(model, arch: Arch, batches: torch.Tensor, on_layer, device=None, label: str = "walk",
         micro_batch: int = 8, attention_mask: Optional[torch.Tensor] = None,
         forward_dtype: Optional[torch.dtype] = None, final_outputs: bool = True,
         store: Optional["LayerStore"] = None, source: Optional[LayerSource] = None,
         offload: Optional[Offload] = None) -> WalkResult:
    """Layer by layer: result_i = on_layer(i, name, layer, inputs), then the layer's new outputs
    become the next layer's inputs. Returns the results (and, with final_outputs, the final
    hidden states; without, the last layer's outputs are never computed). With a store, each
    finished layer is saved, and layers an interrupted run finished are restored, not redone.
    Each layer is loaded from the source when reached and unloaded when done. With an
    offload, the activations between layers wait where it says (device, cpu or disk)."""
    source = source or MemoryLayers(model, arch)
    if device is None:  # where the model's inputs are; a skeleton's (on meta): the CPU
        device = _input_device(model)
        device = torch.device("cpu") if device.type == "meta" else device
    device = torch.device(device)
    with source.outer(device, tokens=batches):
        inputs = capture_first_layer_inputs(model, arch, batches, micro_batch, attention_mask, device, offload)
    inputs.forward_dtype = forward_dtype
    layers = decoder_layers(model, arch)
    progress = Progress(label, len(layers))
    results = WalkResult()
    for i, layer in enumerate(layers):
        prefix = f"{arch.layers}.{i}"
        source.load(i, prefix, layer, device)
        inputs.use_layer(i)
        restored = store.restore(i, prefix, layer) if store is not None else None
        if restored is not None:  # finished by an earlier, interrupted run
            result, hidden = restored
            if hidden is not None:
                inputs.hidden = offload.keep(hidden, device) if offload else hidden
            elif store.outputs_lost and (final_outputs or i < len(layers) - 1):  # saved ones failed their check
                inputs.hidden = layer_forward(layer, inputs, device, offload.new() if offload else None)
        else:
            result = on_layer(i, prefix, layer, inputs)
            computed = final_outputs or i < len(layers) - 1
            if computed:
                inputs.hidden = layer_forward(layer, inputs, device, offload.new() if offload else None)
            if store is not None:
                store.save(i, prefix, layer, result, inputs.hidden if computed else None)
        results.append(result)
        source.unload(i, prefix, layer)
        progress.step()
    results.hidden = inputs.hidden
    return results
