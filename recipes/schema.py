"""The recipe: what a run does, validated on load (unknown keys, types, step names)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from lowbit.calibrate.data import CalibrationConfig
from lowbit.calibrate.messages import short_repr
from lowbit.evaluate.config import EvaluateConfig
from lowbit.export.staging import check_plain_name
from lowbit.export.config import ExportConfig

from lowbit.quantize.grids.linear import LinearScheme
from lowbit.quantize.steps.registry import STEPS
from . import safe_yaml
from .fit_config import FitConfig
from .validate import RecipeError, build, to_plain

SHIPPED_DIR = Path(__file__).parent


@dataclass(frozen=True)
class Step:
    name: str
    config: Any


@dataclass(frozen=True)
class Recipe:
    name: str = "custom"
    description: str = ""
    model: str = "smollm2-135m"  # built-in name, local folder or hub id
    trust_remote_code: bool = False  # never on unless a recipe or flag asks for it
    allow_pickle: bool = False  # *.bin weights, via torch.load(weights_only=True); else safetensors only
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    # the weight grid of every step with a `scheme` option (a step's own scheme keys override it):
    # set once where steps share it (awq's search and the gptq/rtn step after it)
    scheme: Optional[dict[str, Any]] = None
    steps: tuple[Step, ...] = ()
    ignore: tuple[str, ...] = ("lm_head",)  # module names, trailing paths or re:REGEX
    # a budget (bits per weight, or memory at a context): the run first plans a format per linear
    # and a KV format for it (lowbit fit), then quantizes to that plan
    fit: Optional[FitConfig] = None
    export: ExportConfig = field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)

    def to_dict(self) -> dict:
        plain = to_plain(self)
        plain["steps"] = [{s.name: step_options(s.config)} for s in self.steps]
        if self.fit is None:  # a run's recipe.yaml says `fit:` only where it planned from a budget
            del plain["fit"]
        defaults = CalibrationConfig()
        for key in ("moe", "moe_min_tokens"):  # said where they differ from the defaults, as recipes before them wrote
            if plain["calibration"][key] == getattr(defaults, key):
                del plain["calibration"][key]
        if self.export.target is None:  # said only where set, so recipes written before it keep their bytes
            del plain["export"]["target"]
        for key in self.evaluate.unwritten_keys():
            del plain["evaluate"][key]
        return plain


def step_options(config) -> dict:
    """A step's options as a recipe writes them; options added after recipes were first written
    (the config's WRITTEN_WHEN_SET) only where they differ from their defaults, so that a recipe's
    recipe.yaml, and so its checkpoint's bytes, stay what they were."""
    plain = to_plain(config)
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for key in getattr(config, "WRITTEN_WHEN_SET", ()):
        if plain[key] == defaults[key]:
            del plain[key]
    return plain


def shipped_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.yaml"))}


def recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        check_recipe_file(path)
        return path
    shipped = shipped_recipes()
    if name_or_path not in shipped:
        raise RecipeError(name_or_path, "", f"no such recipe file or shipped recipe; shipped: {sorted(shipped)}")
    return shipped[name_or_path]


def check_recipe_file(path: Path) -> None:
    """A recipe path names a readable YAML file: a folder or a device is said to be one, not to be missing."""
    valid = "a recipe is a YAML file or a shipped recipe's name (`lowbit recipes` lists them)"
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.y*ml"))[:3]
        hint = f"; it holds {', '.join(inside)}" if inside else ""
        raise RecipeError(str(path), "", f"is a directory, not a recipe file; {valid}{hint}")
    if path.exists() and not path.is_file():
        raise RecipeError(str(path), "", f"is not a regular file (a device, socket or pipe); {valid}")
    if not path.is_file():
        raise RecipeError(str(path), "", f"recipe file does not exist; {valid}")


def load_recipe(name_or_path: str, overrides: tuple[str, ...] = ()) -> Recipe:
    path = recipe_path(name_or_path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError(source, "", "not a UTF-8 text file") from None
    data = parse_yaml(text, source, "")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(source, "", "a recipe is a mapping of keys (model, calibration, steps, …)")
    data.setdefault("name", path.stem)
    for item in overrides:
        apply_override(data, item, source)
    return restated(parse_recipe(data, source), overrides)


WEIGHT_KEYS = ("scheme", "steps", "ignore", "fit")  # --set paths under these change what is quantized


def restated(recipe: Recipe, overrides: tuple[str, ...]) -> Recipe:
    """The recipe with a description that says what it quantizes to once --set changed that (the
    file's words describe the file: `--set scheme.bits=5` on an INT4 recipe makes INT5)."""
    changed = [item for item in overrides if item.partition("=")[0].split(".")[0] in WEIGHT_KEYS]
    if not changed or any(item.startswith("description=") for item in overrides):
        return recipe
    steps = [f"{s.name} {STEPS[s.name].writes(s.config).describe()}" for s in recipe.steps
             if STEPS[s.name].writes(s.config) is not None]
    what = "; ".join(steps) or "no weight step"
    return dataclasses.replace(recipe, description=f"{what} (recipe {recipe.name} changed by --set "
                                                   f"{', '.join(_cut(item) for item in changed)})")


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def parse_yaml(text: str, source: str, key: str):
    try:
        return safe_yaml.load(text)  # safe: a !!python tag is an error, never code; aliases bounded
    except yaml.YAMLError as err:
        raise RecipeError(source, key, f"not valid YAML: {safe_yaml.one_line(err)}") from None
    except safe_yaml.DocumentTooLarge as err:
        raise RecipeError(source, key, f"refused before loading: {err}") from None
    except RecursionError:
        raise RecipeError(source, key, f"not valid YAML: nested too deeply (at most {safe_yaml.MAX_DEPTH} "
                          "levels)") from None


def parse_recipe(data: dict, source: str) -> Recipe:
    _drop_overwrite(data, source)
    steps_data = data.get("steps", [])
    body = {k: v for k, v in data.items() if k != "steps"}
    recipe = build(Recipe, body, source)
    _check_strings(recipe, source)
    if not isinstance(steps_data, list):
        raise RecipeError(source, "steps", "expected a list of steps such as '- rtn: {bits: 4}'")
    steps = tuple(parse_step(item, source, f"steps[{i}]", recipe.scheme) for i, item in enumerate(steps_data))
    check_search_grids(steps, source)
    check_first_steps(steps, source)
    check_after_weights(steps, source)
    return Recipe(**{**recipe.__dict__, "steps": steps})


def _drop_overwrite(data: dict, source: str) -> None:
    """Replacing an output is the command line's decision (--overwrite), never a recipe's: a recipe
    asking for it is refused; `overwrite: false`, which runs before this one wrote into every
    recipe.yaml, asks for nothing and is dropped."""
    export = data.get("export")
    if not isinstance(export, dict) or "overwrite" not in export:
        return
    if export["overwrite"] is not False:
        raise RecipeError(source, "export.overwrite", "replacing an output folder is decided on the command "
                          "line (--overwrite), never by a recipe; remove this key")
    data["export"] = {k: v for k, v in export.items() if k != "overwrite"}


def _check_strings(recipe: Recipe, source: str) -> None:
    """Values that later become a folder name or a regular expression, checked now."""
    try:
        check_plain_name(recipe.name, "recipe name")  # runs are written to <output root>/<name>
    except ValueError as err:
        raise RecipeError(source, "name", str(err)) from None
    for i, pattern in enumerate(recipe.ignore):
        if not pattern.startswith("re:"):
            continue
        try:
            re.compile(pattern[3:])
        except re.error as err:
            raise RecipeError(source, f"ignore[{i}]",
                              f"{short_repr(pattern)} is not a valid regular expression: {err}") from None


def parse_step(item, source: str, key: str, shared_scheme: Optional[dict] = None) -> Step:
    if isinstance(item, str):
        item = {item: None}
    if not isinstance(item, dict) or len(item) != 1:
        raise RecipeError(source, key, "each step is one name with its options, e.g. '- rtn: {scheme: {bits: 4}}'")
    (name, options), = item.items()
    if name not in STEPS:
        raise RecipeError(source, f"{key}.{name}", f"unknown step; valid steps: {sorted(STEPS)}")
    config = STEPS[name].config
    takes_scheme = "scheme" in {f.name for f in dataclasses.fields(config)}
    if shared_scheme is None or not takes_scheme or not isinstance(options, (dict, type(None))):
        return Step(name, build(config, options, source, f"{key}.{name}"))  # build names a non-mapping
    own = (options or {}).get("scheme")
    if own is not None and not isinstance(own, dict):
        return Step(name, build(config, options, source, f"{key}.{name}"))  # reports the bad value
    merged = {**(options or {}), "scheme": {**shared_scheme, **(own or {})}}  # the step's keys win
    try:
        return Step(name, build(config, merged, source, f"{key}.{name}"))
    except RecipeError as err:
        if own is not None or not err.key.startswith(f"{key}.{name}.scheme"):
            raise
        raise RecipeError(source, "scheme", f"{key} ({name}) cannot take the recipe's scheme: "
                          f"{str(err).split(': ', 2)[-1]}; give that step its own scheme") from None


def check_first_steps(steps: tuple[Step, ...], source: str) -> None:
    """A step that rewrites the float model (rotate) comes before every step that calibrates on it."""
    for i, step in enumerate(steps):
        if i > 0 and STEPS[step.name].runs_first:
            raise RecipeError(source, f"steps[{i}].{step.name}", "must be the recipe's first step: it rewrites the "
                              "float model that every later step calibrates on and quantizes")


def check_after_weights(steps: tuple[Step, ...], source: str) -> None:
    """A step that trains quantized weights (distill) comes after a step that writes them."""
    for i, step in enumerate(steps):
        if STEPS[step.name].follows_weights and not any(STEPS[s.name].writes(s.config) for s in steps[:i]):
            raise RecipeError(source, f"steps[{i}].{step.name}", "must come after a weight step (rtn, gptq, "
                              "signround, ...): it trains the scales that step writes")


def check_search_grids(steps: tuple[Step, ...], source: str) -> None:
    """A scale search (awq, smoothquant's alpha grid) tunes for the grid of the weight step after
    it: a different grid there would quantize with scales searched for another one."""
    for i, step in enumerate(steps):
        searched = STEPS[step.name].searches(step.config)
        later = [(j, s) for j, s in enumerate(steps) if j > i and STEPS[s.name].writes(s.config) is not None]
        if searched is None or not later:
            continue
        j, writer = later[0]
        written = STEPS[writer.name].writes(writer.config).weights
        if written != searched:
            raise RecipeError(source, f"steps[{i}].{step.name}.scheme",
                              f"searches scales for {LinearScheme(searched).describe()}, but steps[{j}].{writer.name} "
                              f"quantizes to {LinearScheme(written).describe()}; set one scheme at the "
                              "recipe's top level for both")


def apply_override(data: dict, item: str, source: str) -> None:
    """`a.b.c=value` sets data['a']['b']['c'] (list items by index); the value is parsed as YAML."""
    path, sep, raw = item.partition("=")
    if not sep or not path:
        raise RecipeError("--set", item, "expected key.path=value, e.g. calibration.samples=64")
    value = parse_yaml(raw, "--set", item)
    keys = path.split(".")
    node = data
    for i, k in enumerate(keys[:-1]):
        node = _descend(node, k, keys[i + 1], source, ".".join(keys[: i + 1]))
    last = keys[-1]
    if isinstance(node, list):
        node[_index(node, last, path)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise RecipeError("--set", path, f"cannot set a key inside {type(node).__name__}")


def _descend(node, key: str, next_key: str, source: str, where: str):
    if isinstance(node, list):
        i = _index(node, key, where)
        if isinstance(node[i], str):  # a step listed by name alone (`- rtn`): give it options to set
            node[i] = {node[i]: {}}
        return node[i]
    if not isinstance(node, dict):
        raise RecipeError(source, where, f"cannot set a key inside {type(node).__name__}")
    if node.get(key) is None:
        node[key] = {}
    return node[key]


def _index(node: list, key: str, where: str) -> int:
    if not (key.isascii() and key.isdigit()) or int(key) >= len(node):  # "²" is a digit int() refuses
        raise RecipeError("--set", where, f"list index must be 0..{len(node) - 1}, got {short_repr(key)}")
    return int(key)
