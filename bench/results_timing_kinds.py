"""Two kinds of docs/results file for bench/results_tables.py: recipe_times (bench/recipe_times.py:
recipes timed back to back) and rounding_reach (bench/rounding_reach.py: learned rounding and GPTQ on
each linear's own objective)."""
from __future__ import annotations

from results_markdown import NOT_RECORDED, number, provenance_lines, table


def is_recipe_times(record: dict) -> bool:
    rows = record.get("recipes")
    return isinstance(rows, list) and bool(rows) and all(isinstance(r, dict) and "times_unit" in r for r in rows)


def recipe_times_section(record: dict) -> list[str]:
    """Each recipe's quantize time, and as a multiple of the first's, from one run."""
    lines = provenance_lines(record) + [f"{record.get('model', NOT_RECORDED)}, one run after another; kernels: "
                                        f"{record.get('kernels', NOT_RECORDED)}.", ""]
    rows = [[f"`{r['recipe']}`", number(r["quantize_s"], 1), f"{r['times_unit']:.2f}"] for r in record["recipes"]]
    return lines + table(["recipe", "quantize s", f"x `{record.get('unit', NOT_RECORDED)}`"], rows)


def is_rounding_reach(record: dict) -> bool:
    rows = record.get("layers")
    return isinstance(rows, list) and bool(rows) and all(isinstance(r, dict) and "gptq_within_reach" in r
                                                         for r in rows)


def rounding_reach_section(record: dict) -> list[str]:
    """Per layer: the output error GPTQ and learned rounding leave, as a share of round-to-nearest's,
    and how many of GPTQ's codes learned rounding could express."""
    lines = provenance_lines(record) + [
        f"{record.get('model', NOT_RECORDED)}, {record.get('grid', NOT_RECORDED)}; Hessians from "
        f"{record.get('samples', NOT_RECORDED)} x {record.get('seq_len', NOT_RECORDED)} tokens of wiki; "
        f"signround: {record.get('steps', NOT_RECORDED)} full-batch signed steps on each linear's output error.", ""]
    rows = [[r["layer"], f"{r['gptq_over_rtn']:.3f}", f"{r['signround_over_rtn']:.3f}", f"{r['gptq_within_reach']:.1%}"]
            for r in record["layers"]]
    return lines + table(["layer", "gptq error / rtn's", "signround error / rtn's",
                          "gptq codes within signround's reach"], rows)
