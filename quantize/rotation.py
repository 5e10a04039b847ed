"""Orthogonal matrices for rotating a model's residual stream (the `rotate` step).

A randomized Hadamard matrix (a Hadamard matrix, rows scaled by 1/sqrt(n), columns sign-flipped
by a seeded draw) spreads every channel's outliers evenly over all channels, which is what makes
4-bit and 3-bit grids lose less (QuaRot, SpinQuant). Hadamard matrices are built here from
Sylvester's doubling and Paley's construction (order q + 1 for a prime q = 3 mod 4) and their
Kronecker products, which covers the hidden sizes of the common families (576 = 12·12·4,
896 = 224·4, 2880 = 12·12·20, 7168 = 224·32, every power of two). Any other size takes a seeded
random orthogonal matrix (the QR factor of a Gaussian matrix) if the recipe asks for one.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch


def orthogonal(n: int, kind: str, seed: int) -> torch.Tensor:
    """(n, n) float64 orthogonal matrix: 'hadamard' (randomized by seeded column signs) or 'random'."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "random":
        q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))  # signs fixed: the same seed gives the same matrix
    h = hadamard(n)
    if h is None:
        raise ValueError(f"no Hadamard matrix of order {n} is built here (orders 2^k times products of q + 1 "
                         f"for primes q = 3 mod 4); use rotate: {{kind: random}} for this model")
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1
    return h * signs / n ** 0.5


def hadamard(n: int) -> Optional[torch.Tensor]:
    """An (n, n) matrix of +-1 with H Hᵀ = n I (float64), or None where none is constructed here."""
    factors = hadamard_factors(n)
    if factors is None:
        return None
    h = torch.ones(1, 1, dtype=torch.float64)
    for order in factors:
        h = torch.kron(h, paley(order) if order > 2 else torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    return h


@lru_cache(maxsize=None)
def hadamard_factors(n: int) -> Optional[tuple[int, ...]]:
    """Orders whose Kronecker product is n: 2s and Paley orders q + 1; None where there is no such split."""
    if n == 1:
        return ()
    if n % 2 == 0 and n % 4 != 0 and n != 2:
        return None  # a Hadamard matrix of order > 2 has order divisible by 4
    for order in range(4, n + 1, 4):  # small Paley factors first: small matrices to build
        if n % order == 0 and is_paley_order(order):
            rest = hadamard_factors(n // order)
            if rest is not None:
                return (order,) + rest
    if n % 2 == 0:
        rest = hadamard_factors(n // 2)
        return None if rest is None else (2,) + rest
    return None


def is_paley_order(order: int) -> bool:
    q = order - 1
    return q % 4 == 3 and is_prime(q)


def is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def paley(order: int) -> torch.Tensor:
    """Paley's construction I: for a prime q = 3 mod 4, H = I + S of order q + 1, with S the skew
    matrix [[0, 1ᵀ], [-1, Q]] and Q[i, j] the quadratic character of j - i mod q."""
    q = order - 1
    squares = {(k * k) % q for k in range(1, q)}
    character = torch.tensor([0.0] + [1.0 if k in squares else -1.0 for k in range(1, q)], dtype=torch.float64)
    index = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    s = torch.zeros(order, order, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, character[index]
    return torch.eye(order, dtype=torch.float64) + s
