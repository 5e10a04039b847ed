"""Every shipped GGUF recipe's file loads and runs in llama.cpp itself (#37): llama-perplexity on it
agrees with lowbit's perplexity of the same file, on the same tokens, within 0.5%. On a tiny llama
drawn with a wide initializer, so that its logits have contrast and a file that computes another
model shows. Skipped, naming the command that builds the tools, where they are not built."""
import pytest

from llama_cpp_runs import llama_cpp_perplexity, lowbit_perplexity, needs_llama_cpp
from tiny_models import SMALL_RUN, save_tiny_llama
from lowbit.app.cli import main
from lowbit.calibrate.data import load_text
from lowbit.recipes.schema import load_recipe, shipped_recipes

pytestmark = needs_llama_cpp
GGUF_RECIPES = sorted(name for name in shipped_recipes() if load_recipe(name).export.format == "gguf")


def test_every_gguf_recipe_is_checked():
    assert len(GGUF_RECIPES) >= 6 and "gguf-iq4_nl-gptq" in GGUF_RECIPES


@pytest.mark.parametrize("recipe", GGUF_RECIPES)
def test_llama_cpp_and_lowbit_agree_on_each_gguf_recipes_file(recipe, tmp_path):
    # 256-wide rows so that the K-quants and IQ4_XS take their own blocks, not the 32-block fallbacks
    source = save_tiny_llama(tmp_path / "source", hidden_size=256, intermediate_size=512, initializer_range=0.06)
    out = tmp_path / "run"
    assert main(["run", recipe, "--model", str(source), "--output", str(out), *[f"--set={s}" for s in SMALL_RUN]]) == 0
    text = load_text("news", part="eval")[:20000]  # text no recipe calibrated on
    (tmp_path / "eval.txt").write_text(text)
    theirs, ours = llama_cpp_perplexity(out / "model.gguf", tmp_path / "eval.txt"), lowbit_perplexity(out, text)
    assert abs(theirs / ours - 1) <= 0.005, (theirs, ours)
