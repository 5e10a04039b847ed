"""Streaming a model from its safetensors shards: the skeleton, loading and freeing modules, ties."""
from __future__ import annotations

import pytest
import torch

from lowbit.calibrate.streaming import (ShardedWeights, empty_model, is_resident, materialize,
                                        outer_modules, release)
from lowbit.export.formats.hf_folder import read_safetensors
from streaming_models import save_sharded_tiny


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    from lowbit.calibrate.models import resolve_model_path

    return save_sharded_tiny(tmp_path_factory.mktemp("opt"), "opt", resolve_model_path("smollm2-135m"))


def test_skeleton_has_no_weights_and_keeps_ties(tied_folder):
    model = empty_model(tied_folder)
    assert all(p.is_meta for p in model.parameters())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not any(b.is_meta for b in model.buffers())  # rotary/position tables are computed


def test_layer_loads_the_stored_tensors_and_frees_them(tied_folder):
    model, weights, stored = empty_model(tied_folder), ShardedWeights(tied_folder), read_safetensors(tied_folder)
    layer = model.model.decoder.layers[1]
    materialize(model, layer, "model.decoder.layers.1", weights, torch.float32)
    for name, param in layer.named_parameters():
        assert torch.equal(param, stored[f"model.decoder.layers.1.{name}"]), name
    assert not is_resident(model.model.decoder.layers[0])
    release(model, layer)
    assert not is_resident(layer)


def test_tied_head_follows_the_embedding(tied_folder):
    model, weights = empty_model(tied_folder), ShardedWeights(tied_folder)
    assert "lm_head.weight" not in weights  # saved once, under the embedding's name
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    materialize(model, head, "lm_head", weights, torch.float32)  # found through its tie
    assert head.weight is embedding.weight and not head.weight.is_meta
    release(model, embedding)
    assert head.weight is embedding.weight and head.weight.is_meta


def test_outer_modules_are_everything_but_the_layers(tied_folder):
    model = empty_model(tied_folder)
    names = [name for name, _ in outer_modules(model, "model.decoder.layers")]
    assert "model.decoder.embed_tokens" in names and "model.decoder.final_layer_norm" in names
    assert not any(n.startswith("model.decoder.layers") for n in names)


def test_numel_reads_headers(tied_folder):
    assert ShardedWeights(tied_folder).numel() == sum(t.numel() for t in read_safetensors(tied_folder).values())


def test_missing_weights_are_named(tied_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        ShardedWeights(tmp_path)
    weights = ShardedWeights(tied_folder)
    with pytest.raises(KeyError, match="model.decoder.layers.9.fc1.weight"):
        weights.load(["model.decoder.layers.9.fc1.weight"])


def test_a_folder_missing_a_shard_or_a_tensor_is_named(tied_folder, tmp_path):
    """Real damage to a copy of the folder: a shard deleted, an index that lost a tensor."""
    import json
    import shutil

    index_name = "model.safetensors.index.json"
    no_shard = shutil.copytree(tied_folder, tmp_path / "no-shard")
    shard = sorted(set(json.loads((no_shard / index_name).read_text())["weight_map"].values()))[-1]
    (no_shard / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        ShardedWeights(no_shard)
    no_tensor = shutil.copytree(tied_folder, tmp_path / "no-tensor")
    index = json.loads((no_tensor / index_name).read_text())
    del index["weight_map"]["model.decoder.layers.0.fc1.weight"]
    (no_tensor / index_name).write_text(json.dumps(index))
    model = empty_model(no_tensor)
    with pytest.raises(KeyError, match="model.decoder.layers.0.fc1.weight"):
        materialize(model, model.model.decoder.layers[0], "model.decoder.layers.0", ShardedWeights(no_tensor),
                    torch.float32)


def test_an_input_capture_reads_only_the_embedding_rows_its_tokens_use(tmp_path):
    """outer(tokens=ids): the head (here tied to the embedding) stays on meta, the embedding holds one
    row per distinct id, every lookup gives the full table's row, and afterwards all is meta again."""
    from transformers import AutoModelForCausalLM

    from lowbit.calibrate.arch import arch_for
    from lowbit.app.streamed import StreamedLayers
    from tiny_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny")
    full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).get_input_embeddings().weight
    model = empty_model(folder)
    source = StreamedLayers(model, arch_for(model), ShardedWeights(folder), [])
    ids = torch.tensor([[5, 9, 9, 200], [7, 5, 300, 6]])
    with source.outer("cpu", tokens=ids):
        embedding = model.get_input_embeddings()
        assert embedding.weight.shape == (6, full.shape[1])  # 5, 6, 7, 9, 200, 300
        assert model.get_output_embeddings().weight.is_meta
        assert torch.equal(embedding(ids), full[ids])
    assert embedding.weight.is_meta and embedding.weight.shape == full.shape
