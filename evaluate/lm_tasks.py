"""lm-eval on the in-memory model, with offline tasks built from local data at first use.

Local tasks (written as YAML + jsonl under $LOWBIT_CACHE/lm_eval_tasks and found through
lm-eval's TaskManager(include_path=...)):
  lowbit_wiki_cloze         last word of sentences from the wiki evaluation part (LAMBADA-style)
  lowbit_reviews_sentiment  positive/negative choice on gensim's pang_lee_polarity.cor sentences
                            (all 200 labelled sentences; a recipe calibrating on the `reviews`
                            corpus has seen their text, though never their labels)
Any other name is passed to lm-eval as is: its data must be reachable (cache or network).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from lowbit.calibrate.cache import cache_dir
from lowbit.calibrate.corpora import corpus_text, review_sentences

from .config import LMEvalConfig, lm_eval_missing

TASKS_VERSION = 2  # bump when a local task's data or prompt changes
MAX_CLOZE_DOCS = 2000
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def cloze_docs(text: str, limit: int = MAX_CLOZE_DOCS) -> list[dict]:
    """Sentences of 8..60 words whose last word is alphabetic: context = the words before it."""
    docs = []
    for sentence in _SENTENCE_END.split(text.replace("\n", " ")):
        words = sentence.strip().rstrip(".!?").split()
        if 8 <= len(words) <= 60 and words[-1].isalpha() and len(words[-1]) >= 3:
            docs.append({"context": " ".join(words[:-1]), "target": words[-1]})
            if len(docs) == limit:
                break
    return docs


def sentiment_docs(pairs: list[tuple[str, str]]) -> list[dict]:
    """Alternate labels so that a `limit` prefix stays balanced; label 0 negative, 1 positive."""
    pos = [t for label, t in pairs if label == "pos"]
    neg = [t for label, t in pairs if label == "neg"]
    docs = []
    for p, n in zip(pos, neg):
        docs += [{"text": p, "label": 1}, {"text": n, "label": 0}]
    return docs


def _cloze_yaml(data: Path) -> dict:
    return {"task": "lowbit_wiki_cloze", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
            "output_type": "loglikelihood", "doc_to_text": "{{context}}",
            # loglikelihood tasks do not apply target_delimiter: the space goes into the target
            "doc_to_target": "{{' ' + target}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}],
            "metadata": {"version": TASKS_VERSION}}


def _sentiment_yaml(data: Path) -> dict:
    return {"task": "lowbit_reviews_sentiment", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
            "output_type": "multiple_choice", "doc_to_text": "Review: {{text}}\nSentiment:",
            "doc_to_choice": ["negative", "positive"], "doc_to_target": "label",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": TASKS_VERSION}}


LOCAL_TASKS = {
    "lowbit_wiki_cloze": (lambda: cloze_docs(corpus_text("wiki", "eval")), _cloze_yaml),
    "lowbit_reviews_sentiment": (lambda: sentiment_docs(review_sentences()), _sentiment_yaml),
}


def local_task_dir() -> Path:
    """The folder of local task definitions, written whole on first use."""
    folder = cache_dir("lm_eval_tasks", f"v{TASKS_VERSION}")
    for name, (make_docs, make_yaml) in LOCAL_TASKS.items():
        spec = folder / f"{name}.yaml"
        if spec.exists():
            continue
        data = folder / f"{name}.jsonl"
        _write_atomic(data, "".join(json.dumps(d) + "\n" for d in make_docs()))
        _write_atomic(spec, yaml.safe_dump(make_yaml(data), sort_keys=False))
    return folder


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".partial")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


@dataclass(frozen=True)
class LMEvalKey:
    """What a cached lm-eval figure depends on: the options and the local tasks' version."""
    cfg: LMEvalConfig
    tasks_version: int = TASKS_VERSION


def run_lm_eval(model, tokenizer, cfg: LMEvalConfig) -> dict:
    """{task: {metric: value}} from lm-eval's simple_evaluate on the model as it is in memory."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise lm_eval_missing(cfg.tasks, f"not importable: {err}") from err

    only_local = all(t in LOCAL_TASKS for t in cfg.tasks)  # indexing lm-eval's own tasks takes ~10 s
    manager = TaskManager(include_path=str(local_task_dir()), include_defaults=not only_local)
    check_tasks(cfg.tasks, manager.all_tasks)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size,
              device=str(next(model.parameters()).device))
    out = simple_evaluate(model=lm, tasks=list(cfg.tasks), task_manager=manager, limit=cfg.limit,
                          num_fewshot=cfg.num_fewshot, log_samples=False, bootstrap_iters=0)
    return {task: _metrics(values, out.get("n-samples", {}).get(task))
            for task, values in out["results"].items()}


def check_tasks(tasks, known) -> None:
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise ValueError(f"evaluate.lm_eval.tasks: unknown lm-eval task(s) {unknown}; local tasks: "
                         f"{sorted(LOCAL_TASKS)}, or any name from `lm_eval --tasks list`")


def _metrics(values: dict, samples) -> dict:
    """'acc,none' -> 'acc'; stderr entries dropped (bootstrap off); sample count kept."""
    metrics = {k.split(",")[0]: v for k, v in values.items()
               if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
    if samples:
        metrics["samples"] = samples.get("effective", samples.get("original"))
    return metrics
