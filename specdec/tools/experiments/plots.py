"""Plots of a sweep's DataFrame (``specdec.tools.experiments.sweep``), with matplotlib.

Each function takes the per-prompt DataFrame and returns a ``matplotlib.figure.Figure`` built without
pyplot (no GUI backend, no global figure state: safe under Agg, in scripts, tests and notebooks; in a
notebook the figure displays as a cell's value, ``fig.savefig(path)`` writes a file). Numbers are
pooled over prompts as ``summarize`` does (τ = 1 + Σ accepted / Σ steps, per-position acceptance
= Σ accepted at i / Σ steps, tokens/s = Σ emitted / Σ batch time).

    per_position_acceptance(df)   acceptance at each draft position, one line per strategy and k
    tau_and_speed(df)             τ and tokens/s against k, one line per strategy and temperature
    accepted_histogram(df)        share of steps that accepted m drafts, per strategy, bars per k
    tau_by_category(df)           τ per prompt category (each strategy at its best k)
    save_all(df, directory)       the four as PNG files
"""
from __future__ import annotations

import os
from pathlib import Path

from .sweep import summarize

__all__ = ["per_position_acceptance", "tau_and_speed", "accepted_histogram", "tau_by_category", "save_all"]

LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def _figure(nrows: int, ncols: int, width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:   # pragma: no cover - depends on the environment
        raise ImportError("specdec.tools.experiments.plots needs matplotlib: pip install 'specdec[experiments]'") from e
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _colors(strategies) -> dict[str, str]:
    return {s: f"C{i % 10}" for i, s in enumerate(dict.fromkeys(strategies))}


def _drafting(summary):
    return summary[summary["strategy"] != "none"]


def _empty(ax, text: str = "no speculative configurations") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def per_position_acceptance(df):
    """Acceptance at each draft position (accepted at position i / steps), one panel per temperature,
    one line per strategy and k."""
    s = _drafting(summarize(df))
    temps = sorted(s["temperature"].unique()) or [0.0]
    fig, axes = _figure(1, len(temps), 4.8, 3.6)
    colors = _colors(s["strategy"])
    for ax, t in zip(axes[0], temps):
        sub = s[s["temperature"] == t]
        if sub.empty:
            _empty(ax)
            continue
        for _, r in sub.iterrows():
            ks = sorted(s[s["strategy"] == r["strategy"]]["k"].unique())
            pos = r["per_position_acceptance"]
            ax.plot(range(1, len(pos) + 1), pos, color=colors[r["strategy"]],
                    marker=MARKERS[ks.index(r["k"]) % len(MARKERS)], alpha=0.55 + 0.45 * (r["k"] == max(ks)),
                    label=f"{r['strategy']} k={r['k']}")
        ax.set(title=f"T = {t:g}", xlabel="draft position", ylabel="acceptance (accepted / steps)", ylim=(0, 1.02))
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Per-position acceptance")
    return fig


def tau_and_speed(df):
    """τ (left) and tokens/s (right) against k, one line per strategy (color) and temperature (line
    style); target-only decoding as a grey horizontal line per temperature."""
    from matplotlib.lines import Line2D
    s = summarize(df)
    fig, axes = _figure(1, 2, 5.0, 3.6)
    ax_tau, ax_speed = axes[0]
    colors = _colors(_drafting(s)["strategy"])
    temps = sorted(s["temperature"].unique())
    styles = {t: LINESTYLES[j % len(LINESTYLES)] for j, t in enumerate(temps)}
    has_target = False
    for t in temps:
        base = s[(s["strategy"] == "none") & (s["temperature"] == t)]
        if not base.empty:
            has_target = True
            ax_speed.axhline(base["tokens_per_s"].iloc[0], color="grey", linestyle=styles[t])
            ax_tau.axhline(1.0, color="grey", linestyle=styles[t])
        for strategy, g in _drafting(s[s["temperature"] == t]).groupby("strategy", sort=False):
            g = g.sort_values("k")
            for ax, col in ((ax_tau, "tau"), (ax_speed, "tokens_per_s")):
                ax.plot(g["k"], g[col], color=colors[strategy], linestyle=styles[t], marker="o")
    ax_tau.set(title="Mean acceptance length τ", xlabel="k (draft tokens per step / tree depth)", ylabel="τ")
    ax_speed.set(title="Throughput", xlabel="k (draft tokens per step / tree depth)", ylabel="tokens / s")
    for ax in (ax_tau, ax_speed):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=c, marker="o", label=name) for name, c in colors.items()]
    handles += [Line2D([], [], color="grey", label="target only")] if has_target else []
    handles += [Line2D([], [], color="black", linestyle=styles[t], label=f"T = {t:g}") for t in temps]
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    return fig


def accepted_histogram(df):
    """Share of steps that accepted exactly m drafts (m = 0..k): one panel per strategy (columns) and
    temperature (rows), bars grouped by k."""
    s = _drafting(summarize(df))
    strategies = list(dict.fromkeys(s["strategy"]))
    temps = sorted(s["temperature"].unique())
    fig, axes = _figure(max(1, len(temps)), max(1, len(strategies)), 4.2, 3.2)
    if s.empty:
        _empty(axes[0][0])
        return fig
    for i, t in enumerate(temps):
        for j, strategy in enumerate(strategies):
            ax = axes[i][j]
            sub = s[(s["temperature"] == t) & (s["strategy"] == strategy)].sort_values("k")
            if sub.empty:
                _empty(ax, "not run")
                continue
            width = 0.8 / len(sub)
            for n, (_, r) in enumerate(sub.iterrows()):
                hist = r["accepted_histogram"]
                total = sum(hist) or 1
                ax.bar([m - 0.4 + width * (n + 0.5) for m in range(len(hist))], [h / total for h in hist],
                       width=width, color=f"C{n % 10}", label=f"k={r['k']}")
            ax.set(title=f"{strategy}, T = {t:g}", xlabel="drafts accepted in a step", ylabel="share of steps")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize="small")
    fig.suptitle("Accepted drafts per step")
    return fig


def tau_by_category(df, k: int | str = "best"):
    """τ per prompt category, one panel per temperature, bars per strategy. ``k``: "best" (each
    strategy at the k with the highest overall τ at that temperature), "all" (every k), or an int."""
    pd_df = df[df["strategy"] != "none"]
    temps = sorted(pd_df["temperature"].unique()) or [0.0]
    fig, axes = _figure(1, len(temps), 6.0, 3.6)
    if pd_df.empty:
        _empty(axes[0][0])
        return fig
    for ax, t in zip(axes[0], temps):
        sub = pd_df[pd_df["temperature"] == t]
        overall = summarize(sub)
        if k == "best":
            keep = overall.loc[overall.groupby("strategy", sort=False)["tau"].idxmax(), "config"]
        elif k == "all":
            keep = overall["config"]
        else:
            keep = overall[overall["k"] == k]["config"]
        sub = sub[sub["config"].isin(set(keep))]
        if sub.empty:
            _empty(ax, f"no configuration with k={k}")
            continue
        cats = list(dict.fromkeys(sub["category"].fillna("none")))
        sub = sub.assign(category=sub["category"].fillna("none"))
        confs = list(dict.fromkeys(sub["config"]))
        width = 0.8 / len(confs)
        colors = _colors(sub["strategy"])
        for n, conf in enumerate(confs):
            g = sub[sub["config"] == conf]
            by_cat = g.groupby("category")[["accepted", "steps"]].sum()
            taus = [1 + by_cat.loc[c, "accepted"] / by_cat.loc[c, "steps"]
                    if c in by_cat.index and by_cat.loc[c, "steps"] else float("nan") for c in cats]
            first = g.iloc[0]
            ax.bar([x - 0.4 + width * (n + 0.5) for x in range(len(cats))], taus, width=width,
                   color=colors[first["strategy"]] if k != "all" else f"C{n % 10}",
                   label=f"{first['strategy']} k={first['k']}")
        ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"T = {t:g}", ylabel="τ (mean acceptance length)")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)      # room for the legend above the bars
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small", loc="upper left", ncol=min(4, len(confs)))
    fig.suptitle("τ by prompt category")
    return fig


def save_all(df, directory: str | os.PathLike, dpi: int = 100) -> dict[str, Path]:
    """The four plots as ``directory/<name>.png``; returns {name: path}."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for fn in (per_position_acceptance, tau_and_speed, accepted_histogram, tau_by_category):
        path = directory / f"{fn.__name__}.png"
        fn(df).savefig(path, dpi=dpi)
        out[fn.__name__] = path
    return out
