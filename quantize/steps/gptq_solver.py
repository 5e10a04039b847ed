"""GPTQ's pure core (Frantar et al., 2022): quantize a weight (out, in) column by column against
the Hessian H = 2/N · XᵀX (in, in) of its inputs, each column's rounding error pushed onto the
columns not yet quantized through the inverse Hessian. No model, no data loading: tensors in,
a QuantizedWeight (or FP8Weight) out.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

from lowbit.quantize.grids.fp8 import FP8Format, FP8Scheme, FP8Weight, WeightStrategy
from lowbit.quantize.grids.gguf import GGUFScheme, GGUFWeight, quantize_gguf
from lowbit.quantize.grids.gguf_weighted import quantize_weighted
from lowbit.quantize.grids.integer import QuantizedWeight
from lowbit.quantize.steps.gguf_refit import REFITTABLE, refit_block_scales
from lowbit.quantize.steps.gptq_grids import (FixedColumnGrid, FixedElementGrid, GGUFColumnGrid, LazyColumnGrid,
                                              LazyGGUFColumnGrid)

if TYPE_CHECKING:
    from lowbit.quantize.steps.gptq import GPTQConfig

MAX_DAMPING_RETRIES = 4  # each retry multiplies the damping by 10


@dataclass
class GPTQResult:
    weight: QuantizedWeight | FP8Weight | GGUFWeight
    row_loss: torch.Tensor  # (out,) Σ_j (w - q)² / [H⁻¹]_jj / 2: mean squared output error per token
    dampening_frac: float  # the damping that worked
    retries: int  # Cholesky failures before it worked
    # (out, in) the weights as the sweep rounded them, each column with the errors pushed onto it
    # (gptq_solve's pre_round=True): signround's start: gptq learns its offsets from these
    pre_round: Optional[torch.Tensor] = None


class HessianAccumulator:
    """H = 2/N · XᵀX over the N tokens seen (callers leave padding out), as a float64 sum of each
    micro-batch's float32 XᵀX, kept as the upper triangle in row blocks.

    Why float64: the sum's rounding must not depend on the order micro-batches arrive in. Two ranks
    that each sum half the micro-batches and then add their sums, and one process that sums them
    all in turn, reach float64 sums a few ulps apart, which round to the same float32 H (almost
    always: ~1e-9 per entry). Summed in float32 they differed in the last bits, and GPTQ, whose
    sweep carries each rounding decision into the columns after it, turned that into 94% identical
    codes on smollm2-135m between 1 and 2 ranks. Each micro-batch's product stays float32 (the same
    kernel on the same shapes, so the same bits on every rank), never bf16: a bf16 XᵀX rounds
    every entry to 8 bits, which on smollm2-135m W4 cost 2 points of the gap GPTQ closes.

    Why the triangle: H is symmetric, so the float64 upper triangle takes the bytes of one float32
    matrix (plus the diagonal blocks' lower halves) and half the product flops; take() rebuilds the
    full float32 H from the last block up, freeing each block once mirrored, so the handover peaks
    near 1.25 matrices, under the factorisation that follows it."""

    BLOCK = 512  # rows per block: the float32 product of one block is BLOCK x columns

    def __init__(self, columns: int, device=None):
        self.columns, self.device, self.tokens = columns, device, 0
        self.starts = list(range(0, columns, self.BLOCK))
        self.sums: list[Optional[torch.Tensor]] = [
            torch.zeros(min(self.BLOCK, columns - s), columns - s, dtype=torch.float64, device=device)
            for s in self.starts]

    def add(self, x2d: torch.Tensor) -> None:
        if x2d.shape[0] == 0:
            return
        x = x2d.to(self.device, torch.float32)
        with torch.autocast(x.device.type, enabled=False):  # called from hooks inside bf16 autocast
            for start, block in zip(self.starts, self.sums):
                block.add_(x[:, start : start + block.shape[0]].t() @ x[:, start:])
        self.tokens += x.shape[0]

    def finite(self) -> bool:
        """Whether no sum overflowed float32 (inputs too large to square) or met a NaN. The diagonal
        tells, in O(columns): |Σ x_i·x_j| <= max(Σ x_i², Σ x_j²), and a NaN input's own square is NaN."""
        return all(bool(torch.isfinite(block.diagonal()).all()) for block in self.sums if block is not None)

    def matrix(self) -> torch.Tensor:
        """The full float32 H; the accumulator keeps its sums."""
        return self._assemble(free=False)

    def take(self) -> torch.Tensor:
        """The full float32 H, handed over: the accumulator lets go of its sums as it builds it."""
        return self._assemble(free=True)

    def _assemble(self, free: bool) -> torch.Tensor:
        if any(block is None for block in self.sums):
            raise RuntimeError("this Hessian was already taken")
        H = torch.empty(self.columns, self.columns, dtype=torch.float32, device=self.device)
        scale = 2.0 / max(self.tokens, 1)
        for k in reversed(range(len(self.starts))):  # bottom up: the rows below are filled already
            start, block = self.starts[k], self.sums[k]
            end = start + block.shape[0]
            H[start:end, start:] = block * scale
            if free:
                self.sums[k] = block = None
            H[end:, start:end] = H[start:end, end:].T
            square = H[start:end, start:end]
            square.copy_(square.triu() + square.triu(1).T)  # the product's lower half may differ in its last bits
        return H


def solve_onto(grid, W: torch.Tensor | Callable[[], torch.Tensor], H: torch.Tensor | HessianAccumulator,
               cfg: GPTQConfig) -> GPTQResult:
    """GPTQ of W onto any per-linear grid, by its family's solver (cfg.scheme is not read)."""
    return SOLVERS.get(grid.FAMILY, _solve_fixed)(grid, W, H, cfg)


def _solve_int(grid, W, H, cfg: GPTQConfig) -> GPTQResult:
    return gptq_solve(W, H, replace(cfg, scheme=grid))


def _solve_gguf(grid, W, H, cfg: GPTQConfig) -> GPTQResult:
    H = H if isinstance(H, torch.Tensor) else H.take()  # the block-scale searches read H besides the sweep
    return GPTQResult(*gptq_solve_gguf(W() if callable(W) else W, H, cfg, grid))


def _solve_fixed(grid, W, H, cfg: GPTQConfig) -> GPTQResult:
    W = W() if callable(W) else W  # its ranges fix the scales before the factorisation
    return GPTQResult(*_single_threaded(_gptq_solve_fixed, W, H, cfg, grid))


def quantize_weight(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig) -> QuantizedWeight:
    return gptq_solve(W, H, cfg).weight


def inverse_hessian_factor(H: torch.Tensor, dampening_frac: float,
                           perm: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor U of (H' + damp·I)⁻¹, where H' is H permuted by `perm` with dead inputs
    (zero diagonal) given a unit diagonal; retried at 10× damping when a factorisation fails.

    Memory: one matrix besides H. The three factorisations (Cholesky, its inverse, the upper Cholesky
    of that) run in place on one column-major working copy, where LAPACK needs no copy of its own;
    the textbook chain holds seven matrices at its peak (3.3 GB a copy for a 70B model's down_proj).
    The factor is bit for bit the textbook chain's (tests/test_quantize_gptq_memory.py)."""
    frac, retries = dampening_frac, 0
    n = H.shape[0]
    work = torch.empty(n, n, dtype=torch.float32, device=H.device).mT  # column-major: LAPACK's own layout
    info = torch.empty((), dtype=torch.int32, device=H.device)
    while True:
        _permuted_copy(H, perm, out=work)
        diagonal = work.diagonal()
        diagonal[diagonal == 0] = 1.0  # dead inputs: any value works, 1 keeps H positive definite
        # + 0.0 turns any -0.0 into +0.0 as adding (damp·I) does off its diagonal
        work.add_(0.0)
        diagonal.add_(frac * diagonal.mean())
        torch.linalg.cholesky_ex(work, out=(work, info))
        if info == 0:
            torch.cholesky_inverse(work, out=work)
            torch.linalg.cholesky_ex(work, upper=True, out=(work, info))
            if info == 0 and _all_finite(work.mT):
                return work, frac, retries
        if retries == MAX_DAMPING_RETRIES:
            raise ValueError(f"Hessian is not positive definite even with dampening_frac {frac}")
        retries += 1
        frac = max(frac * 10, 1e-3)


def _all_finite(matrix: torch.Tensor, rows: int = 256) -> bool:
    """torch.isfinite(matrix).all() without its full-size boolean matrix."""
    return all(bool(torch.isfinite(block).all()) for block in matrix.split(rows))


def _permuted_copy(H: torch.Tensor, perm: Optional[torch.Tensor], out: torch.Tensor, rows: int = 256) -> None:
    """out = H[perm][:, perm] (or H) in float32, a block of rows at a time: no full-size temporary."""
    for start in range(0, H.shape[0], rows):
        if perm is None:
            out[start : start + rows] = H[start : start + rows]
        else:
            out[start : start + rows] = H.index_select(0, perm[start : start + rows]).index_select(1, perm)


def gptq_solve(W: torch.Tensor | Callable[[], torch.Tensor], H: torch.Tensor | HessianAccumulator,
               cfg: GPTQConfig, pre_round: bool = False) -> GPTQResult:
    """GPTQ of W (out, in) against the input Hessian H (in, in). Given the accumulator instead, the
    solve takes its matrix and frees it once the inverse-Hessian factor is built, so the sweep holds
    one (in, in) matrix instead of two. Given a function for W, the solve calls it once the factor
    is built: the weight's float copy is not made beside the factorisation's two matrices. With
    pre_round, the result also holds the weights as the sweep rounded them (scales fixed before the
    sweep only: act-order static or none, or per channel)."""
    return _single_threaded(_gptq_solve, W, H, cfg, pre_round)


def _gptq_solve(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig, pre_round: bool = False) -> GPTQResult:
    scheme = cfg.scheme
    W, diagonal, perm, U, frac, retries = _prepare(W, H, cfg)
    rows, cols = W.shape
    lazy_groups = scheme.strategy == "group" and cfg.actorder != "static"
    importance = diagonal if cfg.scale_search == "mse" else None  # (cols,) processing order
    if lazy_groups and pre_round:
        raise ValueError("GPTQ's rounded-from weights are kept only where the scales are fixed before the sweep: "
                         f"actorder static or none, not {cfg.actorder!r}")
    if lazy_groups:
        grid = LazyColumnGrid(rows, cols, scheme, W.device, importance)
    else:
        grid = FixedColumnGrid(W, perm, scheme, importance)
    block = cfg.batch_columns
    if scheme.strategy == "group":  # keep each group inside one block
        block = max(scheme.group_size, block // scheme.group_size * scheme.group_size)
    device, Wt = W.device, W.t().contiguous()
    del W  # the sweep updates its transposed copy: one weight-sized matrix fewer while it runs
    # the sweep keeps int8 codes, not float values: a quarter of a weight's float bytes
    codes, row_loss = _solve_blocks(Wt, U, grid, block, codes=True)
    del U  # an (in, in) matrix
    # the sweep never updates a column once it is rounded: Wt ends as the weights each was rounded from
    kept = None if not pre_round else (Wt.t().contiguous() if perm is None else Wt.t()[:, torch.argsort(perm)])
    del Wt
    codes = codes.contiguous() if perm is None else codes[:, torch.argsort(perm)]
    g_idx = None
    if lazy_groups and perm is not None:
        g_idx = (torch.arange(cols, device=device) // scheme.group_size)[torch.argsort(perm)]
    scale, zero = grid.result()
    qw = QuantizedWeight(codes, scale, zero, scheme, g_idx)
    return GPTQResult(qw, row_loss, frac, retries, kept)


def gptq_solve_fp8(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig, strategy: WeightStrategy = "channel",
                   fmt: FP8Format = "e4m3", block: int = 128) -> tuple[FP8Weight, torch.Tensor, float, int]:
    """GPTQ of W onto an FP8 grid whose scales (per tensor, channel or block) are fixed from W's
    ranges first. Returns the FP8 weight, row losses, the damping used and its retries."""
    return _single_threaded(_gptq_solve_fixed, W, H, cfg, FP8Scheme(fmt, strategy, block))


def _gptq_solve_fixed(W, H, cfg: GPTQConfig, grid):
    """GPTQ onto a grid whose scales its sweep view fixes from W before the sweep (they do not
    depend on the column order, so act-order static and none are the same search)."""
    if cfg.actorder == "group":
        raise ValueError(f"GPTQ onto {grid.FAMILY} grids supports actorder none or static (their scales do not "
                         "depend on the order)")
    view = grid.sweep_view(W)
    Wp, _, perm, U, frac, retries = _prepare(W, H, cfg)
    scale = view.per_element
    if perm is not None and scale.stride(1) != 0:  # the same scales in every column need no permuting
        scale = scale[:, perm]
    swept, row_loss = _solve_blocks(Wp.t().contiguous(), U, FixedElementGrid(scale, view.snap), cfg.batch_columns)
    if perm is not None:
        swept = swept[:, torch.argsort(perm)]
    return view.weight(swept), row_loss, frac, retries


def gptq_solve_gguf(W: torch.Tensor, H: torch.Tensor, cfg: GPTQConfig,
                    scheme: GGUFScheme) -> tuple[GGUFWeight, torch.Tensor, float, int]:
    """GPTQ of W onto a GGML block grid (cfg.scheme is not used). Block scales (and mins) come from
    llama.cpp's reference search (cfg.scale_search mse: weighted by H's diagonal, its imatrix), on W
    before the sweep with actorder static, on the updated weights as the sweep reaches each block with
    actorder none. Returns the GGUFWeight (it packs as it is: the sweep rounds onto exactly the grid
    the file stores), row losses, the damping used and its retries."""
    return _single_threaded(_gptq_solve_gguf, W, H, cfg, scheme)


def _gptq_solve_gguf(W, H, cfg: GPTQConfig, scheme: GGUFScheme):
    if cfg.actorder == "group":
        raise ValueError("GGUF GPTQ supports actorder none (block scales searched as the sweep reaches each "
                         "block) or static (block scales fixed before the sweep)")
    if cfg.actorder == "none":
        return _gptq_solve_gguf_lazy(W, H, cfg, scheme)
    # mse: block scales searched for the error weighted by H's diagonal (llama.cpp's imatrix);
    # minmax: llama.cpp's own reference scales
    scheme.check_weight(W)
    fixed = quantize_weighted(W, scheme, H.diagonal()) if cfg.scale_search == "mse" else quantize_gguf(W, scheme)
    S, M = fixed.sub_scale_offset()
    sub = scheme.layout.sub
    S, M = S.repeat_interleave(sub, dim=1), None if M is None else M.repeat_interleave(sub, dim=1)
    Wp, _, perm, U, frac, retries = _prepare(W, H, cfg)
    if perm is not None:
        S, M = S[:, perm], None if M is None else M[:, perm]
    weight, row_loss = _sweep_fixed(Wp, U, perm, fixed, S, M, cfg)
    if cfg.scale_refits and scheme.type in REFITTABLE:
        weight, row_loss = _refit_and_sweep(W, H, Wp, U, perm, weight, cfg, frac)
    return weight, row_loss, frac, retries


def _sweep_fixed(Wp, U, perm, weight: GGUFWeight, S, M, cfg: GPTQConfig):
    """One sweep over the permuted columns onto fixed per-element grids S, M (permuted)."""
    grid = GGUFColumnGrid(S, M, weight.scheme)
    # a copy: the sweep updates its matrix in place and the refits sweep again from Wp
    _, row_loss = _solve_blocks(Wp.t().clone(memory_format=torch.contiguous_format), U, grid, cfg.batch_columns)
    levels = grid.levels_t.t()
    if perm is not None:
        levels = levels[:, torch.argsort(perm)]
    return replace(weight, levels=levels.contiguous()), row_loss


def _refit_and_sweep(W, H, Wp, U, perm, weight: GGUFWeight, cfg: GPTQConfig, frac: float):
    """cfg.scale_refits times: block scales refitted to the levels (gguf_refit), a new sweep onto
    them between refits; the last refit is kept. Row losses are then the exact (w - ŵ)ᵀH(w - ŵ)/2
    under the damped H the sweeps used."""
    Hd, dead = _damped(H, frac)
    W = W.detach().float().clone()
    W[:, dead] = 0.0  # as the sweeps saw it
    sub = weight.scheme.layout.sub
    for round_ in range(cfg.scale_refits):
        weight = refit_block_scales(W, Hd, weight)
        if round_ + 1 < cfg.scale_refits:
            S, M = (None if t is None else t.repeat_interleave(sub, dim=1) for t in weight.sub_scale_offset())
            if perm is not None:
                S, M = S[:, perm], None if M is None else M[:, perm]
            weight, _ = _sweep_fixed(Wp, U, perm, weight, S, M, cfg)
    D = W - weight.dequantize()
    return weight, ((D @ Hd) * D).sum(dim=1) / 2


def _damped(H: torch.Tensor, frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    """H as the sweep factorised it (dead inputs given a unit diagonal, then damped), and the dead inputs."""
    H = H.detach().float().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    return H + frac * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype, device=H.device), dead


def _gptq_solve_gguf_lazy(W, H, cfg: GPTQConfig, scheme: GGUFScheme):
    """Columns in order; each block's scales searched from its updated weights when the sweep reaches it."""
    sigma2 = W.detach().float().square().mean(dim=1, keepdim=True)  # the original rows' (llama.cpp's σ²)
    Wp, _, _, U, frac, retries = _prepare(W, H, cfg)
    importance = H.diagonal() if cfg.scale_search == "mse" else None
    grid = LazyGGUFColumnGrid(*Wp.shape, scheme, Wp.device, importance, sigma2)
    size = scheme.block_size  # each block inside one batch of columns: begin() sees all of it
    _, row_loss = _solve_blocks(Wp.t().contiguous(), U, grid, max(size, cfg.batch_columns // size * size))
    return grid.weight(), row_loss, frac, retries


def _prepare(W: torch.Tensor, H: torch.Tensor | HessianAccumulator, cfg: GPTQConfig):
    """W as a float copy (column-major: W.t().contiguous() is the same storage, and a sweep given it
    updates this copy in place) with dead inputs zeroed, permuted by act-order; the permuted Hessian's
    diagonal (dead inputs at 1), the permutation and the inverse-Hessian factor. H is not copied
    whole: the factor's working matrix is the only other (in, in) matrix alive (and the only one
    left when H came in an accumulator)."""
    if not isinstance(H, torch.Tensor):  # an accumulator (or an expert's stand-in): its matrix, handed over
        H = H.take()
    diagonal = H.diagonal().to(torch.float32, copy=True)  # H stays as the caller gave it
    dead = diagonal == 0  # inputs that are always zero: any value works, 0 is simplest
    diagonal[dead] = 1.0
    perm = torch.argsort(diagonal, descending=True, stable=True) if cfg.actorder != "none" else None
    U, frac, retries = inverse_hessian_factor(H, cfg.dampening_frac, perm)
    del H  # a taken Hessian is freed here, before W's copy is made
    W = (W() if callable(W) else W).detach().float()
    # one copy either way, column-major: the sweep's W.t().contiguous() is then this same matrix
    W = (W.t().clone(memory_format=torch.contiguous_format) if perm is None else W.t().index_select(0, perm)).t()
    if perm is not None:
        dead, diagonal = dead[perm], diagonal[perm]
    W[:, dead] = 0.0
    return W, diagonal, perm, U, frac, retries


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


def _solve_blocks(Wt: torch.Tensor, U: torch.Tensor, grid, block: int, codes: bool = False):
    """The GPTQ sweep over (already permuted) columns of Wt = W.t().contiguous() (cols, rows: a column
    is a contiguous row there), which it updates in place. Returns the quantized values (rows, cols),
    on the grid (with codes: the integer grid's int8 codes instead, from its quantize_with_codes),
    and row losses."""
    cols, rows = Wt.shape
    Qt = torch.empty(cols, rows, device=Wt.device, dtype=torch.int8 if codes else torch.float32)
    row_loss = torch.zeros(rows, device=Wt.device)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        Wb, Ub = Wt[i1:i2], U[i1:i2, i1:i2]  # Wb is a view: updates land in Wt
        Eb = torch.empty_like(Wb)
        for j in range(i2 - i1):
            grid.begin(i1 + j, Wb[j:])
            w = Wb[j]
            if codes:
                q, Qt[i1 + j] = grid.quantize_with_codes(i1 + j, w)
            else:
                q = Qt[i1 + j] = grid.quantize(i1 + j, w)
            torch.div(w - q, Ub[j, j], out=Eb[j])
            Wb[j + 1 :].addr_(Ub[j, j + 1 :], Eb[j], alpha=-1.0)
        row_loss += Eb.square().sum(dim=0) / 2
        Wt[i2:].addmm_(U[i1:i2, i2:].t(), Eb, alpha=-1.0)
    return Qt.t(), row_loss


# a grid's FAMILY -> its own GPTQ solver; every other grid (fp8, mxfp4, a new one) has scales its ranges
# fix, and its column view (the grid protocol's) is all the fixed-scale solver needs
SOLVERS = {"int": _solve_int, "gguf": _solve_gguf}
