"""Calibration across processes (torch.distributed): the process group torchrun describes in its
environment, each rank's share of the calibration samples, and the few collectives the steps use.

In one process (no WORLD_SIZE, or 1) there is no group and every helper hands its input back
unchanged, so a step has one code path and a single-process run stays bit for bit what it was.
Under torchrun every rank loads the model, calibrates its share of the samples and takes part in
every collective in the same order; statistics are reduced where they are accumulated (sums and
counts, never averages of averages), so every rank takes the same decisions and holds the same
model. gloo on CPU; with a GPU per rank, NCCL for the statistics kept on it (tensors cross on
the backend's device).

A collective that fails (a peer raised and left, or was killed) raises PeerFailure naming this
rank; every collective, init included, gives up after LOWBIT_DIST_TIMEOUT seconds (1800).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

TIMEOUT_ENV = "LOWBIT_DIST_TIMEOUT"
# samples are shared in whole micro-batches of the walker's default size (that of awq and
# smoothquant, whose per-micro-batch figures then match one process's; Hessians are token sums)
SHARE_UNIT = 8
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class PeerFailure(RuntimeError):
    """A collective failed: another rank stopped (its own error names it) or the group timed out."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size}"


def world() -> World:
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def launched_size() -> int:
    """The WORLD_SIZE torchrun set (1 when not launched by it)."""
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"WORLD_SIZE must be a positive integer, got {value!r}")
    return int(value)


def init_from_env() -> World:
    """Join the group torchrun's environment describes (nothing when WORLD_SIZE is 1 or unset)."""
    if launched_size() == 1 or dist.is_initialized():
        return world()
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but {', '.join(missing)} "
                         "is not set: launch with torchrun (or lowbit run --nproc N)")
    backend = group_backend(gpus_here(), local_world_size())
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s()))
    return world()


def group_backend(gpus: int, ranks_here: int) -> str:
    """NCCL where every rank on this machine has a GPU of its own (cuda:LOCAL_RANK): the collectives
    then run there (backend_device), so statistics kept on the GPUs never cross to the CPU; gloo
    otherwise. All ranks decide alike: a group whose ranks named different backends would hang."""
    return "cpu:gloo,cuda:nccl" if 0 < ranks_here <= gpus else "gloo"


def gpus_here() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_world_size() -> int:
    """Ranks on this machine (torchrun's LOCAL_WORLD_SIZE; the whole group when it is not set)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV, "1800")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return seconds


def close() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def sample_share(samples: int, unit: int, w: Optional[World] = None) -> slice:
    """This rank's contiguous share of `samples`, in whole micro-batches of `unit` (so each rank's
    micro-batches are those one process would form: per-micro-batch figures agree). The shares of
    all ranks cover every sample exactly once."""
    w = w or world()
    units = -(-samples // unit)
    if units < w.size:
        raise ValueError(f"calibration.samples={samples} makes {units} micro-batches of {unit}, fewer than "
                         f"the {w.size} ranks: use at least {w.size * unit} samples or at most {units} processes")
    return slice(min(samples, w.rank * units // w.size * unit), min(samples, (w.rank + 1) * units // w.size * unit))


def backend_device(backend: str) -> torch.device:
    """Where every collective runs: this rank's GPU when the group has NCCL, else the CPU (gloo).
    Never the tensor's own device: a rank that sends a GPU tensor and a rank that receives into a
    CPU one must meet on the same backend, or both wait forever."""
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def _collective(name: str, fn, tensor: torch.Tensor) -> torch.Tensor:
    """fn(t) on a copy of `tensor` on the backend's device; the result back where tensor was."""
    t = tensor.detach().to(backend_device(str(dist.get_backend()))).contiguous().clone()
    try:
        fn(t)
    except (RuntimeError, dist.DistError) as err:
        raise PeerFailure(f"{name} across ranks failed; another rank has stopped "
                          f"(its error is printed above) or the group timed out ({TIMEOUT_ENV}={timeout_s():g}s): "
                          f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
    return t.to(tensor.device)


def _reduce(name: str, tensor: torch.Tensor, op) -> torch.Tensor:
    if world().size == 1:
        return tensor
    return _collective(name, lambda t: dist.all_reduce(t, op=op), tensor)


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    return _reduce("sum", tensor, dist.ReduceOp.SUM)


def all_max(tensor: torch.Tensor) -> torch.Tensor:
    return _reduce("max", tensor, dist.ReduceOp.MAX)


def all_min(tensor: torch.Tensor) -> torch.Tensor:
    return _reduce("min", tensor, dist.ReduceOp.MIN)


def ranks_agree(tensors) -> bool:
    """Whether every rank holds the same values in `tensors` (always, in one process)."""
    if world().size == 1:
        return True
    flat = torch.cat([t.detach().flatten() for t in tensors])
    return torch.equal(all_max(flat.clone()), all_min(flat.clone()))


def sum_numbers(*values: float) -> list[float]:
    """Python numbers summed across ranks (float64); in one process, the values as they are."""
    if world().size == 1:
        return list(values)
    return all_sum(torch.tensor(values, dtype=torch.float64)).tolist()


def sum_int(value: int) -> int:
    return value if world().size == 1 else int(sum_numbers(value)[0])


def count_before(value: int) -> int:
    """Sum of `value` over the ranks before this one (e.g. tokens held by earlier ranks)."""
    w = world()
    if w.size == 1:
        return 0
    counts = torch.zeros(w.size, dtype=torch.float64)
    counts[w.rank] = value
    return int(all_sum(counts)[: w.rank].sum())


def mean_rows(x: torch.Tensor) -> torch.Tensor:
    """(channels,) mean over the rows of x (rows, channels) held by all ranks together: summed in
    float64 in one process too, so that 1 and N ranks round to the same mean."""
    total = all_sum(torch.cat([x.double().sum(dim=0), torch.tensor([x.shape[0]], dtype=torch.float64)]))
    return (total[:-1] / total[-1].clamp(min=1)).to(x.dtype)


def mean_of(t: torch.Tensor) -> float:
    """Mean of all elements of t over all ranks' pieces (a rank's may be empty), summed in float64
    in one process too (as mean_rows)."""
    total, count = sum_numbers(t.double().sum().item(), t.numel())
    return total / max(count, 1)


def broadcast_tensor(tensor: Optional[torch.Tensor], src: int) -> torch.Tensor:
    """src's tensor on every rank (the others pass None: shape and dtype travel with it)."""
    header = broadcast_json(None if tensor is None else {"dtype": str(tensor.dtype).removeprefix("torch."),
                                                         "shape": list(tensor.shape)}, src)
    if world().rank != src:
        tensor = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]))
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:  # float8: gloo has no such type
        return _collective("broadcast", lambda t: dist.broadcast(t, src), tensor.view(torch.uint8)).view(tensor.dtype)
    return _collective("broadcast", lambda t: dist.broadcast(t, src), tensor)


def broadcast_json(value, src: int):
    """A JSON value of rank src on every rank (no pickle: its UTF-8 bytes travel as a tensor)."""
    if world().size == 1:
        return value
    data = json.dumps(value).encode() if world().rank == src else b""
    length = int(_collective("broadcast", lambda t: dist.broadcast(t, src), torch.tensor([len(data)]))[0])
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(length, dtype=torch.uint8)
    return json.loads(bytes(_collective("broadcast", lambda t: dist.broadcast(t, src), buf).tolist()).decode())


def broadcast_tree(value, src: int):
    """src's value on every rank: tensors, numbers, strings, None, lists, tuples, dicts and
    dataclasses of lowbit's own (rebuilt from their fields), nested. In one process, the value."""
    if world().size == 1:
        return value
    tensors: list[torch.Tensor] = []
    skeleton = broadcast_json(_encode(value, tensors) if world().rank == src else None, src)
    count = broadcast_json(len(tensors), src)
    received = [broadcast_tensor(tensors[i] if world().rank == src else None, src) for i in range(count)]
    return value if world().rank == src else _decode(skeleton, received)


def _encode(value, tensors: list):
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"$tensor": len(tensors) - 1}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {f.name: _encode(getattr(value, f.name), tensors) for f in dataclasses.fields(value) if f.init}
        return {"$dataclass": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(value, (list, tuple)):
        return {"$" + type(value).__name__: [_encode(v, tensors) for v in value]}
    if isinstance(value, dict):
        return {"$dict": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"broadcast_tree cannot send a {type(value).__name__}")


def _decode(value, tensors: list):
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return tensors[value["$tensor"]]
    if "$dataclass" in value:
        module, _, name = value["$dataclass"].partition(":")
        cls = getattr(importlib.import_module(module), name) if module.startswith("lowbit.") else None
        if cls is None or not dataclasses.is_dataclass(cls):  # never construct anything else
            raise TypeError(f"broadcast_tree received {value['$dataclass']!r}, not a lowbit dataclass")
        return cls(**{k: _decode(v, tensors) for k, v in value["fields"].items()})
    if "$list" in value or "$tuple" in value:
        items = [_decode(v, tensors) for v in value.get("$list", value.get("$tuple"))]
        return items if "$list" in value else tuple(items)
    return {_decode(k, tensors): _decode(v, tensors) for k, v in value["$dict"]}


def round_robin(items: list, compute) -> list:
    """[compute(item) for item in items], item i computed by rank i % size alone, every result
    then sent to every rank (broadcast_tree) in order."""
    w = world()
    if w.size == 1:
        return [compute(item) for item in items]
    mine = {i: compute(item) for i, item in enumerate(items) if i % w.size == w.rank}
    return [broadcast_tree(mine.get(i), i % w.size) for i in range(len(items))]
