"""distill: the quantized model's scales and norms learned end to end against the float model
(EfficientQAT's end-to-end stage, Chen et al. 2024, with the float model as the teacher).

After the weight steps have fixed every code, each integer group's scale and each GGML block's
scale (through a factor exp(t), t from 0) and every norm's weight are trained with Adam for
`epochs` passes over the calibration samples, so that the quantized model's next-token
distributions match the float model's (KL divergence, mean over tokens). The learning rates fall
to 0 on a cosine (`samples` learns on that many of them, drawn at random). The float model is loaded
again once, its final hidden states kept for every sample learned on (samples x seq_len x hidden in the
forward dtype) with its LM head, then freed.
Codes never change, so the checkpoint, the exports and the audit are those of the steps before; a
layer-wise step ends per layer, this one sees what every layer's error does to the logits, which
the held-out texts show most.
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from lowbit.calibrate.distributed import all_max, all_sum, ranks_agree, sum_int, sum_numbers, world
from lowbit.calibrate.final_hidden import final_hidden, post_processed_logits
from lowbit.calibrate.hardware import denormals_flushed
from lowbit.calibrate.progress import Progress
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.distill_params import LearnedNorms, LearnedScales
from lowbit.quantize.steps.layerwise import resolve_forward_dtype
from lowbit.quantize.steps.spec import StepSpec

LOGITS_CHUNK_BYTES = 32 * 2**20  # float32 logits of one chunk of tokens in the loss


@dataclass(frozen=True)
class DistillConfig:
    epochs: int = 1  # passes over the calibration samples
    samples: int = 0  # how many of them to learn on, drawn at random by `seed` (0: all); the float model runs on those
    batch: int = 2  # calibration samples per step
    learning_rate: float = 2e-3  # Adam's first step on each scale's log factor (a relative change)
    norm_learning_rate: float = 1.2e-3  # Adam's first step on the norms' weights
    seed: int = 0  # the order samples are drawn in, each epoch
    forward_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # autocast for the forwards, as gptq's

    def __post_init__(self):
        if self.epochs < 1 or self.batch < 1:
            raise ValueError(f"distill: epochs and batch must be positive, got {self.epochs}, {self.batch}")
        if self.samples < 0:
            raise ValueError(f"distill: samples must be 0 (all) or a positive count, got {self.samples}")
        for name in ("learning_rate", "norm_learning_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"distill: {name} must be in [0, 1], got {getattr(self, name)}")
        if self.forward_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"distill: forward_dtype must be auto, bfloat16 or float32, got {self.forward_dtype!r}")


def apply(ctx: StepContext, cfg: DistillConfig) -> dict:
    model, device = ctx.model, ctx.device
    post_processed_logits(model.config, "distill")  # refuse before the float model is loaded again
    if ctx.reference is None:
        raise ValueError("distill: this run has no float model to learn from (it needs the model resident)")
    dtype = resolve_forward_dtype(cfg.forward_dtype, device)
    samples = drawn(ctx.batches, cfg.samples, cfg.seed)
    steps = cfg.epochs * math.ceil(int(all_max(torch.tensor(len(samples)))) / cfg.batch)  # alike on every rank
    teacher_hidden, teacher_head = teacher_states(ctx, samples, cfg.batch, dtype)
    with whole_on(model, device):
        scales, norms = LearnedScales(model, ctx.stored_dtype), LearnedNorms(model, ctx.stored_dtype)
        print(f"[distill] {len(scales)} scale tensors and {len(norms)} norms, {steps} steps of {cfg.batch} samples "
              f"({cfg.epochs} epoch(s)), forwards in {str(dtype).removeprefix('torch.')}", file=sys.stderr)
        with scales.learning(), norms.learning(), denormals_flushed():
            params = [{"params": scales.parameters(), "lr": cfg.learning_rate},
                      {"params": norms.parameters(), "lr": cfg.norm_learning_rate}]
            with trainable(model, params[1]["params"]):
                losses = descend(model, params, samples, teacher_hidden, teacher_head, steps, cfg, dtype, device)
    return {"scales": len(scales), "fixed": scales.fixed, "norms": len(norms), "steps": steps,
            "forward_dtype": str(dtype).removeprefix("torch."),
            **losses}


def teacher_states(ctx: StepContext, samples: torch.Tensor, batch: int, dtype) -> tuple[torch.Tensor, torch.nn.Module]:
    """The float model's final hidden states on every sample (kept where the samples are), and its
    LM head; the rest of the float model is freed before training begins."""
    teacher = ctx.reference().to(ctx.device).eval()
    progress = Progress("distill: float model", len(samples), "samples")
    kept = []
    with torch.no_grad():
        for i in range(0, len(samples), batch):
            ids = samples[i:i + batch].to(ctx.device)
            with autocast(ctx.device, dtype):
                kept.append(final_hidden(teacher, ids).to(dtype).cpu())
            progress.advance(len(ids))
    head = teacher.get_output_embeddings()
    head.requires_grad_(False)
    return torch.cat(kept), head


def descend(model, params, samples, teacher_hidden, teacher_head, steps: int, cfg: DistillConfig, dtype,
            device) -> dict:
    """Adam over `steps` batches; the learning rates fall on a cosine to 0. Returns the mean KL per
    token of the first epoch's steps and of the last's."""
    optimizer = torch.optim.Adam(params)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))
    order = sample_order(len(samples), cfg.batch, steps, cfg.seed)
    trained = [p for group in params for p in group["params"]]
    per_epoch = steps // cfg.epochs
    progress = Progress("distill", steps, "steps")
    first, last = [], []
    for step, picked in enumerate(order):
        ids = samples[picked].to(device)
        with autocast(device, dtype):
            hidden = final_hidden(model, ids)
        tokens = sum_int(ids.numel())  # every rank's: the gradients summed below are of the mean over all
        optimizer.zero_grad(set_to_none=True)
        summed_kl = kl_backward(hidden, teacher_hidden[picked].to(device), model.get_output_embeddings(),
                                teacher_head, tokens, dtype)
        summed_grads(trained)
        optimizer.step()
        schedule.step()
        value = (summed_kl if world().size == 1 else sum_numbers(summed_kl)[0]) / tokens
        if step < per_epoch:
            first.append(value)
        if step >= steps - per_epoch:
            last.append(value)
        progress.step(f"KL {value:.4f}")
    check_ranks_agree(trained)
    return {"kl_first_epoch": round(sum(first) / len(first), 5), "kl_last_epoch": round(sum(last) / len(last), 5)}


def drawn(samples: torch.Tensor, wanted: int, seed: int) -> torch.Tensor:
    """`wanted` of the samples (each rank its share), drawn at random, kept in their order; all for 0."""
    share = math.ceil(wanted / world().size)
    if not wanted or share >= len(samples):
        return samples
    picked = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed))[:share]
    return samples[picked.sort().values]


def sample_order(samples: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Each step's sample indices: every sample once per epoch, each epoch in a fresh order."""
    gen = torch.Generator().manual_seed(seed)
    flat: list[int] = []
    while len(flat) < steps * batch:
        flat += torch.randperm(samples, generator=gen).tolist()
    return [torch.tensor(flat[i * batch:(i + 1) * batch]) for i in range(steps)]


def kl_backward(hidden: torch.Tensor, teacher_hidden: torch.Tensor, head, teacher_head, tokens: int,
                dtype) -> float:
    """Backpropagate KL(teacher || student) of next-token distributions, summed over the batch's
    tokens and divided by `tokens`; returns the sum. The logits are made and differentiated a chunk
    of tokens at a time into the final hidden states' gradient, which then runs back through the
    model once: memory holds one chunk's logits, whatever the vocabulary, and none is computed twice."""
    hidden_grad_at = hidden.detach().flatten(0, -2).requires_grad_()
    teacher_hidden = teacher_hidden.flatten(0, -2)
    rows = max(1, LOGITS_CHUNK_BYTES // (4 * teacher_head.weight.shape[0]))
    total = 0.0
    for start in range(0, len(hidden_grad_at), rows):
        part = slice(start, start + rows)
        with autocast(hidden.device, dtype):
            with torch.no_grad():
                wanted = F.log_softmax(teacher_head(teacher_hidden[part]).float(), dim=-1)
            mine = F.log_softmax(head(hidden_grad_at[part]).float(), dim=-1)
        kl = F.kl_div(mine, wanted, log_target=True, reduction="sum")
        (kl / tokens).backward()
        total += float(kl.detach())
    hidden.backward(hidden_grad_at.grad.view_as(hidden))
    return total


def summed_grads(params) -> None:
    """Every rank steps with the gradients summed over all ranks, so all learn the same values."""
    if world().size == 1:
        return
    for p in params:
        if p.grad is not None:
            p.grad = all_sum(p.grad)


def check_ranks_agree(params) -> None:
    """Every rank must hold the same learned values: the checkpoint is rank 0's alone."""
    if not ranks_agree(params):
        raise RuntimeError("distill: the ranks learned different scales or norms; their gradients were not "
                           "summed alike (a bug in lowbit: please report it)")


def autocast(device, dtype):
    """The forwards' autocast: `dtype` on `device`, off for float32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


@contextlib.contextmanager
def whole_on(model, device):
    """The whole model on the calibration device for the step (a resident run keeps it where it was
    loaded and walks one layer at a time to the device), and back where it was after."""
    home = next(model.parameters()).device
    model.to(device)
    try:
        yield
    finally:
        model.to(home)


class trainable:
    """Within it only `params` (of the model's own) take gradients."""

    def __init__(self, model, params):
        self.model, self.params = model, params

    def __enter__(self):
        self.had = [p for p in self.model.parameters() if p.requires_grad]
        for p in self.had:
            p.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)
        return self

    def __exit__(self, *exc):
        for p in self.params:
            p.requires_grad_(False)
        for p in self.had:
            p.requires_grad_(True)


SPEC = StepSpec("distill", DistillConfig, apply,
                "scales and norms learned end to end against the float model's next-token distributions",
                streamed=lambda cfg: "distill trains the whole model at once: it needs the model resident",
                follows_weights=True)
