"""What a gguf recipe's export gives the token embedding (llama.cpp's rule for its file type)."""
from __future__ import annotations

from tiny_models import make_tiny_model

from lowbit.recipes.gguf_defaults import export_config
from lowbit.recipes.schema import parse_recipe


def _recipe(scheme: dict, export: dict):
    return parse_recipe({"scheme": scheme, "steps": ["rtn"], "export": export}, "test")


def test_tied_embedding_takes_the_output_type_and_untied_the_base_type():
    tied = make_tiny_model("llama")  # hidden 128: rows 256 does not divide -> Q8_0, as llama.cpp
    tied.config.tie_word_embeddings = True
    assert export_config(_recipe({"gguf": "q4_k_m"}, {"format": "gguf"}), tied).embedding_type == "q8_0"
    untied = make_tiny_model("qwen2")
    untied.config.tie_word_embeddings = False
    assert export_config(_recipe({"gguf": "q4_0"}, {"format": "gguf"}), untied).embedding_type == "q4_0"


def test_an_explicit_embedding_type_and_other_formats_are_left_alone():
    model = make_tiny_model("llama")
    cfg = export_config(_recipe({"gguf": "q4_0"}, {"format": "gguf", "embedding_type": "q6_k"}), model)
    assert cfg.embedding_type == "q6_k"
    assert export_config(_recipe({"bits": 4, "group_size": 64, "strategy": "group"}, {}), model).embedding_type is None
