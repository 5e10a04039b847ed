"""rtn_mse, the data-free step added through the step seam: its own file plus a registry entry."""
import pytest
import torch

from tiny_models import make_tiny_model
from lowbit.calibrate.arch import arch_for
from lowbit.quantize.grids.integer import IntScheme, quantize_rtn
from lowbit.quantize.runtime.qlinear import QuantLinear
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.steps.registry import STEPS
from lowbit.quantize.steps.rtn_mse import RTNMSEConfig, quantize_mse
from lowbit.recipes.schema import parse_recipe
from lowbit.app.audit import audit_run

G64 = IntScheme(4, True, "group", 64)


def group_errors(w, qw, scheme):
    return (qw.dequantize() - w).square().reshape(w.shape[0], -1, scheme.group_size).sum(-1)


@pytest.mark.parametrize("scheme", [G64, IntScheme(4, False, "group", 32), IntScheme(3, True, "channel")], ids=str)
def test_every_group_is_at_least_as_good_as_rtn_and_outliers_make_it_better(scheme):
    # heavy tails (Student-t, 3 degrees of freedom), as trained weights have
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 256)) * 0.02
    mse, rtn = quantize_mse(w, RTNMSEConfig(scheme)), quantize_rtn(w, scheme)
    if scheme.strategy == "group":  # the unshrunk range is a candidate: no group gets worse
        assert (group_errors(w, mse, scheme) <= group_errors(w, rtn, scheme) * (1 + 1e-6)).all()
    total_mse, total_rtn = (mse.dequantize() - w).square().sum(), (rtn.dequantize() - w).square().sum()
    assert total_mse < 0.99 * total_rtn
    assert mse.codes.min() >= scheme.qmin and mse.codes.max() <= scheme.qmax


def test_a_recipe_step_quantizes_every_targeted_linear_and_passes_the_audit():
    recipe = parse_recipe({"scheme": {"bits": 4, "strategy": "group", "group_size": 32}, "steps": ["rtn_mse"]}, "test")
    model = make_tiny_model("llama")
    arch = arch_for(model)
    ctx = StepContext(model, arch, recipe.ignore, lambda: pytest.fail("rtn_mse needs no data"))
    steps = [{"name": s.name, **STEPS[s.name].apply(ctx, s.config)} for s in recipe.steps]
    report = audit_run(model, recipe, arch, steps)
    assert report.passed and report.counts() == {"int4 sym group 32": 14}
    assert all(isinstance(model.get_submodule(n), QuantLinear) for n in steps[0]["quantized"])


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="max_shrink"):
        RTNMSEConfig(G64, max_shrink=1.0)
