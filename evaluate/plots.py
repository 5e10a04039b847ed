"""The report's figures (matplotlib, headless), returned as PNG bytes."""
from __future__ import annotations

import io

from .report_data import layer_errors, loss_of, pareto_front

KIND_STYLE = {"lowbit": ("o", "tab:blue"), "baseline": ("s", "black"), "bnb": ("^", "tab:orange"),
              "plan": ("D", "tab:red")}


def _figure(width=7.0, height=4.5, ncols=1):
    import matplotlib

    matplotlib.use("Agg")  # no display: reports are written on servers
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(1, ncols, figsize=(width, height), dpi=110)


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def tradeoff_plot(rows: list[dict], x_key: str, x_label: str, higher_x_better: bool,
                  x_scale: float = 1.0) -> bytes | None:
    """Quality loss against one cost (speed or memory); Pareto-optimal points joined and ringed."""
    pts = [(r[x_key] * x_scale, loss_of(r), r) for r in rows if r.get(x_key) is not None and loss_of(r) is not None]
    if not pts:
        return None
    plt, fig, ax = _figure()
    for x, y, r in pts:
        marker, color = KIND_STYLE.get(r["kind"], ("o", "gray"))
        ax.scatter(x, y, marker=marker, color=color, s=45, zorder=3)
        ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    front = pareto_front([(-x if higher_x_better else x, y) for x, y, _ in pts])
    fx = sorted((pts[i][0], pts[i][1]) for i in front)
    ax.plot([p[0] for p in fx], [p[1] for p in fx], "--", color="tab:green", zorder=2, label="Pareto front")
    ax.scatter([p[0] for p in fx], [p[1] for p in fx], s=160, facecolors="none", edgecolors="tab:green", zorder=4)
    uses_ppl = all(r["ppl_increase_pct"] is not None for _, _, r in pts)
    ax.set_ylabel("perplexity increase vs unquantized (%)" if uses_ppl else "mean KL vs unquantized (nats)")
    ax.set_xlabel(x_label + ("  (→ better)" if higher_x_better else "  (← better)"))
    ax.margins(x=0.2, y=0.12)  # room for the labels
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _png(plt, fig)


def layer_error_plot(rows: list[dict]) -> bytes | None:
    """Per-linear error of each run's steps that recorded one, in model order."""
    series = [(f"{r['label']} {step}", pairs) for r in rows for step, pairs in layer_errors(r.get("steps")).items()]
    if not series:
        return None
    plt, fig, ax = _figure(9.0, 4.5)
    for name, pairs in series:
        ax.plot(range(len(pairs)), [v for _, v in pairs], marker=".", label=name)
    ax.set_xlabel("quantized linear (model order)")
    ax.set_ylabel("error recorded by the step")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(plt, fig)


def budget_plot(rows: list[dict]) -> bytes | None:
    """lowbit fit plans against the other (uniform) runs of the same model: perplexity increase
    and mean KL over weight memory, each group joined in order of size."""
    plans = [r for r in rows if r["kind"] == "plan" and r.get("weight_bytes")]
    if not plans:
        return None
    uniform = [r for r in rows if r["kind"] == "lowbit" and r.get("weight_bytes")]
    plt, fig, axes = _figure(11.0, 4.2, ncols=2)
    for ax, key, label in ((axes[0], "ppl_increase_pct", "perplexity increase vs unquantized (%)"),
                           (axes[1], "kl_mean", "mean KL vs unquantized (nats)")):
        for group, kind, name in ((uniform, "lowbit", "uniform recipes"), (plans, "plan", "lowbit fit plans")):
            pts = sorted((r["weight_bytes"] / 2**20, r[key], r["label"]) for r in group if r.get(key) is not None)
            marker, color = KIND_STYLE[kind]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=name)
            for x, y, text in pts:
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
        ax.set_xlabel("weight memory (MiB)  (← better)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _png(plt, fig)
