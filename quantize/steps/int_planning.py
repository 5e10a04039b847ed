"""Weight steps under a format per linear (IntTypes): which linears get which IntScheme."""
from __future__ import annotations

from lowbit.calibrate.arch import linear_weight
from lowbit.quantize.grids.int_plan import PLANNED_SIXTEEN_BIT, IntTypes
from lowbit.quantize.grids.integer import IntScheme, check_group_size
from lowbit.quantize.steps.context import StepContext
from lowbit.quantize.targets import Targets, select_targets


def planned_targets(ctx: StepContext, types: IntTypes) -> tuple[Targets, dict[str, IntScheme]]:
    """The targets and each one's IntScheme, every group size checked before anything changes;
    linears the plan keeps 16-bit move to targets.ignored."""
    targets = select_targets(ctx.model, ctx.arch, ctx.ignore)
    schemes = {}
    for name in list(targets.linears):
        scheme = types.scheme_of(name)
        if scheme is None:
            targets.ignored[name] = PLANNED_SIXTEEN_BIT
            del targets.linears[name]
            continue
        check_group_size(scheme, linear_weight(targets.linears[name]).shape[1], name)
        schemes[name] = scheme
    return targets, schemes


def by_scheme(prefix: str, members: list[str], schemes: dict[str, IntScheme]) -> dict[IntScheme, list[str]]:
    """A layer group's members (names relative to the layer at `prefix`) split by their scheme."""
    out: dict[IntScheme, list[str]] = {}
    for name in members:
        out.setdefault(schemes[f"{prefix}.{name}"], []).append(name)
    return out
