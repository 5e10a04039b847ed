"""What llama.cpp's own `llama-quantize` writes for one float32 matrix, in every GGML type lowbit has:
the oracle for lowbit's reference rounding (tests/test_quantize_gguf_llama_cpp.py).

    python tests/llama_quantize_bytes.py     # rewrite tests/llama_quantize_bytes.safetensors

The matrix goes into a minimal llama-architecture GGUF (no vocabulary: llama-quantize reads only the
hyperparameters) as blk.0.ffn_gate.weight, and `llama-quantize --pure` turns it into each type.
The committed file holds the matrix and each type's bytes, so CI checks byte identity without a
llama.cpp build; the test that rebuilds it runs where the tools are built.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from llama_cpp_runs import llama_cpp_tools

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "llama_quantize_bytes.safetensors"
TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
TENSOR = "blk.0.ffn_gate.weight"
ROWS, COLS = 24, 1024


def hard_matrix(seed: int = 0, rows: int = ROWS, cols: int = COLS) -> torch.Tensor:
    """Rows at magnitudes from 1e-3 to 1, outliers, all-zero blocks and a zero row, a constant block,
    equal and opposite maxima, values too small for an fp16 scale, and (rows 8-11) heavy tails."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 0, rows)[:, None]
    W[0, 5], W[2, 300], W[4, 777] = 40.0, -25.0, 9.0
    W[1, :256] = 0.0
    W[3] = 0.0
    W[5, 256:512] = 0.37
    W[6, 32:64] = torch.tensor([0.5, -0.5] * 16)
    W[7, 512:768] *= 1e-9
    W[8:12] = torch.randn(4, cols, generator=gen) ** 3 * 0.01
    return W


def quantized_by_llama_cpp(W: torch.Tensor, types=TYPES) -> dict[str, np.ndarray]:
    """Each type's bytes (rows, bytes per row) as llama-quantize writes W."""
    import gguf

    quantize = llama_cpp_tools.tool("llama-quantize")
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "f32.gguf"
        write_minimal_llama(source, W.numpy().astype(np.float32))
        out = {}
        for kind in types:
            target = Path(tmp) / f"{kind}.gguf"
            done = subprocess.run([str(quantize), "--pure", str(source), str(target), kind.upper(), "1"],
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]
            tensor = next(t for t in gguf.GGUFReader(target).tensors if t.name == TENSOR)
            assert tensor.tensor_type.name.lower() == kind, (kind, tensor.tensor_type.name)
            out[kind] = np.array(tensor.data).reshape(W.shape[0], -1).copy()
    return out


def write_minimal_llama(path: Path, matrix: np.ndarray) -> None:
    """One llama layer whose ffn_gate is `matrix` (rows = feed-forward width, columns = hidden width)."""
    hidden, ffn = matrix.shape[1], matrix.shape[0]
    write_llama(path, {"token_embd.weight": np.full((32, hidden), 0.01, np.float32), TENSOR: matrix},
                hidden=hidden, ffn=ffn, layers=1, heads=8, kv_heads=8)


def write_llama(path: Path, tensors: dict[str, np.ndarray], hidden: int, ffn: int, layers: int, heads: int,
                kv_heads: int) -> None:
    """A llama-architecture GGUF of float32 `tensors` (GGUF names) and the norms, no vocabulary."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(layers) for n in ("attn_norm", "ffn_norm")]
    for name in norms:
        writer.add_tensor(name, np.ones(hidden, np.float32))
    for name, array in tensors.items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    from safetensors.torch import save_file

    W = hard_matrix()
    tensors = {"input": W, **{kind: torch.from_numpy(data) for kind, data in quantized_by_llama_cpp(W).items()}}
    save_file(tensors, str(FIXTURE), metadata={"llama_cpp": llama_cpp_tools.VERSION, "tensor": TENSOR})
    print(f"wrote {FIXTURE.relative_to(HERE.parent)} ({', '.join(TYPES)})")


if __name__ == "__main__":
    main()
