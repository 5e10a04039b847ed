"""GPTQ's inverse-Hessian factor in one working matrix: the same bits as the textbook chain
(permute, unit diagonal for dead inputs, damp, Cholesky, its inverse, upper Cholesky of that), a
caller's Hessian left as it was, an accumulator's handed over and freed, and the peak memory of
the factorisation one matrix above the Hessian instead of seven."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import HessianAccumulator, gptq_solve, inverse_hessian_factor


def _accumulated(cols: int, dead=(), seed: int = 0) -> HessianAccumulator:
    """Accumulated as a run does, micro-batch by micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    acc = HessianAccumulator(cols)
    for _ in range(3):
        x = torch.randn(150, cols, generator=gen) * torch.linspace(0.1, 3, cols)
        x[:, list(dead)] = 0.0
        acc.add(x)
    return acc


def _hessian(cols: int, dead=(), seed: int = 0) -> torch.Tensor:
    """An accumulated Hessian made not exactly symmetric in its last bits (as a caller's may be),
    dead inputs kept dead."""
    H = _accumulated(cols, dead, seed).take()
    noise = torch.rand(cols, cols, generator=torch.Generator().manual_seed(seed + 7)) * 1e-6 * H.abs().max()
    live = H.diagonal() != 0
    return H + noise * live[:, None] * live[None, :]


def _textbook_factor(H: torch.Tensor, frac: float, perm=None) -> tuple[torch.Tensor, float, int]:
    H = H.clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    if perm is not None:
        H = H[perm][:, perm]
    retries = 0
    while True:
        damped = H + frac * H.diagonal().mean() * torch.eye(H.shape[0])
        L, info = torch.linalg.cholesky_ex(damped)
        if info == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info == 0 and torch.isfinite(U).all():
                return U, frac, retries
        retries, frac = retries + 1, max(frac * 10, 1e-3)


@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("dead", [(), (3, 70, 191)])
def test_factor_is_the_textbook_chain_bit_for_bit(permuted, dead):
    H = _hessian(192, dead)
    assert not torch.equal(H, H.T)  # the copy must read H's own entries, not its transpose's
    before = H.clone()
    perm = torch.randperm(192, generator=torch.Generator().manual_seed(1)) if permuted else None
    U, frac, retries = inverse_hessian_factor(H, 0.01, perm)
    want, want_frac, want_retries = _textbook_factor(H, 0.01, perm)
    assert torch.equal(U, want) and (frac, retries) == (want_frac, want_retries) == (0.01, 0)
    assert torch.equal(H, before)  # the caller's Hessian is left as it was


def test_a_failed_factorisation_retries_from_the_untouched_hessian():
    H = _hessian(128)
    H.diagonal().sub_(0.03 * H.diagonal().mean())  # indefinite at 1% damping, not at 10%
    U, frac, retries = inverse_hessian_factor(H, 0.01)
    want, want_frac, want_retries = _textbook_factor(H, 0.01)
    assert retries == want_retries == 1 and frac == want_frac == 0.1
    assert torch.equal(U, want)


@pytest.mark.parametrize("actorder", ["none", "static", "group"])
def test_a_handed_over_accumulator_gives_the_same_solve_and_is_emptied(actorder):
    W = torch.randn(48, 256, generator=torch.Generator().manual_seed(2))
    cfg = GPTQConfig(scheme=IntScheme(4, True, "group", 32), actorder=actorder)
    acc = _accumulated(256, dead=(5,))
    given, handed = gptq_solve(W, acc.matrix(), cfg), gptq_solve(W, acc, cfg)
    assert all(block is None for block in acc.sums)
    with pytest.raises(RuntimeError, match="already taken"):
        acc.take()
    assert torch.equal(given.weight.codes, handed.weight.codes)
    assert torch.equal(given.weight.scale, handed.weight.scale)
    assert torch.equal(given.row_loss, handed.row_loss)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
def test_the_factorisation_holds_one_matrix_besides_the_hessian():
    from lowbit.evaluate.memory import proc_status_bytes

    cols = 2048  # 16 MiB a matrix: well above the allocator's and LAPACK's small change
    H = _hessian(cols)
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(3))
    inverse_hessian_factor(H, 0.01, perm)  # first call: BLAS and LAPACK set up their buffers
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = proc_status_bytes("VmHWM")
    U, _, _ = inverse_hessian_factor(H, 0.01, perm)
    matrices = (proc_status_bytes("VmHWM") - start) / (cols * cols * 4)
    assert matrices < 1.5, f"the factorisation peaked at {matrices:.2f} matrices above H (the textbook chain: 7)"
    assert U.shape == (cols, cols)


def test_the_accumulated_hessian_is_two_over_n_xtx_exactly_symmetric():
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(40, 1100, generator=gen) for _ in range(3)]  # 3 row blocks of 512, the last short
    acc = HessianAccumulator(1100)
    for x in xs:
        acc.add(x)
    H = acc.matrix()
    X = torch.cat(xs).double()
    want = (2.0 / X.shape[0] * X.T @ X).float()
    assert acc.tokens == 120 and torch.equal(H, H.T)
    torch.testing.assert_close(H, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(acc.take(), H)  # take builds the same matrix, freeing the sums


def test_the_hessian_does_not_depend_on_how_micro_batches_are_grouped():
    """Two ranks each summing half the micro-batches, then adding their sums, give one process's
    H bit for bit (the float64 sums differ in ulps that float32 rounds away)."""
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(64, 384, generator=gen) * torch.linspace(0.1, 3, 384) for _ in range(16)]
    whole, halves = HessianAccumulator(384), [HessianAccumulator(384), HessianAccumulator(384)]
    for i, x in enumerate(xs):
        whole.add(x)
        halves[i // 8].add(x)
    merged = halves[0]
    merged.sums = [a + b for a, b in zip(halves[0].sums, halves[1].sums)]
    merged.tokens += halves[1].tokens
    assert torch.equal(merged.take(), whole.take())


def test_the_hessian_is_float32_inside_a_bf16_autocast():
    """The accumulator is fed from hooks inside the layer forwards' bf16 autocast: its products
    must not be bf16 (8-bit entries left H indefinite and tiny llamas needing 10x damping)."""
    x = torch.randn(64, 600, generator=torch.Generator().manual_seed(5))
    plain, cast = HessianAccumulator(600), HessianAccumulator(600)
    plain.add(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast.add(x)
    assert torch.equal(cast.take(), plain.take())


def test_a_weight_given_as_a_function_is_made_once_the_hessian_is_factored():
    W = torch.randn(48, 256, generator=torch.Generator().manual_seed(2))
    cfg = GPTQConfig(scheme=IntScheme(4, True, "group", 32), actorder="static")
    acc, seen = _accumulated(256, dead=(5,)), []

    def weight():
        seen.append(all(block is None for block in acc.sums))  # taken (and freed) before W is made
        return W

    given, lazy = gptq_solve(W, _accumulated(256, dead=(5,)), cfg), gptq_solve(weight, acc, cfg)
    assert seen == [True]
    assert torch.equal(given.weight.codes, lazy.weight.codes) and torch.equal(given.row_loss, lazy.row_loss)


PEAK_OF_A_SOLVE = """
import sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[2])
from test_quantize_gptq_memory import _accumulated
from lowbit.evaluate.memory import proc_status_bytes
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.gptq import GPTQConfig
from lowbit.quantize.steps.gptq_solver import gptq_solve
cols = 2048
cfg = GPTQConfig(scheme=IntScheme(4, True, "group", 128), actorder=sys.argv[1])
source = torch.randn(cols, cols, generator=torch.Generator().manual_seed(4)).bfloat16()
gptq_solve(lambda: source.float(), _accumulated(cols), cfg)  # BLAS and LAPACK set up their buffers
acc = _accumulated(cols)
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (the accumulator's sums: one matrix)
start = proc_status_bytes("VmHWM")
gptq_solve(lambda: source.float(), acc, cfg)
print((proc_status_bytes("VmHWM") - start) / (cols * cols * 4))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
@pytest.mark.parametrize("actorder", ["none", "static"])
def test_a_solve_from_an_accumulator_peaks_near_two_matrices(actorder):
    """Hessian and weight both (n, n): taken from its accumulator, factored, swept. At most the
    factor, the weight the caller builds and the sweep's copy are alive at once; the sweep keeps
    int8 codes (a float copy of the result was a fourth matrix, the caller's stacked weight a fifth).
    In a fresh process whose allocator maps every block of 64 KiB or more on its own, so that RSS
    is what is alive, not what glibc's heap kept from earlier tests."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", PEAK_OF_A_SOLVE, actorder, str(Path(__file__).parent)],
                         env=env, capture_output=True, text=True, check=True)
    matrices = float(out.stdout.strip().splitlines()[-1])
    # here 1.74; before (a float result, the stacked weight built first): 2.87
    assert matrices < 2.2, f"the solve peaked at {matrices:.2f} matrices above its accumulator"
