"""Models that are never resident: a skeleton without weights, and each module's tensors read from
the safetensors shards when the walk reaches it, dropped when it moves on.

`empty_model` builds the model from its config with every parameter on the meta device (buffers,
such as rotary tables, are computed as usual: they are small and not stored in checkpoints).
`ShardedWeights` maps tensor names to the shard that holds them (model.safetensors, or the
shards an index lists) and reads the tensors a module needs in the dtype asked, each shard
opened only while they are read (safetensors only: nothing is unpickled).
`materialize(module, prefix, weights)` gives a module its tensors; `release(module)` puts them
back on meta. Tied parameters (a tied LM head is the token embedding) follow: every name a
parameter has in the model is bound to the one tensor read for it.

Memory: one decoder layer in the compute dtype (Llama-3-8B: 218M parameters, 0.87 GB in
float32, 0.44 GB in bf16) plus what the caller keeps between layers, instead of the whole model
(8B: 32 GB in float32).
"""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .checks import SAFE_INDEX, check_tensors_match, read_index, safetensors_files
from .experts import (FUSED_TENSORS, PROJECTIONS, ExpertLinears, FusedLayout, expert_slices, module_name,
                      unfuse_experts)
from .hardware import return_freed_memory

# tensors older checkpoints store that models now compute (transformers skips them on load too)
LEGACY_TENSORS = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


class ShardedWeights:
    """The tensors of a safetensors checkpoint folder, read on demand."""

    def __init__(self, folder: str | Path, model: Optional[nn.Module] = None):
        self.folder = Path(folder)
        # tensors go by the names lowbit's modules hold (a Mixtral's stored `block_sparse_moe.experts.3.w1`
        # is `mlp.experts.3.gate_proj`: calibrate/experts.py)
        stored, model_type = self._tensor_shards(), stored_model_type(self.folder)
        self.stored_as = {module_name(model_type, n): n for n in stored}
        self.shard_of = {n: stored[s] for n, s in self.stored_as.items()}
        # where `model` (a skeleton with split experts) reads experts the folder stores fused (gpt-oss,
        # Llama 4): each per-expert parameter -> (experts module, expert, projection index, kind)
        self.expert_parts = fused_expert_parts(model, self.shard_of) if model is not None else {}

    def _tensor_shards(self) -> dict[str, str]:
        """Tensor name -> file, from the index where there is one, else from each file's header."""
        files = safetensors_files(self.folder)  # an index's shards, each checked to exist
        if not files:
            raise FileNotFoundError(f"{self.folder}: streaming reads safetensors weights, and there is "
                                    f"neither model.safetensors nor {SAFE_INDEX}")
        if (self.folder / SAFE_INDEX).is_file():
            return dict(read_index(self.folder))
        shard_of = {}
        for path in files:
            with open_shard(path) as handle:
                shard_of.update({name: path.name for name in handle.keys()})
        return shard_of

    def numel(self) -> int:
        """Elements of all tensors, from the shards' headers (nothing is read)."""
        return sum(math.prod(shape) for shape in self.shapes().values())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape, from the shards' headers (nothing is read); fused experts read per
        expert by their per-expert names."""
        shapes, module_of = {}, {stored: name for name, stored in self.stored_as.items()}
        for shard in sorted(set(self.shard_of.values())):
            with open_shard(self.folder / shard) as handle:
                shapes.update({module_of.get(name, name): tuple(handle.get_slice(name).get_shape())
                               for name in handle.keys()})
        fused = {f"{part.module}.{k}": None for part in self.expert_parts.values() for k in FUSED_TENSORS}
        metas = {k: torch.empty(shapes[k], device="meta") for k in fused if k in shapes}
        for name, part in self.expert_parts.items():
            shapes[name] = tuple(part.cut({k.rpartition(".")[2]: t for k, t in metas.items()
                                           if k.startswith(part.module + ".")}, 0).shape)
        return {k: v for k, v in shapes.items() if k not in fused}

    def __contains__(self, name: str) -> bool:
        return name in self.shard_of or name in self.expert_parts

    def load(self, names: list[str], dtype: Optional[torch.dtype] = None, device=None) -> dict[str, torch.Tensor]:
        """The named tensors, their shard opened for each and closed after: a mapping kept open keeps
        every page read through it resident (a Llama-3-8B layer's 0.44 GB of bf16 pages beside its
        0.87 GB in float32: 1.44 against 1.05 GiB peak for one layer's load), and a header costs
        little to parse again."""
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"{self.folder}: no tensor {missing[0]!r} in its safetensors files "
                           f"({len(self.shard_of)} tensors, e.g. {next(iter(self.shard_of), '-')!r})")
        tensors = {}
        for name in names:
            if name in self.expert_parts:
                tensors[name] = _cast(self._expert_part(self.expert_parts[name]), dtype, device)
                continue
            with open_shard(self.folder / self.shard_of[name]) as handle:
                tensors[name] = _cast(handle.get_tensor(self.stored_as[name]), dtype, device)
        return tensors

    def _expert_part(self, part: "ExpertPart") -> torch.Tensor:
        """One expert's projection weight or bias, read from that expert's slice of the one fused
        tensor holding it."""
        name = f"{part.module}.{part.fused}"
        with open_shard(self.folder / self.shard_of[name]) as handle:
            expert = handle.get_slice(self.stored_as[name])[part.expert:part.expert + 1]
        return part.cut({part.fused: expert}, 0).contiguous()

    def load_rows(self, name: str, rows: list[int], dtype: Optional[torch.dtype] = None, device=None) -> torch.Tensor:
        """Rows `rows` (ascending, distinct) of the tensor `name`, each run of consecutive rows read
        as one slice: nothing else of the tensor is read."""
        runs, start = [], 0
        for k in range(1, len(rows) + 1):
            if k == len(rows) or rows[k] != rows[k - 1] + 1:
                runs.append((rows[start], rows[k - 1] + 1))
                start = k
        with open_shard(self.folder / self.shard_of[name]) as handle:
            whole = handle.get_slice(self.stored_as[name])
            return torch.cat([_cast(whole[a:b], dtype, device) for a, b in runs])


@dataclass(frozen=True)
class ExpertPart:
    """A per-expert parameter cut from an experts module's fused tensors."""

    module: str  # the experts module (`model.layers.3.mlp.experts`)
    expert: int
    projection: int  # 0 gate, 1 up, 2 down
    bias: bool
    layout: FusedLayout

    @property
    def fused(self) -> str:
        """The fused tensor (a FUSED_TENSORS name) this part is cut from."""
        return ("down_proj" if self.projection == 2 else "gate_up_proj") + ("_bias" if self.bias else "")

    def cut(self, fused: dict, expert: int) -> torch.Tensor:
        """This part of expert `expert` of the fused tensors `fused` (FUSED_TENSORS names)."""
        return expert_slices(fused, expert, self.layout)[self.projection][int(self.bias)]


def fused_expert_parts(model: nn.Module, stored: dict) -> dict[str, ExpertPart]:
    """Per-expert parameter name -> its part, for each experts module of `model` stored fused."""
    parts = {}
    for name, module in model.named_modules():
        if isinstance(module, ExpertLinears) and f"{name}.gate_up_proj" in stored:
            for e, expert in enumerate(module):
                for p, projection in enumerate(PROJECTIONS):
                    for kind, _ in getattr(expert, projection).named_parameters():
                        parts[f"{name}.{e}.{projection}.{kind}"] = ExpertPart(name, e, p, kind == "bias", module.layout)
    return parts


def stored_model_type(folder: Path) -> Optional[str]:
    """config.json's model_type, where the folder has a readable one."""
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


@contextmanager
def open_shard(path: Path):
    """safe_open of one shard; a damaged file is an error that names it."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise ValueError(f"{path}: unreadable or truncated safetensors file ({err})") from None
    with handle:
        yield handle


def _cast(tensor: torch.Tensor, dtype: Optional[torch.dtype], device) -> torch.Tensor:
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor if device is None else tensor.to(device)


def empty_model(path: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """The causal LM of the folder's config with its parameters on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    unfuse_experts(model)  # per-expert linears, as the resident model holds them
    model.tie_weights()  # not done on meta parameters; the streamed model must share them as loaded
    if (Path(path) / "generation_config.json").is_file():  # from_pretrained reads it; from_config does not
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def check_weights_match(model: nn.Module, weights: ShardedWeights) -> None:
    """Before any calibration: every parameter of the skeleton is stored under one of its names
    (a tied head needs none of its own) with the skeleton's shape, and the shards hold nothing the
    model has no place for; else one line names them (a missing one would stop the walk hours in)."""
    stored = weights.shapes()
    names_of: dict[int, tuple[nn.Parameter, list[str]]] = {}  # a tied parameter once, with all its names
    for full, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), (param, []))[1].append(full)
    missing, mismatched = [], []
    for param, names in names_of.values():
        name = next((n for n in names if n in stored), None)
        if name is None:
            missing.append(names[0])
        elif stored[name] != tuple(param.shape):
            mismatched.append((name, stored[name], tuple(param.shape)))
    known = set(model.state_dict(keep_vars=True))  # persistent buffers too; non-persistent ones are computed
    ignored = re.compile("|".join([*(model._keys_to_ignore_on_load_unexpected or []), *LEGACY_TENSORS]))
    unexpected = [n for n in stored if n not in known and not ignored.search(n)]
    check_tensors_match(weights.folder, missing, unexpected, mismatched, _conversion_advice(model))


def _conversion_advice(model: nn.Module) -> str:
    """Why a checkpoint transformers loads may still not stream: transformers converts some models'
    stored tensors on load (per-expert MoE weights into fused 3-D ones), a streamed run reads them as stored."""
    from transformers.conversion_mapping import extract_weight_conversions_for_model

    if not extract_weight_conversions_for_model(model):
        return ""
    return (f"transformers converts {model.config.model_type!r} checkpoints' tensors on load and a streamed run "
            "reads them as stored: run it resident (calibration.streaming: false)")


def buffers_to(model: nn.Module, device) -> None:
    """Move the skeleton's buffers (rotary tables and the like, computed, never streamed) to device;
    those of released modules (on meta) stay there."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                module._buffers[name] = buffer.to(device)


def parameter_names(model: nn.Module, module: nn.Module, prefix: str) -> list[tuple[nn.Parameter, list[str]]]:
    """Each parameter of `module` with every full name the model gives that parameter object; the
    first is prefix + its name in `module`, the others are ties."""
    aliases: dict[int, list[str]] = {}
    for full, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(full)
    named = []
    for rel, param in module.named_parameters(remove_duplicate=False):
        own = f"{prefix}.{rel}" if prefix else rel
        named.append((param, [own] + [n for n in aliases.get(id(param), []) if n != own]))
    return named


def materialize(model: nn.Module, module: nn.Module, prefix: str, weights: ShardedWeights,
                dtype: torch.dtype, device=None, skip: frozenset = frozenset()) -> None:
    """Read `module`'s parameters (it sits at `prefix` in `model`) from `weights` onto `device`, but
    those named in `skip` (relative to `module`), which stay on meta. A parameter stored under none
    of its names (a tied head saved once) is an error that names it."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    wanted: dict[int, tuple[nn.Parameter, str]] = {}  # id(meta parameter) -> (it, the name it is stored as)
    skipped = {f"{prefix}.{n}" if prefix else n for n in skip}
    for param, names in parameter_names(model, module, prefix):
        if names[0] in skipped:
            continue
        if param.is_meta and id(param) not in wanted:  # not resident already through a tie
            stored = next((n for n in names if n in weights), None)
            if stored is None:
                raise KeyError(f"{weights.folder}: parameter {names[0]} (tied as {names[1:]}) is in none of "
                               f"its safetensors files")
            wanted[id(param)] = (param, stored)
    tensors = weights.load([stored for _, stored in wanted.values()], dtype, device)
    _replace(model, {key: (param, nn.Parameter(tensors[stored], requires_grad=False))
                     for key, (param, stored) in wanted.items()})


def release(model: nn.Module, module: nn.Module) -> None:
    """Put `module`'s parameters back on the meta device (and every tie of them)."""
    _replace(model, {id(p): (p, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))
                     for p in module.parameters()})


def release_all(model: nn.Module, module: nn.Module) -> None:
    """Put `module`'s parameters and persistent buffers (a quantized linear's codes and scales)
    on the meta device; the modules stay, so the skeleton keeps the structure a run left."""
    release(model, module)
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                sub._buffers[name] = buffer.to("meta")
    return_freed_memory()  # else the allocator keeps much of it for the next layer to stack on


def _replace(model: nn.Module, replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Swap each old parameter for its new one under every name the model gives it, so ties hold.
    The old parameters are held by `replaced`, so no new object can have taken one of their ids."""
    for full, param in list(model.named_parameters(remove_duplicate=False)):
        old_new = replaced.get(id(param))
        if old_new is not None and old_new[0] is param:
            owner, leaf = _owner(model, full)
            owner._parameters[leaf] = old_new[1]


def _owner(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    path, _, leaf = dotted.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def outer_modules(model: nn.Module, layers_path: str) -> list[tuple[str, nn.Module]]:
    """The modules outside the decoder layers that hold state-dict entries directly (embeddings,
    final norm, LM head, ...), with their names."""
    inside = layers_path + "."
    return [(name, module) for name, module in model.named_modules()
            if not name.startswith(inside) and name != layers_path and holds_state(module)]


def holds_state(module: nn.Module) -> bool:
    """Parameters, or persistent buffers, of its own: a quantized LM head holds its codes and scales
    as buffers; RoPE's inv_freq is not persistent and belongs to no checkpoint."""
    return (any(p is not None for p in module._parameters.values())
            or any(b is not None and n not in module._non_persistent_buffers_set for n, b in module._buffers.items()))


def is_resident(module: nn.Module) -> bool:
    return any(not p.is_meta for p in module.parameters())


@contextmanager
def embedding_rows(model: nn.Module, embedding: nn.Module, weights: ShardedWeights, tokens: torch.Tensor,
                   dtype: torch.dtype, device=None):
    """The input embedding for an input capture, holding only the rows of `tokens`: a compact table
    of those rows, and a forward pre-hook that maps each id to its row there, so every lookup gives
    the full table's values. Llama-3-8B's 128k-row table is 2.1 GB in float32 (70B: 4.2 GB); the
    rows 8 × 512 calibration tokens use are at most 64 MB. Any other kind of module is read whole."""
    prefix = next(name for name, module in model.named_modules() if module is embedding)
    if not isinstance(embedding, nn.Embedding):
        materialize(model, embedding, prefix, weights, dtype, device)
        try:
            yield
        finally:
            release_all(model, embedding)
        return
    (_, names), = parameter_names(model, embedding, prefix)
    stored = next((n for n in names if n in weights), None)
    if stored is None:
        raise KeyError(f"{weights.folder}: parameter {names[0]} (tied as {names[1:]}) is in none of its "
                       "safetensors files")
    used = torch.unique(tokens)  # ascending
    compact = weights.load_rows(stored, used.tolist(), dtype, device)
    used = used.to(compact.device)
    meta = embedding.weight
    embedding.weight = nn.Parameter(compact, requires_grad=False)  # this module only: a tied head keeps meta
    hook = embedding.register_forward_pre_hook(lambda module, args: (torch.searchsorted(used, args[0]), *args[1:]))
    try:
        yield
    finally:
        hook.remove()
        embedding.weight = meta
        del compact
        return_freed_memory()
