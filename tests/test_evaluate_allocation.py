"""The multiple-choice knapsack behind `lowbit fit`: against brute force on small instances."""
from __future__ import annotations

import itertools
import random

import pytest

from lowbit.evaluate.allocation import allocate, smallest_bytes
from lowbit.evaluate.sensitivity import Option


def random_options(rng: random.Random, linears: int, per: int) -> dict[str, list[Option]]:
    out = {}
    for i in range(linears):
        sizes = sorted(rng.sample(range(100, 1000), per))
        losses = sorted((rng.random() for _ in range(per)), reverse=True)  # more bytes, less loss
        out[f"l{i}"] = [Option(f"t{j}", b, loss) for j, (b, loss) in enumerate(zip(sizes, losses))]
    return out


def brute_force(options, budget: int) -> float:
    best = float("inf")
    for combo in itertools.product(*options.values()):
        if sum(o.bytes for o in combo) <= budget:
            best = min(best, sum(o.loss for o in combo))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_with_one_byte_cells_the_plan_is_the_optimum(seed):
    rng = random.Random(seed)
    options = random_options(rng, 5, 3)
    budget = rng.randint(smallest_bytes(options), sum(max(o.bytes for o in v) for v in options.values()))
    plan = allocate(options, budget, cells=budget)
    assert plan.unit == 1
    assert plan.bytes <= budget
    assert plan.loss == pytest.approx(brute_force(options, budget), abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_with_coarse_cells_the_plan_fits_and_beats_the_optimum_of_the_budget_less_its_slack(seed):
    rng = random.Random(seed)
    options = random_options(rng, 6, 4)
    budget = rng.randint(smallest_bytes(options) + 400, sum(max(o.bytes for o in v) for v in options.values()))
    plan = allocate(options, budget, cells=50)
    assert plan.unit > 1 and plan.bytes <= budget
    assert plan.loss <= brute_force(options, budget - plan.slack) + 1e-12
    assert plan.loss >= brute_force(options, budget) - 1e-12  # it cannot beat the true optimum


def test_a_budget_below_the_smallest_plan_is_refused_with_the_smallest_plan_s_size():
    options = {"a": [Option("q4_0", 100, 1.0), Option("q8_0", 200, 0.1)]}
    with pytest.raises(ValueError, match="below the smallest plan, 100 bytes"):
        allocate(options, 99)


def test_more_budget_never_costs_loss_and_ties_take_fewer_bytes():
    options = {"a": [Option("q4_0", 100, 1.0), Option("q5_0", 150, 1.0), Option("q8_0", 200, 0.0)],
               "b": [Option("q4_0", 100, 0.5), Option("f16", 400, 0.0)]}
    assert allocate(options, 250).choice["a"].kind == "q4_0"  # q5_0 costs more and gains nothing
    losses = [allocate(options, b).loss for b in range(200, 700, 25)]
    assert losses == sorted(losses, reverse=True)
    assert allocate(options, 600).loss == 0.0


def test_a_budget_of_exactly_the_smallest_plan_gets_it_however_coarse_the_cells():
    rng = random.Random(7)
    options = random_options(rng, 40, 4)
    floor = smallest_bytes(options)
    plan = allocate(options, floor, cells=10)
    assert plan.bytes == floor
    assert all(o.bytes == min(x.bytes for x in options[n]) for n, o in plan.choice.items())


def test_a_budget_of_exactly_the_least_loss_plan_gets_it_however_coarse_the_cells():
    """Rounding sizes up to whole cells could leave the widest plan just out of reach (a 16 bits per
    weight budget planned one linear below f16); a budget that holds every linear's least-loss
    option gets that plan, the optimum of any budget."""
    options = random_options(random.Random(11), 40, 4)
    widest = sum(max(x.bytes for x in opts) for opts in options.values())  # losses fall as bytes grow
    plan = allocate(options, widest, cells=10)
    assert plan.bytes == widest and plan.loss == sum(min(x.loss for x in opts) for opts in options.values())
    assert allocate(options, widest - 1, cells=10).loss > plan.loss
