"""Built-in text corpora, derived on first use from text that ships inside the gensim package.

No text is copied into this repository: it is extracted from gensim's test data, cleaned, split
deterministically into disjoint calibration and evaluation parts (whole documents, every fifth
document to evaluation) and cached under $LOWBIT_CACHE/corpora.
"""
from __future__ import annotations

import bz2
import os
import re
from pathlib import Path

from .cache import cache_dir

CORPORA = {
    "wiki": "Wikipedia prose (gensim's shortened enwiki dump, markup stripped with filter_wiki)",
    "news": "Australian news articles (gensim's lee_background.cor)",
    "reviews": "movie-review sentences labelled positive/negative (gensim's pang_lee_polarity.cor)",
}
PARTS = ("calib", "eval")
EVAL_EVERY = 5  # document i goes to the evaluation part when i % 5 == 4
VERSION = 2  # bump when extraction or splitting changes, so stale caches are not reused


def gensim_test_file(name: str) -> Path:
    import gensim

    path = Path(gensim.__file__).parent / "test" / "test_data" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the installed gensim does not ship its test data")
    return path


def corpus_text(name: str, part: str) -> str:
    """The text of a built-in corpus part, documents separated by blank lines."""
    if name not in CORPORA:
        raise ValueError(f"unknown built-in corpus {name!r}; built-in: {sorted(CORPORA)}")
    if part not in PARTS:
        raise ValueError(f"unknown corpus part {part!r}; valid: {PARTS}")
    cached = cache_dir("corpora") / f"{name}-{part}-v{VERSION}.txt"
    if not cached.exists():
        docs = corpus_documents(name)
        chosen = [d for i, d in enumerate(docs) if (i % EVAL_EVERY == EVAL_EVERY - 1) == (part == "eval")]
        tmp = cached.with_suffix(f".{os.getpid()}.partial")  # two first uses at once each write their own
        tmp.write_text("\n\n".join(chosen), encoding="utf-8")
        tmp.replace(cached)
    return cached.read_text(encoding="utf-8")


def corpus_documents(name: str) -> list[str]:
    """Unique documents in file order (the news file repeats some articles)."""
    if name == "wiki":
        docs = wiki_articles()
    elif name == "news":
        docs = _lines("lee_background.cor")
    else:
        docs = [text for _, text in review_sentences()]
    return list(dict.fromkeys(docs))


def _lines(filename: str) -> list[str]:
    raw = gensim_test_file(filename).read_bytes().decode("utf-8", errors="replace")
    return [line.strip() for line in raw.splitlines() if line.strip()]


def review_sentences() -> list[tuple[str, str]]:
    """(label, sentence) pairs, label 'pos' or 'neg'."""
    raw = gensim_test_file("pang_lee_polarity.cor").read_bytes().decode("latin-1")
    out = []
    for line in raw.splitlines():
        label, _, text = line.partition(" ")
        if label in ("__label__pos", "__label__neg") and text.strip():
            out.append((label.removeprefix("__label__"), text.strip()))
    return out


def wiki_articles() -> list[str]:
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = gensim_test_file("enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
    articles = []
    with bz2.BZ2File(path) as fh:
        for _title, markup, _pageid in extract_pages(fh):
            prose = _clean_wiki(filter_wiki(markup))
            if prose:
                articles.append(prose)
    return articles


_MIN_PARAGRAPH = 40  # shorter lines are headings, list stubs and table debris


def _clean_wiki(text: str) -> str:
    if text.lstrip().upper().startswith("#REDIRECT"):
        return ""
    text = text.replace("'''", "").replace("''", "")
    paragraphs = []
    for line in text.splitlines():
        line = re.sub(r"\s+", " ", line).strip()
        if len(line) >= _MIN_PARAGRAPH and not line.startswith(("=", "|", "{", "!")):
            paragraphs.append(line)
    return "\n".join(paragraphs)
