"""The run's audit and `lowbit audit` of the folder it wrote are one function and say the same:
the verdict (exit code), the headline the run printed and results.json records, and every line
(what the linears hold, each float linear and why, damping, fallbacks, problems). Used on every
shipped recipe's pinned checkpoint (test_recipe_pins.py) and on the hostile cases
(test_audit_agreement.py)."""
from __future__ import annotations

import json
from pathlib import Path

from lowbit.app.cli import main
from lowbit.quantize.audit import headline, report_lines

RUN_LINE = "audit       "


def assert_audits_agree(out: Path, run_stdout: str, capsys) -> dict:
    """`lowbit audit OUT` against the run that wrote OUT (its stdout, its results.json); returns
    the recorded audit."""
    recorded = json.loads((Path(out) / "results.json").read_text())["audit"]
    line = headline(recorded)
    assert RUN_LINE + line in run_stdout.splitlines(), (line, run_stdout)  # what the run printed
    code = main(["audit", str(out)])
    first, *rest = capsys.readouterr().out.splitlines()
    assert first == f"{RUN_LINE}{out}: {line}"
    said = [r.strip() for r in rest if not r.strip().startswith("integrity")]
    assert sorted(said) == sorted(report_lines(recorded)), (said, report_lines(recorded))
    assert code == (0 if recorded["passed"] else 1)
    return recorded
