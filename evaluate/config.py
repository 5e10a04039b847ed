"""Evaluation options and the pinned perplexity protocol.

Defaults keep a CPU run quick: KL on the first 4096 evaluation tokens, speed, lm-eval and the
bitsandbytes baselines off until a recipe (or `--set evaluate.speed.enabled=true`) asks for them.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from lowbit.calibrate.messages import short_repr


class MissingPackageError(ImportError):
    """An option asks for an optional package that is not installed (the message says which)."""


def lm_eval_missing(tasks, reason: str = "not installed") -> MissingPackageError:
    return MissingPackageError(f"evaluate.lm_eval.tasks {short_repr(list(tasks))} needs lm-eval ({reason}): "
                               "pip install 'lowbit[eval]', or leave the tasks empty")


def require_evaluation_packages(cfg: "EvaluateConfig") -> None:
    """The optional packages the evaluation options need, checked before a run does any work
    (bitsandbytes is not: an unavailable baseline is reported as such, not fatal)."""
    if cfg.lm_eval.tasks and importlib.util.find_spec("lm_eval") is None:
        raise lm_eval_missing(cfg.lm_eval.tasks)


@dataclass(frozen=True)
class PerplexityProtocol:
    """Pinned so that figures from different runs compare; recorded in results.json."""

    dataset: str = "wiki"  # built-in corpora use their evaluation part
    context_len: int = 512  # tokens per window, BOS included
    stride: int = 512  # >= context_len - BOS: disjoint windows; smaller: sliding, each token scored once
    max_tokens: int = 16384  # tokens of the evaluation text used (before windowing)
    bos: bool = True  # prepend the tokenizer's BOS (EOS if it has none) to every window; not scored

    def __post_init__(self):
        if not 1 <= self.stride <= self.context_len:
            raise ValueError(f"stride must be between 1 and context_len ({self.context_len}), got {self.stride}")
        if self.context_len < 2 or self.max_tokens < self.context_len:
            raise ValueError("need context_len >= 2 and max_tokens >= context_len")


@dataclass(frozen=True)
class KLConfig:
    """KL(baseline || quantized) of next-token distributions, on the perplexity windows."""

    enabled: bool = True
    max_tokens: int = 4096  # first tokens of the perplexity text (two forward passes each)

    def __post_init__(self):
        if self.max_tokens < 2:
            raise ValueError(f"kl.max_tokens must be at least 2, got {self.max_tokens}")


@dataclass(frozen=True)
class SpeedConfig:
    """Prefill / decode timings; greedy decoding from a prompt cut from the evaluation text."""

    enabled: bool = False
    prompt_len: int = 128
    new_tokens: int = 32
    batch_sizes: tuple[int, ...] = (1, 4)
    warmup: int = 1  # discarded runs (allocator, kernel selection)
    repeats: int = 3  # timed runs; medians are reported
    # runtime kernels for quantized linears while timing (quantize/backends.py): auto picks the
    # fastest for the device; reference times dequantize + matmul
    backend: Literal["auto", "reference", "cpu_avx512", "cpu_avx2", "cuda_int4", "cuda_int8", "triton"] = "auto"
    # how decode steps run: eager (the model's own growing cache), static (a preallocated KV
    # cache), compiled (static cache + torch.compile; CUDA graphs on a GPU); auto: compiled on
    # CUDA, eager on the CPU (compiling costs more than a short CPU measurement saves)
    decode: Literal["auto", "eager", "static", "compiled"] = "auto"

    def __post_init__(self):
        if self.prompt_len < 1 or self.new_tokens < 2 or self.repeats < 1 or self.warmup < 0:
            raise ValueError("speed needs prompt_len >= 1, new_tokens >= 2, repeats >= 1, warmup >= 0")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"speed.batch_sizes must be positive integers, got {short_repr(list(self.batch_sizes))}")


@dataclass(frozen=True)
class MemoryConfig:
    """Predicted footprint (weights + KV cache + activations) and the budget fit table."""

    batch: int = 1  # for the predicted total
    context: int = 2048  # tokens per sequence for the predicted total
    kv_bytes: Optional[float] = None  # bytes per cached K/V element; None: 2 (16-bit), or a kv step's
    act_bytes: float = 2.0  # bytes per activation element at inference (16-bit)
    budgets_gb: tuple[float, ...] = (8.0, 24.0, 80.0)
    fit_context: int = 4096  # context at which the fit table counts concurrent sequences
    measure_peak: bool = True  # measured peak during one prefill of batch x min(context, measure_context)
    measure_context: int = 512  # cap on the measured prefill's tokens (CPU time)
    measure_decode_tokens: int = 4  # greedy tokens decoded after the measured prefill
    prefill_chunk: Optional[int] = None  # prompt tokens per forward in the measured prefill (None: all)
    # measure the memory-lean CPU runtime (codes packed as stored, 16-bit embedding): what a plan's
    # memory budget counts (quantize/runtime/compact.py)
    lean_runtime: bool = False
    # CPU: measure in a fresh process that loads the checkpoint once (a long-lived process's
    # high-water mark holds earlier work's pages); "process": in this one (GPUs always are)
    measure_in: Literal["subprocess", "process"] = "subprocess"

    def __post_init__(self):
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"memory.prefill_chunk must be positive, got {self.prefill_chunk}")
        if self.measure_context < 1 or self.measure_decode_tokens < 0:
            raise ValueError("memory needs measure_context >= 1 and measure_decode_tokens >= 0, got "
                             f"{self.measure_context} and {self.measure_decode_tokens}")
        if self.batch < 1 or self.context < 1 or self.fit_context < 1:
            raise ValueError(f"memory needs batch, context and fit_context >= 1, got {self.batch}, {self.context} "
                             f"and {self.fit_context}")
        sizes = {"act_bytes": (self.act_bytes,), "budgets_gb": self.budgets_gb,
                 "kv_bytes": () if self.kv_bytes is None else (self.kv_bytes,)}
        for key, values in sizes.items():  # NaN compares false to every bound: said as such
            if not all(math.isfinite(v) and v > 0 for v in values):
                raise ValueError(f"memory.{key} must be finite and positive, got {short_repr(list(values))}")


@dataclass(frozen=True)
class LMEvalConfig:
    """lm-eval tasks on the in-memory model: lowbit_wiki_cloze, lowbit_reviews_sentiment or any
    lm-eval task whose data is reachable."""

    tasks: tuple[str, ...] = ()
    limit: Optional[int] = 200  # examples per task; None: all
    batch_size: int = 8
    num_fewshot: Optional[int] = None


@dataclass(frozen=True)
class EvaluateConfig:
    # where perplexity, KL, peak memory and speed run, model and reference alike: auto is a GPU in
    # bfloat16 where torch sees one, else the CPU in float32 (evaluate/placement.py)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    perplexity: PerplexityProtocol = field(default_factory=PerplexityProtocol)
    baseline: bool = True  # also measure the unquantized model (cached per model and protocol)
    kl: KLConfig = field(default_factory=KLConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    lm_eval: LMEvalConfig = field(default_factory=LMEvalConfig)
    # load-time bitsandbytes quantization of the same model, measured with the same protocol
    bnb_baselines: tuple[Literal["nf4", "llm_int8"], ...] = ()
    # more texts scored as perplexity.dataset is (perplexity, the baseline's, KL): text the recipe did
    # not calibrate on, e.g. [news, reviews] for a recipe calibrated on wiki
    held_out: tuple[str, ...] = ()

    def unwritten_keys(self) -> list[str]:
        """Keys a run's recipe.yaml and results.json leave out, as recipes before them were written: held_out
        where no texts were asked for (adding it changed every shipped recipe's recipe.yaml)."""
        return [] if self.held_out else ["held_out"]

    def __post_init__(self):
        named = [name for name in self.held_out if name != self.perplexity.dataset]
        if "" in named or len(set(named)) != len(named):
            raise ValueError(f"held_out: each text once and none empty, got {short_repr(list(self.held_out))}")
