"""Programs the distributed tests run as torchrun ranks (python -m torch.distributed.run ... this
file MODE ...): each is a real process of a real gloo group.

  hessian OUT      the Hessian of seeded activations, each rank accumulating its share of the
                   samples micro-batch by micro-batch, then merged; rank 0 writes it (and the
                   tokens) to OUT, a safetensors file
  broadcast OUT    rank 1 solves a GPTQ problem and broadcast_tree sends the result; rank 0
                   writes what it received
  fault KIND ARGS  `lowbit ARGS`, where rank 1 faults in its first GPTQ solve: KIND raise (a
                   ValueError), kill (SIGKILL to itself) or hang (sleeps 600 s)
"""
import os
import signal
import sys
import time

import torch
from safetensors.torch import save_file

SAMPLES, TOKENS, COLUMNS, UNIT = 20, 16, 24, 8  # 20 samples: shares of 8 and 12 (not equal)


def activations() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, TOKENS, COLUMNS, generator=gen) * torch.linspace(0.1, 3, COLUMNS)


def hessian(out: str) -> None:
    from lowbit.calibrate.distributed import init_from_env, sample_share
    from lowbit.quantize.steps.gptq_solver import HessianAccumulator
    from lowbit.quantize.steps.layerwise import merge_ranks

    w = init_from_env()
    share = activations()[sample_share(SAMPLES, UNIT)]
    acc = HessianAccumulator(COLUMNS)
    for start in range(0, len(share), UNIT):
        acc.add(share[start : start + UNIT].reshape(-1, COLUMNS))
    local_tokens = acc.tokens
    merge_ranks(acc)
    if w.main:
        save_file({"H": acc.take(), "tokens": torch.tensor([acc.tokens, local_tokens])}, out)


def broadcast(out: str) -> None:
    from lowbit.calibrate.distributed import broadcast_tree, init_from_env
    from lowbit.quantize.grids.integer import IntScheme
    from lowbit.quantize.steps.gptq import GPTQConfig
    from lowbit.quantize.steps.gptq_solver import gptq_solve

    w = init_from_env()
    result = None
    if w.rank == 1:
        x = activations().reshape(-1, COLUMNS)
        W = torch.randn(6, COLUMNS, generator=torch.Generator().manual_seed(1))
        result = gptq_solve(W, 2 * x.t() @ x / len(x), GPTQConfig(scheme=IntScheme(4, False, "group", 8)))
    got = broadcast_tree(result, 1)
    if w.main:
        save_file({"codes": got.weight.codes, "scale": got.weight.scale, "zero": got.weight.zero,
                   "row_loss": got.row_loss, "retries": torch.tensor([got.retries]),
                   "frac": torch.tensor([got.dampening_frac]),
                   "bits": torch.tensor([got.weight.scheme.bits, got.weight.scheme.group_size])}, out)


def fault(kind: str, argv: list[str]) -> int:
    import lowbit.quantize.steps.gptq_solver as gptq_solver
    from lowbit.app.cli import main

    def faulty(*args, **kwargs):
        if kind == "raise":
            raise ValueError("injected fault: rank 1 cannot solve this layer")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)

    if os.environ["RANK"] == "1":
        gptq_solver.gptq_solve = faulty
    return main(argv)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "fault":
        sys.exit(fault(sys.argv[2], sys.argv[3:]))
    from lowbit.calibrate.distributed import close

    try:
        {"hessian": hessian, "broadcast": broadcast}[mode](sys.argv[2])
    finally:  # left to interpreter exit, gloo's threads sometimes die with "terminate called ..."
        close()
