"""A run across processes: `lowbit run --nproc N` re-launches itself under torchrun (in this
process, through torch.distributed.run), each rank joins the group from torchrun's environment,
rank 0 runs the recipe as one process would (it alone writes: resume folder, checkpoint,
evaluation, report) and the other ranks only calibrate with it, printing nothing but their
errors, then exit 0.

A failing rank prints `lowbit: error: rank R of N: ...` and exits; torchrun then stops the other
ranks (a rank blocked in a collective also fails once its peer is gone, or after
LOWBIT_DIST_TIMEOUT seconds, and exits PEER_EXIT) and the launcher ends with one line naming the
rank that failed first on its own and how (its exit code or the signal that killed it).
"""
from __future__ import annotations

import os
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import Optional

from lowbit.calibrate.arch import arch_for
from lowbit.calibrate.distributed import broadcast_json, close, init_from_env, launched_size, world
from lowbit.calibrate.hardware import resolve_device
from lowbit.calibrate.models import load_model
from lowbit.quantize.steps.context import StepContext

from .stepping import ResidentLayers, apply_steps, float_model, rank_samples, stored_dtype, timer

PEER_EXIT = 3  # a rank's exit code when a collective failed under it: another rank is the cause


def relaunch(argv: list[str], nproc: int, script: Optional[str] = None) -> int:
    """Run `lowbit ARGV` (or `python SCRIPT ARGV`) as nproc torchrun ranks on this machine; the
    exit code: 0, or 1 after a line naming the first rank that failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    # the cores split between the ranks (torchrun would give each one thread)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    entry = [script] if script else ["-m", "lowbit.app.cli"]
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", *entry, *without_nproc(argv)]))
    except ChildFailedError as err:
        rank, failure = root_cause(err.failures)
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with code {failure.exitcode}")
        print(f"lowbit: error: rank {rank} of {nproc} {how} (its error, if it printed one, is above); "
              "the other ranks were stopped", file=sys.stderr)
        return 1
    return 0


def root_cause(failures: dict) -> tuple:
    """(rank, failure) of the rank that failed first on its own: ranks that exited PEER_EXIT (after
    a peer) or by SIGTERM (torchrun stopping them) come last; torchrun's own pick orders by whole
    seconds only, so a tie could name a rank that was only stopped."""
    after_peer = (PEER_EXIT, -signal.SIGTERM)
    rank = min(failures, key=lambda r: (failures[r].exitcode in after_peer, failures[r].timestamp, r))
    return rank, failures[rank]


def without_nproc(argv: list[str]) -> list[str]:
    """argv less --nproc N / --nproc=N (torchrun would read it as its own --nproc-per-node)."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--nproc="):
            skip = False
            continue
        skip = arg == "--nproc"
        if not skip:
            out.append(arg)
    return out


@contextmanager
def as_rank():
    """Join torchrun's group for the block (nothing in one process); ranks but 0 print nothing
    but their errors (see error_stream)."""
    w = init_from_env()
    if w.size > 1 and not w.main:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        yield w
    finally:
        close()


def launched() -> bool:
    return launched_size() > 1


def error_prefix() -> str:
    """'rank R of N: ' under torchrun, so an error says which rank raised it; else ''."""
    return f"{world().describe()}: " if world().size > 1 else ""


def error_stream():
    """Where errors go: the real stderr, also on ranks whose output is silenced."""
    return sys.__stderr__ if world().size > 1 else sys.stderr


def report_crash(err: BaseException) -> None:
    """An unexpected exception's traceback, to the real stderr, naming the rank."""
    print(f"lowbit: error: {error_prefix()}{type(err).__name__}: {err}", file=error_stream())
    traceback.print_exception(err, file=error_stream())


def calibrate_only(recipe) -> dict:
    """What a rank other than 0 runs: load, then each step with rank 0 (run.quantize_and_export's
    collectives, in its order), unless rank 0 says the checkpoint is already exported."""
    if not broadcast_json(None, 0):  # rank 0: False when resuming an exported checkpoint
        return {}
    model, tokenizer, _ = load_model(recipe.model, trust_remote_code=recipe.trust_remote_code,
                                     allow_pickle=recipe.allow_pickle)
    timed = timer({})
    arch = arch_for(model)
    ctx = StepContext(model, arch, recipe.ignore, lambda: rank_samples(recipe, tokenizer, timed),
                      device=resolve_device(recipe.calibration.device), reference=float_model(recipe),
                      stored_dtype=stored_dtype(recipe))
    apply_steps(recipe, ctx, ResidentLayers(model, arch, lambda index: None), timed)  # rank 0 keeps the layers
    return {}
