"""lm-eval through its Python API on an in-memory tiny model, with the local offline tasks."""
import json
import sys

import pytest
import torch

from lowbit.evaluate.config import LMEvalConfig, MissingPackageError
from lowbit.evaluate.lm_tasks import LOCAL_TASKS, check_tasks, cloze_docs, local_task_dir, run_lm_eval, sentiment_docs


def test_cloze_docs_split_off_the_last_word():
    text = ("The quick brown fox jumps over the lazy sleeping dog. Too short here. "
            "A second sentence with enough words ends with a number 42.")
    docs = cloze_docs(text)
    assert docs == [{"context": "The quick brown fox jumps over the lazy sleeping", "target": "dog"}]


def test_sentiment_docs_alternate_labels():
    docs = sentiment_docs([("neg", "bad"), ("neg", "awful"), ("pos", "great"), ("pos", "fine")])
    assert [d["label"] for d in docs] == [1, 0, 1, 0]
    assert docs[0]["text"] == "great" and docs[1]["text"] == "bad"


def test_local_task_files_are_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path))
    folder = local_task_dir()
    for name in LOCAL_TASKS:
        lines = (folder / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) >= 100 and json.loads(lines[0])
        assert (folder / f"{name}.yaml").exists()
    stamp = (folder / "lowbit_wiki_cloze.yaml").stat().st_mtime_ns
    local_task_dir()
    assert (folder / "lowbit_wiki_cloze.yaml").stat().st_mtime_ns == stamp


def test_local_tasks_build_the_intended_requests():
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=str(local_task_dir()), include_defaults=False)
    tasks = get_task_dict(list(LOCAL_TASKS), manager)
    requests = {}
    for name, task in tasks.items():
        task.build_all_requests(limit=1, rank=0, world_size=1)
        requests[name] = [inst.args for inst in task.instances]
    (ctx, word), = requests["lowbit_wiki_cloze"]
    assert word.startswith(" ") and not ctx.endswith(" ") and word.strip().isalpha()
    assert [cont for _, cont in requests["lowbit_reviews_sentiment"]] == [" negative", " positive"]


@pytest.fixture(scope="module")
def tiny_smollm_vocab():
    """A tiny random llama sharing smollm2's tokenizer (vocabulary 49152)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from lowbit.calibrate.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=49152, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval(), tokenizer


def test_lm_eval_runs_local_tasks_on_in_memory_model(tiny_smollm_vocab):
    model, tokenizer = tiny_smollm_vocab
    cfg = LMEvalConfig(tasks=("lowbit_reviews_sentiment", "lowbit_wiki_cloze"), limit=6, batch_size=4)
    scores = run_lm_eval(model, tokenizer, cfg)
    assert set(scores) == {"lowbit_reviews_sentiment", "lowbit_wiki_cloze"}
    assert 0.0 <= scores["lowbit_reviews_sentiment"]["acc"] <= 1.0
    assert scores["lowbit_reviews_sentiment"]["samples"] == 6
    # a random model is a poor guesser of the last word: perplexity far above 1
    assert scores["lowbit_wiki_cloze"]["perplexity"] > 10


def test_unknown_task_names_the_valid_ones():
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(local_task_dir()), include_defaults=False)
    check_tasks(list(LOCAL_TASKS), manager.all_tasks)
    with pytest.raises(ValueError, match="lowbit_wiki_cloze"):
        check_tasks(["no_such_task_xyz"], manager.all_tasks)


def test_lm_eval_not_installed_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises, as when it is absent
    with pytest.raises(MissingPackageError, match=r"evaluate.lm_eval.tasks \['lowbit_wiki_cloze'\] needs lm-eval "
                                                  r"\(not importable: .*\): pip install 'lowbit\[eval\]'"):
        run_lm_eval(None, None, LMEvalConfig(tasks=("lowbit_wiki_cloze",)))
