"""The recipe fuzz loop, run as a child process by tests/test_recipe_fuzz.py (which reads the peak
memory this prints): hostile recipe YAML and --set items through `lowbit run --dry-run`.

Every example must end in exit 0 (stdout: the resolved recipe as YAML) or exit 2 with exactly one
line `lowbit: error: ...` on stderr; nothing may be written at --output. Most recipes are a
shipped recipe (or none) with a few keys set to hostile values (wrong types, huge and non-finite
numbers, long and unicode strings, unknown keys and steps, values shared through YAML anchors
and aliases), so that validation is reached at every depth; the rest is raw YAML no dumper
writes (alias and merge-key bombs, self-reference, deep nesting, tags, bad dates, huge integer
literals) or bytes that are not UTF-8. The model is the built-in name or a path that does not
exist: a dry run loads nothing, and no example may need the hub.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowbit.recipes.schema import shipped_recipes
from lowbit.app.cli import main

EXAMPLES = int(os.environ.get("LOWBIT_FUZZ_EXAMPLES", "500"))
WORK = Path(tempfile.mkdtemp(prefix="lowbit-recipe-fuzz-"))
SHIPPED = [yaml.safe_load(p.read_text()) for p in shipped_recipes().values()]
STEP_NAMES = ["rtn", "gptq", "awq", "smoothquant", "rtn_mse", "fp8", "kv_cache", "quantize_inputs", "rotate"]
SCHEME_KEYS = ["bits", "group_size", "symmetric", "strategy", "gguf", "types", "formats", "default", "format",
               "block_size", "inputs"]
STEP_KEYS = ["scheme", "actorder", "dampening_frac", "scale_search", "scale_refits", "true_sequential", "grid",
             "clip_grid", "max_tokens", "alpha", "alpha_grid", "activations", "rounding", "dynamic", "bits",
             "format", "strategy", "group_size", "steps", "max_shrink", "clip_tokens", "micro_batch", "kind", "seed",
             "check_tokens", "tolerance"]
PATHS = [  # recipe keys as the schema nests them (a number: a list index)
    ("name",), ("description",), ("model",), ("trust_remote_code",), ("allow_pickle",), ("ignore",),
    ("ignore", 0), ("scheme",), ("steps",), ("steps", 0), ("steps", 1), ("fit",),
    *[("calibration", k) for k in ("dataset", "samples", "seq_len", "seed", "device", "streaming", "offload")],
    *[("scheme", k) for k in SCHEME_KEYS], ("scheme", "types", "o_proj"), ("scheme", "formats", "re:.*"),
    *[("fit", k) for k in ("format", "bits_per_weight", "memory", "context", "batch", "types", "kv_formats",
                           "overhead", "prefill_chunk", "samples")],
    *[("export", k) for k in ("format", "dtype", "type", "embedding_type", "overwrite")],
    *[("evaluate", *k.split(".")) for k in ("baseline", "perplexity.context_len", "perplexity.stride",
                                            "kl.max_tokens", "speed.batch_sizes", "speed.backend",
                                            "memory.budgets_gb", "memory.kv_bytes", "memory.prefill_chunk",
                                            "lm_eval.limit", "bnb_baselines")],
]


def weighted(*choices: tuple) -> st.SearchStrategy:
    """st.one_of with weights, given as (weight, strategy) pairs (one_of draws its branches evenly,
    repeated ones counted once)."""
    slots = [i for i, (weight, _) in enumerate(choices) for _ in range(weight)]
    return st.sampled_from(slots).flatmap(lambda i: choices[i][1])


# --- values -------------------------------------------------------------------------------------
text = st.text(max_size=30)
huge_ints = st.integers(2**63 - 2, 2**63 + 2) | st.builds(lambda n, sign: sign * 10**n, st.integers(19, 3000),
                                                          st.sampled_from([1, -1]))
long_strings = st.builds(lambda c, n: c * n, st.characters(), st.integers(100, 20_000))
plausible = st.sampled_from([0, 1, 2, 3, 4, 8, 16, 64, 128, 100_000, -1, 0.0, 0.1, 1.5, 4.5, 1e-300, True, False,
                             None, "", "wiki", "int4_g64", "int3_g64", "int9", "f16", "q4_0", "q4_k", "q4_k_m",
                             "q3_k", "e4m3", "e5m2", "group", "channel", "tensor", "token", "head", "static",
                             "dynamic", "mse", "gptq", "nearest", "int8", "fp8", "int4", "gguf",
                             "compressed-tensors", "8GB", "0MiB", "1e999GB", "nan", "cuda:99", "cpu", "disk",
                             "re:(", "re:.*", "../x", "a/b", ".", "lm_head", "a\nb", "\u2028", "\x00"])
scalars = st.one_of(plausible, st.booleans(), st.integers(-10, 600), huge_ints, st.floats(), text, long_strings)
keys = st.one_of(st.sampled_from(SCHEME_KEYS + STEP_KEYS + STEP_NAMES), text, st.integers(), st.none())
small_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner,
                                                                                                  max_size=3),
                            max_leaves=6)


def nested(depth: int):
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


def shared(width: int, depth: int):
    """One list referenced `width` times per level: the dumper writes it with anchors and aliases."""
    value: object = ["lol"] * 3
    for _ in range(depth):
        value = [value] * width
    return value


# mostly values a recipe could hold or small wrong ones; now and then one nested deep, or shared
# enough to expand past any bound
hostile = weighted((8, plausible), (3, text | long_strings), (2, scalars), (2, small_values),
                   (1, st.builds(nested, st.integers(1, 70))),
                   (1, st.builds(shared, st.integers(2, 12), st.integers(1, 8))))
# the model: the built-in name (cached by the fixtures) or paths that do not exist, never a hub id
model_names = st.one_of(st.just("smollm2-135m"), st.just(str(WORK / "no-such-model")),
                        st.builds(lambda t: "/nonexistent/" + t, text), st.builds(lambda t: "./" + t, text))


@st.composite
def steps(draw):
    name = draw(st.sampled_from(STEP_NAMES) | text)
    options = draw(st.none() | st.dictionaries(st.sampled_from(STEP_KEYS) | text, hostile, max_size=3) | hostile)
    return draw(st.sampled_from([name, {name: options}, {name: options, "extra": None}]))


def put(recipe: dict, path: tuple, value) -> None:
    """recipe[path[0]][path[1]]... = value, making mappings (or lists) on the way in place of what
    is there; a list index past the end appends; a list reached with a key is left as it is."""
    node = recipe
    for i, key in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list) and isinstance(key, int):
            if not 0 <= key < len(node):
                node.append({})
                key = len(node) - 1
        elif not isinstance(node, dict):
            return
        elif not last and not isinstance(node.get(key), (dict, list)):
            node[key] = [] if isinstance(path[i + 1], int) else {}
        if last:
            node[key] = value
        else:
            node = node[key]


@st.composite
def recipes(draw) -> dict:
    recipe = copy.deepcopy(draw(st.sampled_from([{}, *SHIPPED])))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(weighted((12, st.sampled_from(PATHS)), (1, st.lists(keys, min_size=1, max_size=3).map(tuple))))
        if path == ("model",):
            value = draw(model_names | hostile.filter(lambda v: not isinstance(v, str)))
        elif path[0] == "steps":
            value = draw(st.lists(steps(), max_size=3) if len(path) == 1 else steps())
        else:
            value = draw(hostile)
        put(recipe, path, value)
    if isinstance(recipe.get("model", ""), str) and recipe.get("model", "") not in ("", "smollm2-135m"):
        recipe["model"] = draw(model_names)  # a hostile string there could be taken for a hub id
    return recipe


@st.composite
def gentle_recipes(draw) -> dict:
    """A shipped recipe with strings anywhere a string is valid: most load, and their resolved
    recipe (unicode, long, control characters) is written out."""
    recipe = copy.deepcopy(draw(st.sampled_from(SHIPPED)))
    for path in draw(st.lists(st.sampled_from(STRING_PATHS), min_size=1, max_size=3)):
        put(recipe, path, draw(text | long_strings))
    return recipe


STRING_PATHS = [("description",), ("name",), ("calibration", "dataset"), ("calibration", "split"),
                ("calibration", "text_column"), ("ignore", 0), ("ignore", 1), ("evaluate", "perplexity", "dataset")]


# --- raw YAML no dumper writes ----------------------------------------------------------------


BOMB_KEYS = ["description", "scheme", "steps", "ignore", "fit", "evaluate", "model"]


def alias_bomb(width: int, depth: int, key: str) -> str:
    """Each level a list of `width` aliases to the level before: width ** depth strings."""
    levels = ['&a0 ["lol", "lol"]'] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, depth + 1)]
    return f"{key}: [{', '.join(levels)}]\n"


def merge_bomb(width: int, depth: int, key: str) -> str:
    """Each level a mapping merging the level before `width` times (merge keys copy the pairs)."""
    levels = ["&m0 {k0: v}"] + [f"&m{i} {{<<: [{', '.join([f'*m{i - 1}'] * width)}], k{i}: v}}"
                                for i in range(1, depth + 1)]
    return f"{key}: [{', '.join(levels)}]\n"


RAW_SNIPPETS = [
    "scheme: &s {bits: [*s]}\n", "steps: &s [*s]\n", "a: &a {<<: *a}\n", "description: *undefined\n",
    "name: !!python/object/apply:os.system ['true']\n", "description: !!binary 'not base64!'\n",
    "description: 2024-02-30\n", "calibration: {samples: 0x" + "f" * 5000 + "}\n",
    "calibration: {samples: " + "9" * 4400 + "}\n", "calibration: {samples: " + ":".join(["1"] * 3000) + "}\n",
    "steps: !!set {rtn: null}\n", "steps: !!omap [{rtn: {}}]\n", "---\nname: a\n---\nname: b\n",
    "scheme: {bits: 4}\nsteps: [rtn: [1, 2]]\n", "scheme: {bits: 4}\nsteps: [gptq: true]\n",
    "\ttabs: 1\n", "description: \"\\ud800\"\n", "description: \"\\0\"\n", "? [a, b]\n: c\n",
    "%YAML 1.1\n---\nname: a\n", "%TAG ! tag:yaml.org,2002:python/\n---\nname: !name:os.system x\n",
    "&k name: x\n*k : y\n", "\ufeffname: x\n", "name: x\n...\n", "<<: {name: x}\n", "<<: [1]\n",
]
TAGS = ["int", "float", "bool", "str", "null", "binary", "timestamp", "seq", "map", "set", "omap", "pairs", "merge",
        "value", "python/name:os.system", "python/tuple"]
tag_values = st.one_of(text.map(json.dumps), st.sampled_from(["abc", "maybe", "2024-02-30", "[a]", "{a: 1}", "0x",
                                                               "1e999", "''", "-", ".nan", "0b2", "1:2:3"]))
tagged = st.builds(lambda key, tag, value: f"{key}: !!{tag} {value}\n", st.sampled_from(BOMB_KEYS + ["name"]),
                   st.sampled_from(TAGS), tag_values)
raw_texts = st.one_of(
    tagged,
    st.builds(alias_bomb, st.integers(2, 12), st.integers(1, 12), st.sampled_from(BOMB_KEYS)),
    st.builds(merge_bomb, st.integers(2, 6), st.integers(1, 14), st.sampled_from(BOMB_KEYS)),
    st.builds(lambda n: "scheme: " + "[" * n + "]" * n + "\n", st.integers(1, 3000)),
    st.builds(lambda n: "scheme: " + "{a: " * n + "1" + "}" * n + "\n", st.integers(1, 400)),
    st.sampled_from(RAW_SNIPPETS), text,
)


def dumped(value) -> bytes:
    return yaml.safe_dump(value, allow_unicode=True, width=10_000).encode("utf-8", "surrogatepass")


structured = recipes().map(dumped)
recipe_bytes = weighted((6, structured), (2, gentle_recipes().map(dumped)),
                        (1, raw_texts.map(lambda t: t.encode("utf-8", "surrogatepass"))),
                        (1, st.binary(max_size=200)))
set_paths = weighted((8, st.sampled_from(PATHS).map(lambda p: ".".join(map(str, p)))),
                     (1, st.lists(text | st.sampled_from(["steps", "0", "9" * 30, "²", ""]), min_size=1,
                                  max_size=4).map(".".join)))
flow_values = hostile.map(lambda v: yaml.safe_dump(v, default_flow_style=True, width=10_000).strip())
set_values = weighted((4, flow_values), (1, raw_texts.map(str.strip)), (1, text))
path_values = st.tuples(set_paths.filter(lambda p: p != "model"), set_values).map("=".join)
set_items = weighted((8, path_values), (1, text), (1, st.tuples(st.just("model"), model_names).map("=".join)))

# --- the property ---------------------------------------------------------------------------------
counter = {"examples": 0}


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(recipe=recipe_bytes, items=st.lists(set_items, max_size=3))
def dry_run_never_blows_up(recipe: bytes, items: list[str]) -> None:
    counter["examples"] += 1
    path, output = WORK / "recipe.yaml", WORK / f"out-{counter['examples']}"
    path.write_bytes(recipe)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", str(path), "--dry-run", "--output", str(output), *[f"--set={i}" for i in items]])
    assert code in (0, 2), (code, err.getvalue()[-2000:])
    assert not output.exists(), "a dry run wrote its output folder"
    if code == 2:
        message = err.getvalue()
        assert message.startswith("lowbit: error:") and message.count("\n") == 1 and message.endswith("\n"), message
        assert "\r" not in message and len(message) < 5000, message[:3000]
    else:
        assert isinstance(yaml.safe_load(out.getvalue()), dict), out.getvalue()[:3000]


def peak_rss_bytes() -> int:
    """This process's own peak RSS: VmHWM (of its memory since exec) where Linux has it; ru_maxrss
    also keeps the high-water mark of the process it was forked from (a large pytest, here)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


if __name__ == "__main__":
    start = time.perf_counter()
    try:
        dry_run_never_blows_up()
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    print(json.dumps({"examples": counter["examples"], "peak_rss_bytes": peak_rss_bytes(),
                      "seconds": round(time.perf_counter() - start, 1)}))
    sys.exit(0)
