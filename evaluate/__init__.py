"""Evaluation stage: quality, memory and speed of a (quantized) model."""

if __name__ != "lowbit.evaluate":
    # Guard: with the repository root on sys.path (`python -m pytest`, a script run from
    # the root) this folder would shadow Hugging Face's `evaluate`, which lm-eval imports.
    raise ImportError(
        f"the folder {__file__.rsplit('/', 2)[0]}/evaluate was imported as top-level "
        f"'{__name__}'; it is lowbit's evaluation stage and must be imported as "
        "'lowbit.evaluate'. Install lowbit (pip install -e .) and run tests with `pytest` "
        "rather than `python -m pytest` from the repository root, so that `import evaluate` "
        "finds Hugging Face's package."
    )
