"""Done-when of the export issue: an export of the real smollm2-135m loads in a fresh process
with plain transformers + compressed-tensors and generates the same text lowbit does."""
import json
import os
import subprocess
import sys

import pytest
import torch

from lowbit.calibrate.arch import arch_for
from lowbit.export import checkpoint
from lowbit.export.config import ExportConfig
from lowbit.quantize.steps import rtn
from lowbit.quantize.grids.integer import IntScheme
from lowbit.quantize.steps.context import StepContext

PROMPT = "The capital of France is"
NEW_TOKENS = 12

FRESH = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
assert not any(m == "lowbit" or m.startswith("lowbit.") for m in sys.modules)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ids = tok(sys.argv[2], return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=int(sys.argv[3]), do_sample=False)
print(json.dumps({"ids": out[0].tolist(), "text": tok.decode(out[0], skip_special_tokens=True)}))
"""


@pytest.mark.slow
def test_smollm2_export_generates_in_plain_transformers(tmp_path, smollm2):
    model, tokenizer = smollm2
    model = __import__("copy").deepcopy(model)
    rtn.apply(StepContext(model, arch_for(model), ("lm_head",), lambda: None),
              rtn.RTNConfig(IntScheme(bits=4, symmetric=True, strategy="group", group_size=64)))  # as w4a16-rtn
    out = checkpoint.save(model, tokenizer, tmp_path / "w4", ExportConfig())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no lowbit on the path
    proc = subprocess.run([sys.executable, "-c", FRESH, str(out), PROMPT, str(NEW_TOKENS)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nplain transformers generated: {fresh['text']!r}")
    reloaded, _ = checkpoint.load(out)  # lowbit's runtime modules on the same file
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ours = reloaded.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
    assert fresh["ids"] == ours
    assert "Paris" in fresh["text"]
