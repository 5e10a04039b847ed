"""Calibration across processes, for real: torchrun ranks in a gloo group on this CPU.

The all-reduced Hessian is the Hessian of all samples; a GPTQ result crosses ranks intact; 2 ranks
write the checkpoint 1 rank writes (up to summation order: >= 99.9% of the codes identical,
perplexity within 0.2%); and a rank that raises, is killed or hangs stops the run with an error
naming it, without the others waiting forever.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dist_workers
from tiny_models import save_tiny_llama
from lowbit.calibrate.distributed import World, backend_device, group_backend, sample_share
from lowbit.calibrate.hardware import rank_device
from lowbit.quantize.grids.integer import unpack_codes
from lowbit.quantize.steps.gptq_solver import HessianAccumulator

WORKERS = Path(dist_workers.__file__)
QUICK = ["--set", "calibration.seq_len=64", "--set", "evaluate.baseline=false",
         "--set", "evaluate.kl.enabled=false", "--set", "evaluate.memory.measure_peak=false",
         "--set", "evaluate.perplexity.max_tokens=256", "--set", "evaluate.perplexity.context_len=128",
         "--set", "evaluate.perplexity.stride=128"]


def torchrun(args: list[str], cwd, env=None, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("samples,size", [(1, 1), (16, 2), (20, 2), (17, 2), (64, 3), (40, 4)])
def test_sample_shares_cover_every_sample_once_in_whole_micro_batches(samples, size):
    shares = [sample_share(samples, 8, World(rank, size)) for rank in range(size)]
    covered = [i for s in shares for i in range(samples)[s]]
    assert covered == list(range(samples))  # contiguous, in rank order, each sample once
    assert all(s.stop > s.start for s in shares)  # no rank without samples
    assert all(s.start % 8 == 0 for s in shares)  # each rank's micro-batches are one process's


def test_too_few_samples_for_the_ranks_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"calibration.samples=8 makes 1 micro-batches .* 2 ranks"):
        sample_share(8, 8, World(1, 2))


def test_all_reduced_hessian_equals_the_hessian_of_all_samples(tmp_path):
    done = torchrun([str(WORKERS), "hessian", str(tmp_path / "H.safetensors")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = load_file(str(tmp_path / "H.safetensors"))
    x = dist_workers.activations()
    whole = HessianAccumulator(x.shape[-1])
    for start in range(0, len(x), dist_workers.UNIT):
        whole.add(x[start : start + dist_workers.UNIT].reshape(-1, x.shape[-1]))
    total, local = merged["tokens"].tolist()
    assert total == whole.tokens == x.shape[0] * x.shape[1] and local < total  # rank 0 held a share
    assert torch.equal(merged["H"], whole.take())  # float64 sums: the same float32 H, bit for bit


def test_a_gptq_result_crosses_ranks_intact(tmp_path):
    done = torchrun([str(WORKERS), "broadcast", str(tmp_path / "r.safetensors")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = load_file(str(tmp_path / "r.safetensors"))
    from lowbit.quantize.grids.integer import IntScheme
    from lowbit.quantize.steps.gptq import GPTQConfig
    from lowbit.quantize.steps.gptq_solver import gptq_solve

    x = dist_workers.activations().reshape(-1, dist_workers.COLUMNS)
    W = torch.randn(6, dist_workers.COLUMNS, generator=torch.Generator().manual_seed(1))
    want = gptq_solve(W, 2 * x.t() @ x / len(x), GPTQConfig(scheme=IntScheme(4, False, "group", 8)))
    for name, tensor in (("codes", want.weight.codes), ("scale", want.weight.scale), ("zero", want.weight.zero),
                         ("row_loss", want.row_loss)):
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert got["bits"].tolist() == [4, 8] and got["retries"].item() == want.retries


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("dist") / "tiny", layers=3)


def lowbit_run(recipe: str, model, out: Path, nproc: int, extra=()) -> subprocess.CompletedProcess:
    """`lowbit run` in a second process (cwd: out's folder, not the repository root)."""
    args = [sys.executable, "-m", "lowbit.app.cli", "run", recipe, "--model", str(model),
            "--output", str(out), "--nproc", str(nproc), *QUICK, *extra]
    return subprocess.run(args, cwd=out.parent, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def checkpoint_codes(folder: Path) -> dict[str, torch.Tensor]:
    """Every quantized tensor's codes: packed integers unpacked, int8 and float8 as bytes."""
    tensors = load_file(str(folder / "model.safetensors"))
    bits = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]
    bits = {g["weights"]["num_bits"] for g in bits.values()}
    codes = {}
    for name, t in tensors.items():
        if name.endswith("weight_packed"):
            (b,) = bits
            cols = int(tensors[name.replace("weight_packed", "weight_shape")][1])
            codes[name] = unpack_codes(t, b, cols)
        elif t.dtype == torch.int8 or (t.dtype.is_floating_point and t.element_size() == 1):
            codes[name] = t.view(torch.uint8)
    return codes


def compare(one: Path, two: Path) -> tuple[float, float]:
    """(fraction of codes identical, relative perplexity difference) of two checkpoints."""
    a, b = checkpoint_codes(one), checkpoint_codes(two)
    assert a and a.keys() == b.keys()
    same = sum(int((a[k] == b[k]).sum()) for k in a)
    total = sum(a[k].numel() for k in a)
    ppl = [json.loads((f / "results.json").read_text())["quality"]["perplexity"] for f in (one, two)]
    return same / total, abs(ppl[1] / ppl[0] - 1)


AWQ_SPLIT = ("description: AWQ whose scale search reads 10 of 16 sequences (8 on rank 0, 2 on rank 1)\n"
             "calibration: {dataset: wiki, samples: 16, seq_len: 64}\n"
             "scheme: {bits: 4, symmetric: false, strategy: group, group_size: 32}\n"
             "steps:\n  - awq: {grid: 10, clip_grid: 10, max_tokens: 600, clip_tokens: 300}\n"
             "  - gptq: {actorder: static, true_sequential: true, dampening_frac: 0.1}\n")
SMOOTH_GRID = ("description: SmoothQuant with an alpha search, then static INT8 inputs\n"
               "calibration: {dataset: wiki, samples: 16, seq_len: 64}\n"
               "scheme: {bits: 8, symmetric: true, strategy: channel}\n"
               "steps:\n  - smoothquant: {alpha_grid: [0.3, 0.5, 0.7], max_tokens: 500}\n  - rtn\n"
               "  - quantize_inputs: {bits: 8, dynamic: false}\n  - kv_cache: {format: int8, strategy: head}\n")


@pytest.mark.slow  # ~40 s each: two runs, one of them two processes
@pytest.mark.parametrize("recipe", ["w4a16-gptq", "awq-split", "smoothquant-grid", "fp8-static", "fp8-dynamic-gptq"])
def test_two_ranks_write_the_one_rank_checkpoint(recipe, tiny, tmp_path):
    if recipe == "awq-split":
        (tmp_path / "awq-split.yaml").write_text(AWQ_SPLIT)
        recipe = str(tmp_path / "awq-split.yaml")
    elif recipe == "smoothquant-grid":
        (tmp_path / "sq.yaml").write_text(SMOOTH_GRID)
        recipe = str(tmp_path / "sq.yaml")
    extra = ("--set", "calibration.samples=16")
    one, two = lowbit_run(recipe, tiny, tmp_path / "one", 1, extra), lowbit_run(recipe, tiny, tmp_path / "two", 2, extra)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    identical, ppl_diff = compare(tmp_path / "one", tmp_path / "two")
    assert identical >= 0.999 and ppl_diff <= 0.002, (identical, ppl_diff)
    assert "rank 0 of 2 calibrates on samples 0-7" in two.stderr  # half of the 16 samples
    assert two.stderr.count("calibration data:") == 1 and "rank 1" not in two.stderr  # rank 0 speaks alone


@pytest.mark.slow  # ~60 s: two runs, one of them two processes
def test_two_ranks_learn_one_rounding(tiny, tmp_path):
    """Each rank steps on its own batches with the gradients summed over both: the ranks hold the
    same parameters after every layer (the step checks it and stops where not), and the checkpoint
    is as good as one rank's, whose batches differ (each step here sees both ranks' samples)."""
    extra = ("--set", "calibration.samples=16", "--set", "steps.0.signround.iterations=8",
             "--set", "steps.0.signround.batch=4", "--set", "steps.0.signround.learning_rate=0.02")
    one = lowbit_run("w4a16-signround", tiny, tmp_path / "one", 1, extra)
    two = lowbit_run("w4a16-signround", tiny, tmp_path / "two", 2, extra)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    results = [json.loads((tmp_path / f / "results.json").read_text()) for f in ("one", "two")]
    assert all(r["audit"]["passed"] for r in results)
    assert all(layer["best"] < layer["first"] for r in results for layer in r["steps"][0]["layers"])  # it learned
    ppl = [r["quality"]["perplexity"] for r in results]
    assert abs(ppl[1] / ppl[0] - 1) < 0.02, ppl
    assert "rank 0 of 2 calibrates on samples 0-7" in two.stderr


DISTILL = ("description: RTN, then scales and norms learned against the float model\n"
           "calibration: {dataset: wiki, samples: 16, seq_len: 64}\n"
           "scheme: {bits: 4, symmetric: true, strategy: group, group_size: 32}\n"
           "steps:\n  - rtn\n  - distill: {batch: 2, epochs: 2, learning_rate: 0.01}\n")


@pytest.mark.slow  # ~40 s: two runs, one of them two processes
def test_two_ranks_distill_as_one(tiny, tmp_path):
    """Each rank steps on its own samples with the gradients summed over both (the step checks that
    the ranks hold the same scales and norms, and stops where not): perplexity as one rank's, whose
    batches differ."""
    (tmp_path / "distill.yaml").write_text(DISTILL)
    recipe = str(tmp_path / "distill.yaml")
    one, two = lowbit_run(recipe, tiny, tmp_path / "one", 1), lowbit_run(recipe, tiny, tmp_path / "two", 2)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    results = [json.loads((tmp_path / f / "results.json").read_text()) for f in ("one", "two")]
    assert all(r["audit"]["passed"] for r in results)
    assert [r["steps"][1]["steps"] for r in results] == [16, 8]  # each of two ranks' steps reads 2 samples
    assert all(r["steps"][1]["kl_last_epoch"] < r["steps"][1]["kl_first_epoch"] for r in results)  # both learned
    identical, ppl_diff = compare(tmp_path / "one", tmp_path / "two")
    assert identical == 1.0 and ppl_diff < 0.02, (identical, ppl_diff)  # codes are rtn's: distill never moves one
    assert "rank 0 of 2 calibrates on samples 0-7" in two.stderr


@pytest.mark.slow  # ~20-30 s each: two processes start, one faults, the run stops
@pytest.mark.parametrize("kind", ["raise", "kill", "hang"])
def test_a_failing_rank_stops_every_rank_with_its_error(kind, tiny, tmp_path):
    out = tmp_path / "out"
    launch = ("import sys; from lowbit.app.ranks import relaunch; "
              f"sys.exit(relaunch(sys.argv[1:], 2, script={str(WORKERS)!r}))")
    args = [sys.executable, "-c", launch, "fault", kind, "run", "w4a16-gptq", "--model", str(tiny),
            "--output", str(out), *QUICK, "--set", "calibration.samples=16"]
    start = time.perf_counter()
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "LOWBIT_DIST_TIMEOUT": "10"})
    seconds = time.perf_counter() - start
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    if kind == "raise":  # its own message, naming it, and the launcher's verdict
        assert "lowbit: error: rank 1 of 2: injected fault: rank 1 cannot solve this layer" in done.stderr
        assert last.startswith("lowbit: error: rank 1 of 2 exited with code 2"), last
    elif kind == "kill":
        assert last.startswith("lowbit: error: rank 1 of 2 was killed by SIGKILL"), last
    else:  # rank 1 never answers: rank 0 gives up after LOWBIT_DIST_TIMEOUT and says why
        assert "lowbit: error: rank 0 of 2: broadcast across ranks failed" in done.stderr
        assert "LOWBIT_DIST_TIMEOUT=10s" in done.stderr
        assert last.startswith("lowbit: error: rank 0 of 2 exited with code 3"), last
    assert not out.exists()  # nothing published
    assert seconds < 150, seconds


def test_the_group_takes_nccl_only_where_every_rank_here_has_a_gpu():
    assert group_backend(gpus=0, ranks_here=2) == "gloo"
    assert group_backend(gpus=1, ranks_here=2) == "gloo"  # one rank without a GPU: all alike on gloo
    assert group_backend(gpus=2, ranks_here=2) == group_backend(gpus=8, ranks_here=2) == "cpu:gloo,cuda:nccl"


def test_without_nccl_every_collective_runs_on_the_cpu():
    assert backend_device("gloo") == torch.device("cpu")  # whatever device the tensor is on


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("name, refusal", [
    ("cuda", r"calibration.device is 'cuda', but torch sees no CUDA device here .* valid: auto, cpu"),
    ("cuda:1", r"calibration.device is 'cuda:1', but under torchrun .* each rank takes the GPU of its LOCAL_RANK")])
def test_a_rank_without_a_gpu_refuses_cuda_and_auto_falls_back_to_the_cpu(name, refusal, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device("auto", "calibration.device") == rank_device("cpu", "calibration.device") == torch.device("cpu")
    with pytest.raises(ValueError, match=refusal):
        rank_device(name, "calibration.device")


@pytest.mark.slow  # ~15 s: two ranks start, both refuse the device
def test_nproc_with_a_gpu_that_is_not_there_stops_with_the_reason(tiny, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without a GPU")
    done = lowbit_run("w4a16-rtn", tiny, tmp_path / "out", 2, ("--device", "cuda"))
    assert done.returncode != 0
    assert "calibration.device is 'cuda', but torch sees no CUDA device here" in done.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()
