"""Report generation from synthetic results.json files."""
import base64
import json
import re

import pytest

from lowbit.evaluate.report import write_report
from lowbit.evaluate.report_data import layer_errors, load_runs, pareto_front, rows_for


def _speed(decode):
    return {"1": {"prefill_tok_s": 10 * decode, "ttft_s": 0.5, "tpot_s": 1 / decode, "decode_tok_s": decode,
                  "achieved_gbs": 1.0, "roofline_decode_tok_s": 3 * decode},
            "4": {"decode_tok_s": 3 * decode}}


def _results(name, ppl, weights, decode, layers=None, baselines=None):
    return {
        "model": {"id": "tiny"}, "recipe": {"name": name},
        "quality": {"perplexity": ppl, "baseline_perplexity": 10.0,
                    "kl": {"kl_mean": (ppl - 10) / 100, "kl_p99": (ppl - 10) / 10, "top1_agreement": 0.9}},
        "memory": {"weight_bytes": weights, "baseline_weight_bytes": 4 * 2**20,
                   "fit": [{"budget_gib": 8, "max_context": 1000, "max_sequences": 7, "at_context": 512}]},
        "timing": {}, "steps": [{"name": "gptq", "layers": layers}] if layers else [{"name": "rtn"}],
        "speed": {"model": _speed(decode), "baseline": _speed(5.0)},
        **({"baselines": baselines} if baselines else {}),
    }


def test_pareto_front_minimises_both():
    pts = [(1, 5), (2, 2), (3, 3), (5, 1), (2, 6)]
    assert pareto_front(pts) == [0, 1, 3]


def test_layer_errors_expand_gptq_per_linear_records():
    """GPTQ records per layer {"layer", "seconds", "linears": {name: {"loss", ...}}}: one point
    per linear, in model order."""
    steps = [{"name": "gptq", "layers": [
        {"layer": "model.layers.0", "seconds": 1.0,
         "linears": {"model.layers.0.q": {"loss": 0.5, "retries": 0}, "model.layers.0.o": {"loss": 0.25}}},
        {"layer": "model.layers.1", "seconds": 1.0, "linears": {"model.layers.1.q": {"loss": 2.0}}}]}]
    assert layer_errors(steps) == {"gptq#0": [("model.layers.0.q", 0.5), ("model.layers.0.o", 0.25),
                                              ("model.layers.1.q", 2.0)]}


def test_layer_errors_accept_mapping_and_records():
    steps = [{"name": "gptq", "layers": {"a": 0.1, "b": {"error": 0.2}}},
             {"name": "awq", "layers": [{"name": "c", "mse": 3}]}, {"name": "rtn"}]
    assert layer_errors(steps) == {"gptq#0": [("a", 0.1), ("b", 0.2)], "awq#1": [("c", 3.0)]}


def test_rows_add_baseline_once_and_report_unavailable_bnb():
    runs = [_results("w8", 10.1, 2**20, 4.0, baselines={"bnb-nf4": {"unavailable": "RuntimeError: no CPU"}}),
            _results("w4", 10.8, 2**19, 6.0, baselines={"bnb-nf4": {"unavailable": "RuntimeError: no CPU"}})]
    rows, notes = rows_for(runs)
    assert [r["label"] for r in rows] == ["w8", "unquantized (weights as loaded; bytes as 16-bit)", "w4"]
    assert rows[0]["ppl_increase_pct"] == pytest.approx(1.0)
    assert rows[1]["decode_tok_s"] == 5.0 and rows[1]["kl_mean"] == 0.0
    assert notes == ["bnb-nf4 on tiny: unavailable: RuntimeError: no CPU"]


def test_baseline_row_says_what_it_ran_in():
    run = _results("w8", 10.1, 2**20, 4.0)
    run["model"]["dtype"] = "float32"
    rows, _ = rows_for([run])
    assert rows[1]["label"] == "unquantized (float32 weights; bytes as 16-bit)"


def _pngs(page):
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_report_html_is_self_contained_with_plots_and_numbers(tmp_path):
    dirs = []
    for i, (name, ppl, w, d) in enumerate([("w8", 10.1, 2**20, 4.0), ("w4", 10.8, 2**19, 6.0)]):
        folder = tmp_path / name
        folder.mkdir()
        layers = {"l0": 0.01, "l1": 0.02} if name == "w4" else None
        (folder / "results.json").write_text(json.dumps(_results(name, ppl, w, d, layers)))
        dirs.append(folder)
    out = write_report(load_runs(dirs), tmp_path / "cmp" / "report.html")
    page = out.read_text()
    pngs = _pngs(page)
    assert len(pngs) == 3 and all(p.startswith(b"\x89PNG") for p in pngs)  # speed, memory, per-layer
    assert "10.8000" in page and "+8.00" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched when opened
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "| w4 | lowbit | 10.8000 | +8.00 |" in md


def test_report_without_speed_or_layers_says_so(tmp_path):
    r = _results("w8", 10.1, 2**20, 4.0)
    del r["speed"]
    out = write_report([r], tmp_path / "report.html")
    page = out.read_text()
    assert len(_pngs(page)) == 1  # memory only
    assert "enable evaluate.speed" in page and "No step recorded per-layer errors" in page


def test_load_runs_names_a_folder_without_results(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results.json"):
        load_runs([tmp_path])


def test_gpu_speed_gets_its_own_column(tmp_path):
    r = _results("w8", 10.1, 2**20, 4.0)
    r["speed"]["cuda"] = {"model": {"1": {"decode_tok_s": 321.0}}}
    page = write_report([r], tmp_path / "report.html").read_text()
    assert "GPU decode tok/s (b1)" in page and "321.0" in page


def test_speed_note_names_the_kernels_timed_and_why_the_reference_ran(tmp_path):
    fast, slow = _results("w4", 10.8, 2**19, 6.0), _results("w8", 10.1, 2**20, 4.0)
    fast["speed"].update(backends={"model": {"cpu_avx2": 154}}, cpu="x86_64 avx2 kernels, bf16 emulated")
    slow["speed"]["backends"] = {"model": {"reference (no CPU kernel variant: this aarch64 CPU has no avx2)": 154}}
    page = write_report([fast, slow], tmp_path / "report.html").with_suffix(".md").read_text()
    assert "CPU: x86_64 avx2 kernels, bf16 emulated." in page
    assert "w4: 154 x cpu_avx2" in page
    assert "w8: 154 x reference (no CPU kernel variant: this aarch64 CPU has no avx2)" in page


def test_memory_table_puts_the_measured_increase_beside_the_prediction():
    from lowbit.evaluate.report import memory_table

    mib = 2**20
    run = _results("w4", 11.0, 2 * mib, 10.0)
    run["memory"]["predicted"] = {"batch": 1, "context": 2048, "kv_cache": 8 * mib, "activations": 4 * mib,
                                  "total": 14 * mib}
    run["memory"]["measured_peak"] = {"batch": 4, "context": 512, "decode_tokens": 4, "dtype": "float32",
                                      "process": "fresh subprocess", "model_resident_bytes": 30 * mib,
                                      "increase_bytes": 45 * mib, "predicted_kv_plus_activations": 30 * mib}
    rows, _ = rows_for([run])
    head, body = memory_table(rows)
    line = dict(zip(head, body[0]))
    assert line["measured: prefill batch x context + decoded"] == "4 x 512 + 4 (float32, fresh subprocess)"
    assert (line["loaded model resident MiB"], line["measured increase MiB"]) == ("30.0", "45.0")
    assert line["measured / predicted"] == "1.50"


def _full_run():
    """Every figure measured; the quantized model holds the trained context in 24 GiB only, the
    unquantized one not even there."""
    run = _results("w4", 10.8, 2**20, 6.0)
    run["memory"].update(model_max_context=2048,
                         fit=[{"budget_gib": 8, "max_context": 1000, "max_sequences": 0, "at_context": 4096},
                              {"budget_gib": 24, "max_context": 100_000, "max_sequences": 3, "at_context": 4096}],
                         baseline_fit=[{"budget_gib": 8, "max_context": 0, "max_sequences": 0, "at_context": 4096},
                                       {"budget_gib": 24, "max_context": 1500, "max_sequences": 0,
                                        "at_context": 4096}])
    return run


def _section(md, title):
    return md.split(f"## {title}\n")[1].split("\n## ")[0].strip()


def test_report_leads_with_a_verdict_of_size_quality_and_fit(tmp_path):
    out = write_report([_full_run()], tmp_path / "report.html")
    md = out.with_suffix(".md").read_text()
    assert md.split("\n## ")[1].startswith("Verdict")  # before any table
    assert _section(md, "Verdict") == (
        "- w4: 4.00x smaller weights (4.0 -> 1.0 MiB). Quality: perplexity 10.00 -> 10.80 (+8.00%), "
        "mean KL 0.008 nats, top-1 agreement 90.0%. Fits: 24 GiB at the full trained context (2,048 tokens); "
        "8 GiB up to 1,000 of 2,048 trained tokens (unquantized: 24 GiB up to 1,500 of 2,048 trained tokens; "
        "not in 8 GiB).")
    page = out.read_text()
    assert "<h2>Verdict</h2><ul><li>w4: 4.00x smaller weights" in page
    assert "decode tok/s (b1)" in _section(md, "Summary")  # speed was timed: its columns stay


def _md_tables(md):
    """Each markdown table as its list of columns (header cell first)."""
    tables = [block.splitlines() for block in md.split("\n\n") if block.startswith("| ")]
    rows = [[[c.strip() for c in line.strip("|").split("|")] for line in t if not line.startswith("|---")]
            for t in tables]
    return [list(zip(*t)) for t in rows]


def test_a_run_without_kl_or_speed_says_so_and_shows_no_empty_columns(tmp_path):
    run = _full_run()
    del run["quality"]["kl"], run["speed"]
    md = write_report([run], tmp_path / "report.html").with_suffix(".md").read_text()
    verdict = _section(md, "Verdict")
    assert "perplexity 10.00 -> 10.80 (+8.00%). Not measured: mean KL, top-1 agreement." in verdict
    summary = _section(md, "Summary").splitlines()[0]
    assert "KL mean" not in summary and "top-1" not in summary and "tok/s" not in summary and "TTFT" not in summary
    columns = [col for table in _md_tables(md) for col in table]
    assert columns and not [col[0] for col in columns if all(cell == "–" for cell in col[1:])]


def test_verdict_does_not_cap_an_unknown_trained_context():
    from lowbit.evaluate.report_verdict import fit_phrase

    row = {"fit": [{"budget_gib": 8, "max_context": 5000}, {"budget_gib": 80, "max_context": 90_000}]}
    assert fit_phrase(row) == ("Fits: 8 GiB up to 5,000 tokens; 80 GiB up to 90,000 tokens. "
                               "The trained context is not recorded, so contexts are not capped.")
    assert fit_phrase({**row, "model_max_context": 4096}) == (
        "Fits: 8 and 80 GiB at the full trained context (4,096 tokens).")
    assert fit_phrase({"fit": []}) == "What fits: not recorded."


def test_drop_empty_columns_keeps_only_columns_with_a_figure():
    from lowbit.evaluate.report import drop_empty_columns

    head = ["scheme", "ppl", "KL", "tok/s", "note"]
    body = [["w4", "10.8", "–", "–", ""], ["w8", "10.1", "0.01", "–", ""]]
    assert drop_empty_columns(head, body) == (["scheme", "ppl", "KL"], [["w4", "10.8", "–"], ["w8", "10.1", "0.01"]])
    assert drop_empty_columns(head, []) == (head, [])  # no rows: the header still says what it would hold
