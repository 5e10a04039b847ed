import pytest

from lowbit.recipes.schema import load_recipe, shipped_recipes
from lowbit.recipes.validate import RecipeError


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_every_shipped_recipe_loads_by_name(name):
    recipe = load_recipe(name)
    assert recipe.name == name and recipe.steps and recipe.model == "smollm2-135m"
    # the LM head stays 16-bit unless the recipe gives it a format of its own (the rotated recipes,
    # whose rotation unties it)
    assert recipe.ignore == ("lm_head",) or "lm_head" in (recipe.scheme or {}).get("formats", {})


def test_shipped_w4a16_rtn_uses_group_64():
    cfg = load_recipe("w4a16-rtn").steps[0].config
    assert (cfg.scheme.bits, cfg.scheme.strategy, cfg.scheme.group_size) == (4, "group", 64)


def test_unknown_key_names_file_key_path_and_valid_keys(tmp_path):
    path = write(tmp_path, "calibration: {samples: 8, sampels: 3}\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    msg = str(err.value)
    assert path in msg and "calibration.sampels" in msg and "samples" in msg and "seq_len" in msg


def test_wrong_type_names_key_and_expected_type(tmp_path):
    path = write(tmp_path, "steps:\n  - rtn: {scheme: {bits: four}}\n")
    with pytest.raises(RecipeError, match=r"steps\[0\]\.rtn\.scheme\.bits: expected int, got a string 'four'"):
        load_recipe(path)


def test_boolean_is_not_an_int(tmp_path):
    with pytest.raises(RecipeError, match="calibration.samples"):
        load_recipe(write(tmp_path, "calibration: {samples: true}\n"))


def test_unknown_step_lists_valid_steps(tmp_path):
    with pytest.raises(RecipeError, match=r"steps\[1\]\.gptqq: unknown step; valid steps: \[.*'rtn'"):
        load_recipe(write(tmp_path, "steps:\n  - rtn: {scheme: {bits: 8}}\n  - gptqq: {}\n"))


def test_invalid_step_values_are_reported_with_their_key(tmp_path):
    with pytest.raises(RecipeError, match=r"steps\[0\]\.rtn\.scheme: group_size is required"):
        load_recipe(write(tmp_path, "steps:\n  - rtn: {scheme: {bits: 4, strategy: group}}\n"))


def test_literal_choices_are_listed(tmp_path):
    with pytest.raises(RecipeError, match=r"export.format: 'onnx' is not valid; choose one of"):
        load_recipe(write(tmp_path, "export: {format: onnx}\n"))


def test_malformed_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "steps: [rtn: {scheme: {bits: 4\n")
    with pytest.raises(RecipeError, match="not valid YAML") as err:
        load_recipe(path)
    assert path in str(err.value)


def test_a_recipe_must_be_a_mapping(tmp_path):
    with pytest.raises(RecipeError, match="a recipe is a mapping"):
        load_recipe(write(tmp_path, "- rtn\n- gptq\n"))


def test_unknown_recipe_name_lists_shipped():
    with pytest.raises(RecipeError, match="w4a16-rtn"):
        load_recipe("no-such-recipe")


def test_python_tags_are_never_executed(tmp_path):
    path = write(tmp_path, "name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(path)


def test_overrides_set_nested_values_and_list_items():
    recipe = load_recipe("w4a16-rtn", ("calibration.samples=16", "scheme.group_size=32",
                                       "model=/some/folder", "evaluate.perplexity.max_tokens=2048"))
    assert recipe.calibration.samples == 16
    assert recipe.steps[0].config.scheme.group_size == 32
    assert recipe.model == "/some/folder"
    assert recipe.evaluate.perplexity.max_tokens == 2048


def test_one_scheme_is_shared_and_a_step_may_override_it():
    # a step listed by name alone (`- rtn`) still takes options through --set
    recipe = load_recipe("w4a16-rtn-kv8", ("steps.0.rtn.scheme.group_size=32",))
    assert recipe.steps[0].config.scheme.group_size == 32 and recipe.scheme["group_size"] == 64


def test_a_scale_search_for_another_grid_than_the_weight_step_writes_is_refused():
    with pytest.raises(RecipeError, match=r"steps\[0\]\.awq\.scheme: searches scales for int4 asym group 64, but "
                                          r"steps\[1\]\.rtn quantizes to int4 asym group 32"):
        load_recipe("w4a16-awq", ("steps.1.rtn.scheme.group_size=32",))


def test_a_step_that_cannot_take_the_shared_scheme_says_so():
    with pytest.raises(RecipeError, match=r"scheme: steps\[0\] \(fp8\) cannot take the recipe's scheme"):
        load_recipe("fp8-dynamic", ("scheme.bits=4",))


def test_override_without_equals_is_an_error():
    with pytest.raises(RecipeError, match="key.path=value"):
        load_recipe("w4a16-rtn", ("calibration.samples",))


def test_resolved_recipe_round_trips_through_yaml(tmp_path):
    import yaml

    recipe = load_recipe("w4a16-rtn")
    again = load_recipe(write(tmp_path, yaml.safe_dump(recipe.to_dict()), "again.yaml"))
    assert again == recipe
