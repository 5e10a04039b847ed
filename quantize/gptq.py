"""GPTQ: quantize a weight column by column, pushing each column's rounding error onto the columns
not yet quantized, weighted by the inverse Hessian of the layer's inputs (Frantar et al., 2022).

The core `gptq_solve(W, H, cfg)` is a pure function of the weight (out, in) and the Hessian
H = 2/N · XᵀX (in, in); `apply` walks the decoder layers, quantizing true-sequential groups
([q,k,v] → [o] → [gate,up] → [down]) each on inputs recorded after the groups before it.
"""
from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

from lowbit.calibrate.hardware import cpu_info
from lowbit.calibrate.walker import record_linear_inputs, walk

from .fp8 import FP8Format, FP8Weight, WeightStrategy, element_scale, saturating_cast, weight_scale
from .primitives import (IntScheme, check_group_size, compute_scale_zero, fake_quantize, grouped,
                         scale_zero_from_range)
from .qlinear import QuantLinear, linear_weight
from .step import StepContext
from .targets import replace_module, select_targets
from .weight import QuantizedWeight, quantize_rtn

MAX_DAMPING_RETRIES = 4  # each retry multiplies the damping by 10


@dataclass(frozen=True)
class GPTQConfig:
    bits: int = 4
    symmetric: bool = True
    strategy: Literal["channel", "group"] = "group"
    group_size: Optional[int] = 128  # only with strategy group
    block_size: int = 128  # columns per lazy batch update; rounded to a multiple of group_size
    dampening_frac: float = 0.01  # added to H's diagonal, as a fraction of its mean diagonal
    # none: columns in order; static: columns by decreasing Hessian diagonal, groups fixed
    # beforehand (no runtime permutation); group: groups formed in that order (needs g_idx)
    actorder: Literal["none", "static", "group"] = "static"
    # minmax: a group's range is its min/max; mse: shrink the range to minimise the group's
    # rounding error weighted by the Hessian diagonal (clipping a few outliers costs less)
    scale_search: Literal["minmax", "mse"] = "minmax"
    # re-record inputs after each group of a layer ([q,k,v] -> [o] -> [gate,up] -> [down]) is
    # quantized: ~3 forwards per layer instead of 1 (on smollm2-135m W4 no better: 19.03 vs 18.99)
    true_sequential: bool = True
    micro_batch: int = 8  # calibration samples per forward pass
    # dtype of the calibration forwards (autocast; Hessians and the solve stay float32). auto:
    # bfloat16 where the device has fast bf16 matmuls (CUDA, CPUs where cpu_info().bf16_native),
    # else float32 (torch emulates bf16 on other CPUs: a 4096x576x1536 matmul 9x slower on AVX2)
    forward_dtype: Literal["auto", "bfloat16", "float32"] = "auto"

    def __post_init__(self):
        self.scheme  # validates bits, strategy and group_size
        if self.block_size < 1 or self.micro_batch < 1:
            raise ValueError("block_size and micro_batch must be positive")
        if self.scale_search not in ("minmax", "mse"):
            raise ValueError(f"scale_search must be minmax or mse, got {self.scale_search!r}")
        if not 0 <= self.dampening_frac < 10:
            raise ValueError(f"dampening_frac must be in [0, 10), got {self.dampening_frac}")
        if self.forward_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"forward_dtype must be auto, bfloat16 or float32, got {self.forward_dtype!r}")

    @property
    def scheme(self) -> IntScheme:
        return IntScheme(self.bits, self.symmetric, self.strategy, self.group_size)


@dataclass
class GPTQResult:
    weight: QuantizedWeight
    row_loss: torch.Tensor  # (out,) Σ_j (w - q)² / [H⁻¹]_jj / 2: mean squared output error per token
    dampening_frac: float  # the damping that worked
    retries: int  # Cholesky failures before it worked


class HessianAccumulator:
    """Running mean H = 2/N · XᵀX over the N tokens seen (callers leave padding out), in float32
    even when the forwards run in bf16: a bf16 XᵀX rounds every entry to 8 bits, and on
    smollm2-135m W4 that cost 2 points of the perplexity gap GPTQ closes (58% vs 60%)."""

    def __init__(self, columns: int, device=None):
        self.H = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x2d: torch.Tensor) -> None:
        n = x2d.shape[0]
        if n == 0:
            return
        x = x2d.to(self.H.device, torch.float32)
        total = self.tokens + n
        self.H.mul_(self.tokens / total).addmm_(x.t(), x, alpha=2.0 / total)
        self.tokens = total


def resolve_forward_dtype(name: str, device) -> torch.dtype:
    """The dtype `auto` stands for on this device. On a CPU calibrate.hardware decides (not
    torch's mkldnn check, which says yes on any AVX-512 CPU, where bf16 may be emulated)."""
    if name != "auto":
        return getattr(torch, name)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and cpu_info().bf16_native:
        return torch.bfloat16
    return torch.float32


def quantize_weight(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig) -> QuantizedWeight:
    return gptq_solve(W, H, cfg).weight


def inverse_hessian_factor(H: torch.Tensor, dampening_frac: float) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor U of (H + damp·I)⁻¹, retrying at 10× damping when a factorisation fails."""
    frac, retries = dampening_frac, 0
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    while True:
        damped = H + frac * H.diagonal().mean() * eye
        L, info = torch.linalg.cholesky_ex(damped)
        if info == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info == 0 and torch.isfinite(U).all():
                return U, frac, retries
        if retries == MAX_DAMPING_RETRIES:
            raise ValueError(f"Hessian is not positive definite even with dampening_frac {frac}")
        retries += 1
        frac = max(frac * 10, 1e-3)


def gptq_solve(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig) -> GPTQResult:
    """GPTQ of W (out, in) against the input Hessian H (in, in)."""
    return _single_threaded(_gptq_solve, W, H, cfg)


def _gptq_solve(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig) -> GPTQResult:
    scheme = cfg.scheme
    W, H, perm, U, frac, retries = _prepare(W, H, cfg)
    rows, cols = W.shape
    lazy_groups = scheme.strategy == "group" and cfg.actorder != "static"
    importance = H.diagonal() if cfg.scale_search == "mse" else None  # (cols,) processing order
    if lazy_groups:
        grid = _LazyGrid(rows, cols, scheme, W.device, importance)
    else:
        grid = _FixedGrid(W, perm, scheme, importance)
    block = cfg.block_size
    if scheme.strategy == "group":  # keep each group inside one block
        block = max(scheme.group_size, block // scheme.group_size * scheme.group_size)
    Q, row_loss = _solve_blocks(W, U, grid, block)
    codes = _codes(Q, grid)
    if perm is not None:
        inverse = torch.argsort(perm)
        codes = codes[:, inverse]
    g_idx = None
    if lazy_groups and perm is not None:
        g_idx = (torch.arange(cols, device=W.device) // scheme.group_size)[torch.argsort(perm)]
    scale, zero = grid.result()
    qw = QuantizedWeight(codes.to(torch.int8), scale, zero, scheme, g_idx)
    return GPTQResult(qw, row_loss, frac, retries)


def gptq_solve_fp8(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig, strategy: WeightStrategy = "channel",
                   fmt: FP8Format = "e4m3", block: int = 128) -> tuple[FP8Weight, torch.Tensor, float, int]:
    """GPTQ of W onto an FP8 grid whose scales (per tensor, channel or block) are fixed from W's
    ranges first. Returns the FP8 weight, row losses, the damping used and its retries."""
    return _single_threaded(_gptq_solve_fp8, W, H, cfg, strategy, fmt, block)


def _gptq_solve_fp8(W, H, cfg: GPTQConfig, strategy: WeightStrategy, fmt: FP8Format, block: int):
    if cfg.actorder == "group":
        raise ValueError("FP8 GPTQ supports actorder none or static (its scales do not depend on the order)")
    scale = weight_scale(W, strategy, fmt, block)
    per_element = element_scale(scale, W.shape, strategy, block).expand(W.shape)  # a view unless block
    Wp, _, perm, U, frac, retries = _prepare(W, H, cfg)
    # tensor and channel scales are the same in every column: only block scales follow the permutation
    grid = _FP8Grid(per_element if perm is None or strategy != "block" else per_element[:, perm], fmt)
    Q, row_loss = _solve_blocks(Wp, U, grid, cfg.block_size)
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    data = saturating_cast(Q / per_element, fmt)  # exact: Q already lies on the grid
    return FP8Weight(data, scale, fmt, strategy, block), row_loss, frac, retries


def _prepare(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig):
    """Float copies with dead inputs zeroed, permuted by act-order, and the inverse-Hessian factor."""
    W = W.detach().float().clone()
    H = H.detach().float().clone()
    dead = H.diagonal() == 0  # inputs that are always zero: any value works, 0 is simplest
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if cfg.actorder != "none" else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    U, frac, retries = inverse_hessian_factor(H, cfg.dampening_frac)
    return W, H, perm, U, frac, retries


class _FP8Grid:
    """Per-element FP8 scales (rows, cols) in processing order, fixed before GPTQ runs."""

    def __init__(self, scale: torch.Tensor, fmt: FP8Format):
        self.scale_t, self.fmt = scale.t(), fmt  # a column's scales: one row here (a view, no copy)

    def begin(self, j: int, Wt_rest: torch.Tensor) -> None:
        pass

    def quantize(self, j: int, w: torch.Tensor) -> torch.Tensor:
        s = self.scale_t[j]
        return saturating_cast(w / s, self.fmt).float() * s


class _FixedGrid:
    """Scales fixed before GPTQ runs (per channel, or per group of the original column order)."""

    def __init__(self, W: torch.Tensor, perm: Optional[torch.Tensor], scheme: IntScheme,
                 importance: Optional[torch.Tensor] = None):
        self.scheme = scheme
        inverse = None if perm is None else torch.argsort(perm)
        original = W if perm is None else W[:, inverse]
        if importance is None:
            self.scale, self.zero = compute_scale_zero(original, scheme)  # (rows, G)
        else:
            weight = importance if perm is None else importance[inverse]
            groups = grouped(original, scheme)  # (rows, G, group)
            self.scale, self.zero = search_scale_zero(groups, grouped(weight[None], scheme)[0], scheme)
        group = torch.zeros(W.shape[1], dtype=torch.long, device=W.device)
        if scheme.strategy == "group":
            order = perm if perm is not None else torch.arange(W.shape[1], device=W.device)
            group = order // scheme.group_size
        self.column_group = group  # processing position -> group index
        self._groups = group.tolist()  # plain ints: cheap to index in the per-column loop

    def begin(self, j: int, Wt_rest: torch.Tensor) -> None:
        pass

    def column(self, j: int):
        g = self._groups[j]
        return self.scale[:, g], None if self.zero is None else self.zero[:, g]

    def quantize(self, j: int, w: torch.Tensor) -> torch.Tensor:
        return fake_quantize(w, *self.column(j), self.scheme.qmin, self.scheme.qmax)

    def result(self):
        return self.scale.float(), self.zero


class _LazyGrid:
    """Group scales computed when GPTQ reaches a group, from the already-updated weights."""

    def __init__(self, rows: int, cols: int, scheme: IntScheme, device, importance=None):
        self.scheme, self.size, self.importance = scheme, scheme.group_size, importance
        self.scale = torch.ones(rows, cols // self.size, device=device)
        self.zero = None if scheme.symmetric else torch.zeros(rows, cols // self.size, device=device)
        self.column_group = torch.arange(cols, device=device) // self.size

    def begin(self, j: int, Wt_rest: torch.Tensor) -> None:
        if j % self.size == 0:  # Wt_rest: (columns from j on, rows), current values
            g = Wt_rest[: self.size]
            if self.importance is None:
                scale, zero = scale_zero_from_range(g.amin(dim=0), g.amax(dim=0), self.scheme)
            else:
                weight = self.importance[j : j + self.size]
                scale, zero = search_scale_zero(g.t()[:, None], weight[None], self.scheme)
                scale, zero = scale[:, 0], None if zero is None else zero[:, 0]
            self.scale[:, j // self.size] = scale
            if zero is not None:
                self.zero[:, j // self.size] = zero

    def column(self, j: int):
        g = j // self.size
        return self.scale[:, g], None if self.zero is None else self.zero[:, g]

    def quantize(self, j: int, w: torch.Tensor) -> torch.Tensor:
        return fake_quantize(w, *self.column(j), self.scheme.qmin, self.scheme.qmax)

    def result(self):
        return self.scale, self.zero


def search_scale_zero(groups: torch.Tensor, weight: torch.Tensor, scheme: IntScheme,
                      steps: int = 20, max_shrink: float = 0.5):
    """Per group of groups (rows, G, size), the min/max range shrunk by the factor in
    [1 - max_shrink, 1] whose rounding error, weighted per column by weight (G, size), is least.
    Returns scale (rows, G) and zero (rows, G) or None."""
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    best_err = torch.full_like(lo, float("inf"))
    best_scale, best_zero = torch.ones_like(lo), None if scheme.symmetric else torch.zeros_like(lo)
    for i in range(steps + 1):
        shrink = 1 - max_shrink * i / steps
        scale, zero = scale_zero_from_range(lo * shrink, hi * shrink, scheme)
        q = fake_quantize(groups, scale[..., None], None if zero is None else zero[..., None],
                          scheme.qmin, scheme.qmax)
        err = ((q - groups).square() * weight).sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _single_threaded(fn, *args):
    """Run fn on one thread: the sweep is thousands of tiny ops, where OpenMP's thread
    synchronisation costs more than it saves (10x slower on 2 busy cores); the factorisations
    of a few-thousand-wide Hessian gain little from threads either."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _solve_blocks(W: torch.Tensor, U: torch.Tensor, grid, block: int):
    """The GPTQ sweep over (already permuted) columns. Returns the quantized values (rows, cols),
    on the grid, and row losses."""
    Wt = W.t().contiguous()  # (cols, rows): a column is a contiguous row here
    rows, cols = W.shape
    Qt = torch.empty(cols, rows, device=W.device)  # quantized values, on the grid
    row_loss = torch.zeros(rows, device=W.device)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        Wb, Ub = Wt[i1:i2], U[i1:i2, i1:i2]  # Wb is a view: updates land in Wt
        Eb = torch.empty_like(Wb)
        for j in range(i2 - i1):
            grid.begin(i1 + j, Wb[j:])
            w = Wb[j]
            q = Qt[i1 + j] = grid.quantize(i1 + j, w)
            torch.div(w - q, Ub[j, j], out=Eb[j])
            Wb[j + 1 :].addr_(Ub[j, j + 1 :], Eb[j], alpha=-1.0)
        row_loss += Eb.square().sum(dim=0) / 2
        Wt[i2:].addmm_(U[i1:i2, i2:].t(), Eb, alpha=-1.0)
    return Qt.t(), row_loss


def _codes(Q: torch.Tensor, grid) -> torch.Tensor:
    """Integer codes of Q (rows, cols), whose values already lie on the grid's points."""
    scale, zero = grid.result()
    codes = torch.round(Q / scale[:, grid.column_group])
    if zero is not None:
        codes += zero[:, grid.column_group]
    return codes.clamp(grid.scheme.qmin, grid.scheme.qmax)


def apply(ctx: StepContext, cfg: GPTQConfig) -> dict:
    """Quantize every targeted linear inside the decoder layers with GPTQ, layer by layer."""
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    for name, module in targets.linears.items():
        check_group_size(cfg.scheme, linear_weight(module).shape[1], name)
    outside = {n: m for n, m in targets.linears.items() if not n.startswith(ctx.arch.layers + ".")}

    def solve(prefix, layer, members, H, stats) -> dict:
        solved = {}
        for name, qw in _solve_shared(layer, members, H, cfg, stats).items():
            old = layer.get_submodule(name)
            solved[name] = QuantLinear.from_quantized(qw, old.bias).to(old.weight.device)
        return solved

    layers, forward_dtype = walk_solving(ctx, cfg, targets, solve)
    for name, module in outside.items():  # lm_head etc. see no decoder-layer inputs: RTN
        warnings.warn(f"{name} is outside the decoder layers; quantized round-to-nearest, not GPTQ")
        replace_module(ctx.model, name, QuantLinear.from_quantized(quantize_rtn(linear_weight(module), cfg.scheme),
                                                                   module.bias))
    return {"quantized": list(targets.linears), "ignored": targets.ignored,
            "forward_dtype": forward_dtype, "round_to_nearest": list(outside),
            "damping_retries": damping_retries(layers), "layers": layers}


def walk_solving(ctx: StepContext, cfg: GPTQConfig, targets, solve) -> tuple[list[dict], str]:
    """Walk the decoder layers; per linear group, record its inputs' Hessians and call
    solve(prefix, layer, names sharing one input, H, stats) -> {name: replacement module}.
    The layer's linears are replaced once all its groups are solved, and its quantized outputs
    feed the next layer. With cfg.true_sequential, solve must also write the rounded values into
    the float linears, so that later groups record what they will see (as _solve_shared does).
    Returns the per-layer records and the forwards' dtype."""

    def on_layer(i, prefix, layer, inputs):
        start = time.perf_counter()
        names = [n for n in ctx.arch.linears if f"{prefix}.{n}" in targets.linears]
        groups = [[n for n in g if n in names] for g in ctx.arch.groups] if cfg.true_sequential else [names]
        stats: dict = {}
        solved: dict[str, nn.Module] = {}
        for group in filter(None, groups):
            hessians, sharing = _collect_hessians(layer, group, inputs, ctx.device)
            for lead, members in sharing.items():
                solved.update(solve(prefix, layer, members, hessians.pop(lead).H, stats))
        for name, module in solved.items():
            replace_module(layer, name, module)
        return {"layer": prefix, "seconds": round(time.perf_counter() - start, 3),
                "linears": {f"{prefix}.{n}": s for n, s in stats.items()}}

    forward_dtype = resolve_forward_dtype(cfg.forward_dtype, ctx.device)
    name = str(forward_dtype).removeprefix("torch.")
    device = torch.device(ctx.device)
    where = f"CPU: {cpu_info().describe()}" if device.type == "cpu" else str(device)
    print(f"[gptq] forward dtype {name} ({cfg.forward_dtype} on {where})", file=sys.stderr)
    layers = walk(ctx.model, ctx.arch, ctx.batches, on_layer, device=ctx.device, label="gptq",
                  micro_batch=cfg.micro_batch, forward_dtype=forward_dtype, final_outputs=False,
                  store=ctx.layer_store)
    return list(layers), name


def linear_stats(row_loss: torch.Tensor, dampening_frac: float, retries: int, seconds: float) -> dict:
    """One linear's record in a layer's "linears" (damping_retries and the report read it)."""
    return {"loss": float(row_loss.sum()), "dampening_frac": dampening_frac, "retries": retries,
            "seconds": round(seconds, 4)}


def damping_retries(layers) -> list[dict]:
    return [{"linear": n, "dampening_frac": s["dampening_frac"]}
            for layer in layers for n, s in layer["linears"].items() if s["retries"]]


def _collect_hessians(layer: nn.Module, names: list[str], inputs, device):
    """Hessians of the named linears' inputs, one per distinct input; and lead -> names sharing it."""
    hessians: dict[str, HessianAccumulator] = {}
    sharing: dict[str, list[str]] = {}
    last = {"x": None, "lead": None}

    def record(name: str, x2d: torch.Tensor) -> None:
        if x2d is last["x"]:  # the walker hands linears fed the same tensor the same object
            if name not in sharing[last["lead"]]:
                sharing[last["lead"]].append(name)
            return
        if name not in hessians:
            hessians[name] = HessianAccumulator(x2d.shape[1], device=x2d.device)
            sharing[name] = [name]
        hessians[name].add(x2d)
        last["x"], last["lead"] = x2d, name

    record_linear_inputs(layer, names, inputs, device, record)
    return hessians, sharing


def _solve_shared(layer, members, H, cfg: GPTQConfig, stats: dict) -> dict[str, QuantizedWeight]:
    """One GPTQ solve for linears sharing an input (rows stacked), then split back per linear."""
    solved = {}
    modules = [layer.get_submodule(n) for n in members]
    weights = [linear_weight(m) for m in modules]
    start = time.perf_counter()
    result = gptq_solve(torch.cat([w.float() for w in weights]), H, cfg)
    seconds = (time.perf_counter() - start) / len(members)
    row = 0
    for name, module, w in zip(members, modules, weights):
        rows = slice(row, row + w.shape[0])
        row += w.shape[0]
        qw = _row_slice(result.weight, rows)
        _set_weight(module, qw.dequantize().to(w.dtype))  # later groups see the quantized layer
        solved[name] = qw
        stats[name] = linear_stats(result.row_loss[rows], result.dampening_frac, result.retries, seconds)
    return solved


def _row_slice(qw: QuantizedWeight, rows: slice) -> QuantizedWeight:
    zero = None if qw.zero is None else qw.zero[rows]
    return QuantizedWeight(qw.codes[rows], qw.scale[rows], zero, qw.scheme, qw.g_idx)


def _set_weight(module: nn.Module, w: torch.Tensor) -> None:
    """Write an (out, in) weight into an nn.Linear, or a GPT-2 Conv1D (stored (in, out))."""
    module.weight.data.copy_(w if isinstance(module, nn.Linear) else w.t())
