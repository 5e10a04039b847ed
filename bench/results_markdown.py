"""Markdown pieces the generated results pages share (bench/results_tables.py, bench/results_blocks.py)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
NOT_RECORDED = "not recorded"
PROVENANCE = (("date", "date"), ("commit", "commit"), ("cpu", "CPU"), ("gpu", "GPU"))
MIB = 2**20


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def recorded(record: dict, key: str) -> str:
    """A provenance field from the top level, the environment section (gpu_check) or the measured one
    (results.json); absent or null is 'not recorded'."""
    value = record.get(key, (record.get("environment") or record.get("measured") or {}).get(key))
    return NOT_RECORDED if value in (None, "") else str(value)


def provenance_lines(record: dict) -> list[str]:
    lines = [f"- {label}: {recorded(record, key)}" for key, label in PROVENANCE]
    lines += [f"- {key}: {record[key]}" for key in ("command", "note") if record.get(key)]
    return lines + [""]


def number(value, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def shown(path: Path) -> str:
    """A path as the repository names it where it lies inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
