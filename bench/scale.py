"""How memory and time grow with the model: random Llama models of real widths, resident against streamed.

    python bench/scale.py                       # perplexity at Llama-3-8B widths, 2 and 4 decoder layers
    python bench/scale.py --layers 2 4 8 --tokens 1024 --json
    python bench/scale.py --task rtn gptq --layers 4 8 --modes streamed --json   # calibrate + export
    python bench/scale.py --moe --task gptq --modes streamed --samples 2 --json  # Qwen3-30B-A3B widths

Each model (random weights, std 0.02, 128k vocabulary, untied head, the smollm2 tokenizer) is written
once as bf16 safetensors shards under the lowbit cache (bench-models/). Each measurement runs in a
fresh process, so its peak RSS is its own: the perplexity protocol on `--tokens` tokens of the wiki
text in 512-token windows, resident (the whole model loaded in float32) and streamed (one decoder
layer at a time, evaluate/perplexity_streamed.py). Both must give the same figure; the peak of the
streamed one should not grow with the number of layers, the resident one's grows by a layer's size.
`--task rtn|gptq` measures `w4a16-rtn` / `w4a16-gptq` (group 128; GPTQ on --samples x 512 wiki
tokens) up to the written checkpoint, without its evaluation: peak RSS (and peak GPU memory with
--device cuda), seconds, seconds per layer and the sha256 of model.safetensors, which the resident
and the streamed run must share.
`--moe` builds Qwen3-MoE models at Qwen3-30B-A3B widths instead (hidden 2048, 128 experts of
inner width 768, top-8, 151,936-token vocabulary): a decoder layer holds 0.6 B expert parameters
(2.4 GB in float32), every expert calibrated (calibration.moe: all_experts).
`--json` ends the output with one JSON line: the command, its date, commit, CPU and GPU, and the rows
(what docs/results/ keeps and bench/results_tables.py renders).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from lowbit.calibrate.provenance import provenance

LLAMA3_8B = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
QWEN3_30B_A3B = dict(hidden=2048, intermediate=6144, heads=32, kv_heads=4, vocab=151936, experts=128,
                     expert_intermediate=768, top_k=8, head_dim=128)


def model_folder(layers: int, widths: dict) -> Path:
    from lowbit.calibrate.cache import cache_dir

    name = "llama-{hidden}-{intermediate}-{heads}h{kv_heads}kv-{vocab}v".format(**widths) + f"-{layers}l"
    if "experts" in widths:
        name = "qwen3moe-{hidden}-{experts}x{expert_intermediate}-top{top_k}-{vocab}v".format(**widths) + f"-{layers}l"
    return cache_dir("bench-models") / name


def build_model(folder: Path, layers: int, widths: dict) -> Path:
    """Write the random model once (bf16 shards, tokenizer); a finished folder is reused."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from lowbit.calibrate.models import resolve_model_path

    if (folder / "model.safetensors.index.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    common = dict(hidden_size=widths["hidden"], intermediate_size=widths["intermediate"],
                  num_hidden_layers=layers, num_attention_heads=widths["heads"],
                  num_key_value_heads=widths["kv_heads"], vocab_size=widths["vocab"],
                  max_position_embeddings=8192, tie_word_embeddings=False, initializer_range=0.02,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if "experts" in widths:
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(**common, num_experts=widths["experts"], moe_intermediate_size=widths["expert_intermediate"],
                                num_experts_per_tok=widths["top_k"], head_dim=widths["head_dim"], norm_topk_prob=True)
    else:
        config = LlamaConfig(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # built in bf16: half the memory
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(staging, max_shard_size="2GB")
    tokenizer.save_pretrained(staging)
    staging.rename(folder)  # whole or absent
    return folder


def measure(mode: str, folder: Path, tokens: int) -> dict:
    """In this process: perplexity resident or streamed, its seconds and this process's peak RSS."""
    from transformers import AutoTokenizer

    from lowbit.calibrate.models import load_model
    from lowbit.evaluate.config import PerplexityProtocol
    from lowbit.evaluate.perplexity import perplexity
    from lowbit.evaluate.perplexity_streamed import streamed_perplexity

    protocol = PerplexityProtocol(max_tokens=tokens)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    start = time.perf_counter()
    if mode == "resident":
        result = perplexity(load_model(str(folder))[0], tokenizer, protocol)
    else:
        result = streamed_perplexity(folder, tokenizer, protocol)
    return {"mode": mode, "nll_per_token": result["nll_per_token"], "seconds": time.perf_counter() - start,
            "peak_rss_gib": peak_rss_bytes() / 2**30}


def calibrate(mode: str, folder: Path, task: str, samples: int, device: str) -> dict:
    """In this process: w4a16-<task> up to its exported checkpoint, resident or streamed."""
    import hashlib
    import shutil
    import tempfile

    import torch

    from lowbit.app.resume import RunProgress
    from lowbit.app.run import quantize_and_export
    from lowbit.recipes.schema import load_recipe

    recipe = load_recipe(f"w4a16-{task}", (f"model={folder}", f"calibration.streaming={mode == 'streamed'}",
                                          f"calibration.samples={samples}", "calibration.seq_len=512",
                                          f"calibration.device={device}", "scheme.group_size=128",
                                          "evaluate.baseline=false"))
    out = Path(tempfile.mkdtemp(prefix="scale-", dir=folder.parent)) / "run"
    start = time.perf_counter()
    try:
        with RunProgress.open(out, recipe.to_dict(), False) as progress:
            quantize_and_export(recipe, progress)
            digest = hashlib.sha256()
            with open(progress.checkpoint / "model.safetensors", "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    seconds = time.perf_counter() - start
    gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"mode": mode, "task": task, "seconds": seconds, "peak_rss_gib": peak_rss_bytes() / 2**30,
            "peak_gpu_gib": gpu, "model_safetensors_sha256": digest.hexdigest()[:16]}


def peak_rss_bytes() -> int:
    """This process's own high-water RSS. Not getrusage's ru_maxrss: Linux carries the parent's
    high-water mark into a child across fork and exec, so a child of a big parent reads high."""
    from lowbit.evaluate.memory import proc_status_bytes

    try:
        return proc_status_bytes("VmHWM")
    except (OSError, ValueError):  # no /proc: macOS, whose ru_maxrss is in bytes
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def in_fresh_process(mode: str, folder: Path, tokens: int, task: str = "ppl", samples: int = 8,
                     device: str = "cpu") -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(folder), str(tokens), task, str(samples),
                          device], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} on {folder} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def weight_gib(folder: Path, bytes_per_param: int) -> float:
    from lowbit.calibrate.streaming import ShardedWeights

    return ShardedWeights(folder).numel() * bytes_per_param / 2**30


def describe(row: dict) -> str:
    head = (f"{row['layers']:2d} layers  {row['float32_weights_gib']:6.2f} GiB float32  {row['task']:<4} "
            f"{row['mode']:<9} peak RSS {row['peak_rss_gib']:6.2f} GiB  {row['seconds']:7.1f} s")
    if row["task"] == "ppl":
        return head + f"  nll {row['nll_per_token']:.6f}"
    gpu = f"  peak GPU {row['peak_gpu_gib']:.2f} GiB" if row.get("peak_gpu_gib") is not None else ""
    return head + f"  {row['seconds'] / row['layers']:6.1f} s/layer{gpu}  sha256 {row['model_safetensors_sha256']}"


def record(argv: list[str], rows: list[dict]) -> dict:
    """The --json output: how it was run, when, at which commit and on what machine, then the rows."""
    return {"command": " ".join(["python bench/scale.py", *argv]), **provenance(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=1024, help="evaluation tokens (512-token windows)")
    parser.add_argument("--modes", nargs="+", default=["resident", "streamed"], choices=["resident", "streamed"])
    parser.add_argument("--task", nargs="+", default=["ppl"], choices=["ppl", "rtn", "gptq"],
                        help="ppl: the perplexity protocol; rtn, gptq: w4a16-<task> up to its checkpoint")
    parser.add_argument("--samples", type=int, default=8, help="calibration samples of 512 tokens (gptq)")
    parser.add_argument("--device", default="cpu", help="calibration device (rtn, gptq): cpu, cuda, cuda:N")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE at Qwen3-30B-A3B widths, not Llama-3-8B")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, folder, tokens, task, samples, device = args.child
        row = (measure(mode, Path(folder), int(tokens)) if task == "ppl"
               else calibrate(mode, Path(folder), task, int(samples), device))
        print(json.dumps(row))
        return
    rows = []
    for layers in args.layers:
        widths = QWEN3_30B_A3B if args.moe else LLAMA3_8B
        folder = build_model(model_folder(layers, widths), layers, widths)
        for task in args.task:
            for mode in args.modes:
                row = {"layers": layers, "model": "qwen3-moe" if args.moe else "llama", "float32_weights_gib": weight_gib(folder, 4), "task": task,
                       **in_fresh_process(mode, folder, args.tokens, task, args.samples, args.device)}
                rows.append(row)
                print(describe(row), flush=True)
    if args.json:
        print(json.dumps(record(sys.argv[1:], rows)))


if __name__ == "__main__":
    main()
