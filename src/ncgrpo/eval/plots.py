"""The paper's figures, from saved files only (records and metrics; never a model).

- :func:`plot_gains`: supplementary "gains" figure: per benchmark, the percentage-point difference
  of each configuration vs. the baseline as grouped bars, the baseline's absolute accuracy beneath
  each label, the OOD-average column shaded, ``*`` above bars with exact McNemar p < 0.05.
- :func:`plot_dynamics`: training dynamics (Figure 1 / supplementary three-method plot): training
  reward on top (per step, faint, and a rolling mean), validation below (the demo's accuracy or TRL's
  eval reward, whichever the runs logged), against step, one colour per training run; and, when a run logged them, a noise panel: the first-token TV between
  clean and noisy rollouts (noise-averaged and per draw) and the noise scale sigma_k.

Both write ``<out_stem>.png`` and ``<out_stem>.pdf``. Figures are built with matplotlib's
object API on the Agg canvas, so no display and no global pyplot state are involved.
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_left
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ncgrpo.eval.report import ComparisonTable, Run, compare
from ncgrpo.runs.folder import METRICS_FILE, iter_json_lines

#: Noise-panel metrics (written by the trainer for hidden-noise methods).
SIGMA_KEY = "noise/sigma_k"
MARGINAL_TV_KEY = "noise/first_token_marginal_tv"
PER_DRAW_TV_KEY = "noise/first_token_tv"
#: key -> (line label suffix, line style, legend text)
_NOISE_STYLES = {
    MARGINAL_TV_KEY: ("marginal TV", "-", "first-token TV, noise-averaged (what rollouts see)"),
    PER_DRAW_TV_KEY: ("per-draw TV", "--", "first-token TV, per draw"),
    SIGMA_KEY: ("sigma_k", ":", r"$\sigma_k$, noise scale"),
}

_COLORS = ["#3b6ea8", "#d9822b", "#4e9a4e", "#b04a4a", "#7d5ba6", "#8c6d46", "#c768a8", "#6b6b6b"]


def save_figure(fig: Figure, out_stem: str | Path) -> list[Path]:
    """Write ``fig`` as ``<out_stem>.png`` (200 dpi) and ``<out_stem>.pdf``; returns the two paths."""
    out_stem = Path(out_stem)
    out_stem.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    paths = [out_stem.with_name(out_stem.name + ext) for ext in (".png", ".pdf")]
    for p in paths:
        fig.savefig(p, dpi=200, bbox_inches="tight")
    return paths


# --- gains -----------------------------------------------------------------------------------


def plot_gains(
    table_or_runs: ComparisonTable | Sequence[Run],
    baseline: str | None,
    out_stem: str | Path,
    *,
    benchmarks: Sequence[str] | None = None,
    title: str | None = None,
) -> list[Path]:
    """Grouped bars of accuracy difference (pp) vs. ``baseline`` per benchmark of the main table.

    ``table_or_runs`` is a :class:`ComparisonTable` (its baseline is used) or runs to compare.
    Returns the written paths (PNG, PDF).
    """
    return save_figure(gains_figure(table_or_runs, baseline, benchmarks=benchmarks, title=title), out_stem)


def gains_figure(
    table_or_runs: ComparisonTable | Sequence[Run],
    baseline: str | None,
    *,
    benchmarks: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """The figure :func:`plot_gains` saves (see there), returned unsaved: every check is made here, so
    a caller that builds it first writes nothing when the input is refused."""
    if isinstance(table_or_runs, ComparisonTable):
        ct = table_or_runs
    else:
        if baseline is None:
            raise ValueError("plot_gains needs a baseline name when given runs")
        ct = compare(list(table_or_runs), baseline, benchmarks)
    table = ct.main
    cols = [c for c in table.columns if c.kind in ("benchmark", "avg")]
    base_row = next(r for r in table.rows if r.name == ct.baseline)
    others = [r for r in table.rows if r.name != ct.baseline]
    if not cols or not others:
        raise ValueError("the gains figure needs at least one benchmark and one non-baseline configuration")

    width = min(0.8 / len(others), 0.3)
    fig = Figure(figsize=(max(5.0, 1.05 * len(cols) + 1.5), 3.6))
    ax = fig.add_subplot(1, 1, 1)
    diffs = [0.0]
    for i, row in enumerate(others):
        offset = (i - (len(others) - 1) / 2) * width
        for j, col in enumerate(cols):
            cell, base = row.cells[col.key], base_row.cells[col.key]
            if cell.mean is None or base.mean is None:
                continue
            d = cell.mean - base.mean
            diffs.append(d)
            ax.bar(
                j + offset,
                d,
                width * 0.92,
                color=_COLORS[i % len(_COLORS)],
                zorder=2,
                label=row.name if j == 0 else None,
            )
            if cell.significant:  # star just beyond the bar's end, above or below
                ax.annotate(
                    "*",
                    (j + offset, d),
                    xytext=(0, 1 if d >= 0 else -14),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=12,
                    fontweight="bold",
                )
    lo, hi = min(diffs), max(diffs)
    pad = max(0.3, 0.15 * (hi - lo))
    # headroom for stars and the legend; all-zero gains get a symmetric axis so "no change" reads as such
    ax.set_ylim(lo - pad if lo < 0 or hi <= 0 else 0, hi + 2 * pad)
    for j, col in enumerate(cols):
        if col.kind == "avg":
            ax.axvspan(j - 0.5, j + 0.5, color="0.9", zorder=0)
    ax.axhline(0, color="0.25", linewidth=0.8, zorder=1)
    # Drop a prefix every benchmark shares ("synthetic/geometry" -> "geometry") so labels fit.
    names = [c.label for c in cols if c.kind == "benchmark"]
    prefix = names[0].rsplit("/", 1)[0] + "/" if names and "/" in names[0] else ""
    if not prefix or not all(n.startswith(prefix) for n in names):
        prefix = ""
    labels = []
    for col in cols:
        name = col.label[len(prefix) :] if prefix and col.kind == "benchmark" else col.label
        label = f"{name} (ID)" if col.role == "in_domain" else name
        base = base_row.cells[col.key].mean
        labels.append(f"{label}\n{base:.1f}" if base is not None else label)
    ax.set_xticks(
        range(len(cols)), labels, fontsize=8.5 if max(len(lb.split("\n")[0]) for lb in labels) < 14 else 7.5
    )
    ax.set_xlim(-0.5, len(cols) - 0.5)
    ax.set_ylabel(f"Δ accuracy vs. {ct.baseline} (pp)")
    ax.grid(axis="y", color="0.85", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(frameon=False, fontsize=8.5, loc="upper left", ncol=min(len(others), 3))
    ax.set_title(
        title or f"Gains over {ct.baseline} (its accuracy beneath each label; * p<0.05)", fontsize=9.5
    )
    fig.tight_layout()
    return fig


# --- dynamics --------------------------------------------------------------------------------


def read_metrics(train_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of ``TRAIN_DIR/metrics.jsonl``; a torn tail (bytes after the last newline) is dropped."""
    path = Path(train_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{train_dir}: no {METRICS_FILE}")
    return [row for _, row in iter_json_lines(path, "metrics row")]


def run_label(train_dir: str | Path) -> str:
    """Legend label: ``name`` (or ``run_name``) from run.json / config.json / config.yaml, else the folder."""
    d = Path(train_dir)
    for fname in ("run.json", "config.json", "config.yaml", "config.yml"):
        p = d / fname
        if not p.exists():
            continue
        try:
            if p.suffix == ".json":
                cfg = json.loads(p.read_text(encoding="utf-8"))
            else:
                cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
        except Exception:  # noqa: BLE001 - a broken config only costs the nicer label
            continue
        if isinstance(cfg, dict):
            for key in ("name", "run_name"):
                if isinstance(cfg.get(key), str) and cfg[key]:
                    return cfg[key]
    return d.resolve().name


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = {}
    for row in rows:
        v, step = row.get(key), row.get("step")
        if isinstance(v, bool) or not isinstance(v, int | float) or not isinstance(step, int | float):
            continue
        if math.isfinite(v):
            pts[step] = float(v)  # a re-logged step keeps its last value
    steps = sorted(pts)
    return steps, [pts[s] for s in steps]


def rolling_mean(steps: Sequence[float], values: Sequence[float], window: float) -> list[float]:
    """Centred rolling mean over ``window`` steps: at step ``s``, the mean of the finite values at steps
    in ``[s - window/2, s + window/2)`` (window 10: ``s-5 .. s+4``; window 3: ``s-1 .. s+1``).

    The window is in steps, not rows, so a gap in the log (a skipped or NaN step) narrows it rather than
    reaching further. Near the ends, and for a run shorter than the window, it averages what is there.
    Non-finite values are left out of every mean; a step whose window holds none gives NaN.
    ``steps`` must be ascending.
    """
    if len(steps) != len(values):
        raise ValueError(f"rolling_mean: {len(steps)} steps but {len(values)} values")
    if not window > 0:
        raise ValueError(f"rolling_mean: window must be > 0 steps, got {window!r}")
    if any(b < a for a, b in zip(steps, steps[1:], strict=False)):
        raise ValueError("rolling_mean: steps must be ascending")
    out = []
    for s in steps:
        lo, hi = bisect_left(steps, s - window / 2), bisect_left(steps, s + window / 2)
        finite = [v for v in values[lo:hi] if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


def _style(ax: Any) -> None:
    ax.grid(color="0.88", linewidth=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _plot_reward(ax: Any, runs: list[tuple[str, list[dict[str, Any]]]], key: str, smooth: int) -> None:
    """Per-step ``key`` faint, with its centred ``smooth``-step rolling mean on top (``smooth`` 1: raw only)."""
    for i, (label, rows) in enumerate(runs):
        steps, vals = _series(rows, key)
        if not steps:
            continue
        color = _COLORS[i % len(_COLORS)]
        marker = "o" if len(steps) <= 12 else None
        if smooth <= 1:
            ax.plot(steps, vals, color=color, label=label, linewidth=1.4, marker=marker, markersize=3.5)
            continue
        ax.plot(
            steps,
            vals,
            color=color,
            alpha=0.3,
            linewidth=0.9,
            marker=marker,
            markersize=3,
            label=f"_{label}: per step",
        )
        ax.plot(steps, rolling_mean(steps, vals, smooth), color=color, label=label, linewidth=1.6)
    what = f" (faint: per step; line: centred {smooth}-step mean)" if smooth > 1 else ""
    ax.set_title(key + what, fontsize=9.5, loc="left")


def _noise_logged(runs: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """The noise-panel keys that some run logs at a numeric step, in drawing order."""
    keys = [MARGINAL_TV_KEY, PER_DRAW_TV_KEY, SIGMA_KEY]
    return [k for k in keys if any(_series(rows, k)[0] for _, rows in runs)]


def _plot_noise(ax: Any, runs: list[tuple[str, list[dict[str, Any]]]], logged: list[str]) -> None:
    """First-token TVs (left axis) and sigma_k (right axis, or the only axis without TVs) per step;
    colour = run (as in the other panels), line style = quantity; runs logging none are absent."""
    tvs = [k for k in logged if k != SIGMA_KEY]
    sigma_ax = (ax.twinx() if tvs else ax) if SIGMA_KEY in logged else None
    top = {id(ax): 0.0, id(sigma_ax): 0.0}
    for i, (label, rows) in enumerate(runs):
        color = _COLORS[i % len(_COLORS)]
        for key in logged:
            steps, vals = _series(rows, key)
            if steps:
                on = sigma_ax if key == SIGMA_KEY else ax
                name, style, _ = _NOISE_STYLES[key]
                on.plot(steps, vals, color=color, linestyle=style, linewidth=1.3, label=f"{label}: {name}")
                top[id(on)] = max(top[id(on)], *vals)
    # both axes from 0 (so "annealed away" is the common floor) with headroom for the legend
    if tvs:
        ax.set_ylabel("first-token TV", fontsize=8.5)
        ax.set_ylim(0, 1.6 * top[id(ax)] or 1.0)
    if sigma_ax is not None:
        sigma_ax.set_ylabel(r"$\sigma_k$ (noise scale)", fontsize=8.5)
        sigma_ax.set_ylim(0, 1.6 * top[id(sigma_ax)] or 1.0)
        if sigma_ax is not ax:
            sigma_ax.spines["top"].set_visible(False)
    sigma_text = _NOISE_STYLES[SIGMA_KEY][2] + (" (right axis)" if tvs else "")
    handles = [
        Line2D(
            [],
            [],
            color="0.3",
            linestyle=_NOISE_STYLES[k][1],
            linewidth=1.3,
            label=sigma_text if k == SIGMA_KEY else _NOISE_STYLES[k][2],
        )
        for k in logged
    ]
    (sigma_ax or ax).legend(handles=handles, frameon=False, fontsize=7.5, loc="upper right")  # on top
    what = " and ".join(
        (["first-token TV (clean vs. noisy)"] if tvs else [])
        + ([r"$\sigma_k$"] if sigma_ax is not None else [])
    )
    ax.set_title(f"noise: {what}", fontsize=9.5, loc="left")


#: The demo's greedy validation accuracy (``val/accuracy``, and ``val/accuracy/<role or benchmark>``).
DEMO_VAL_KEY = "val/accuracy"
#: TRL's own evaluation (``--eval_strategy``) logs the mean reward on the eval set as ``eval_reward``, or
#: ``eval_<set>_reward`` per set when there are several.
_TRL_EVAL_REWARD = re.compile(r"eval_(?:.+_)?reward")


def _expand(key: str, logged: set[str]) -> list[str]:
    """``key`` itself when logged, else the logged keys it prefixes (``val/accuracy`` ->
    ``val/accuracy/<benchmark>``), sorted; none: []."""
    return [key] if key in logged else sorted(x for x in logged if x.startswith(key + "/"))


def find_val_keys(logged: set[str]) -> list[str]:
    """The validation metrics a run logged, one panel each, as :func:`plot_dynamics` picks them when
    given none: the demo's ``val/accuracy`` (or, without it, its ``val/accuracy/<...>`` keys), and TRL's
    eval reward (``eval_reward``, or ``eval_<set>_reward`` per eval set, as ``ncgrpo train
    --eval_strategy`` logs it). [] when the runs logged neither (a run trained without evaluation)."""
    return _expand(DEMO_VAL_KEY, logged) + sorted(k for k in logged if _TRL_EVAL_REWARD.fullmatch(k))


def dynamics_keys(
    runs: Sequence[tuple[str, list[dict[str, Any]]]],
    reward_key: str = "reward",
    val_key: str | Sequence[str] | None = None,
) -> list[str]:
    """``[reward_key, *validation keys]`` of the dynamics figure for these runs ``(label, rows)``.

    ``val_key`` None: :func:`find_val_keys` (no validation panel when nothing was logged); else each
    key given must be logged, or prefix logged keys (``val/accuracy`` -> one panel per
    ``val/accuracy/<benchmark>``), or it is an error listing what the runs logged.
    """
    logged = {k for _, rows in runs for row in rows for k in row}
    if reward_key not in logged:
        raise ValueError(f"no run logs {[reward_key]}; logged keys: {sorted(logged)}")
    if val_key is None:
        return list(dict.fromkeys([reward_key, *find_val_keys(logged)]))
    wanted = [val_key] if isinstance(val_key, str) else list(val_key)
    missing = [k for k in wanted if not _expand(k, logged)]
    if missing or not wanted:
        raise ValueError(f"no run logs {missing or wanted}; logged keys: {sorted(logged)}")
    return list(dict.fromkeys([reward_key, *(x for k in wanted for x in _expand(k, logged))]))


def dynamics_figure(
    train_dirs: Sequence[str | Path],
    reward_key: str = "reward",
    val_key: str | Sequence[str] | None = None,
    *,
    title: str | None = None,
    smooth: int = 10,
    noise_panel: bool = True,
) -> Figure:
    """The figure :func:`plot_dynamics` saves (see there), returned unsaved: every check is made here,
    so a caller that builds it first writes nothing when the input is refused."""
    if not train_dirs:
        raise ValueError("plot_dynamics needs at least one training directory")
    if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
        raise ValueError(f"smooth must be a whole number of steps >= 1 (1: no smoothing), got {smooth!r}")
    runs = [(run_label(d), read_metrics(d)) for d in train_dirs]
    keys = dynamics_keys(runs, reward_key, val_key)
    for d, (_, rows) in zip(train_dirs, runs, strict=True):
        if not any(_series(rows, k)[0] for k in keys):
            raise ValueError(
                f"{Path(d) / METRICS_FILE}: no row has a numeric 'step' with any of {keys}; "
                "nothing to plot against step (is it a metrics.jsonl written by ncgrpo train?)"
            )
    empty = [k for k in keys if not any(_series(rows, k)[0] for _, rows in runs)]
    if empty:
        raise ValueError(f"no run logs {empty} at a numeric 'step'; nothing to plot for them")
    noise = _noise_logged(runs) if noise_panel else []

    n = len(keys) + bool(noise)
    ncols = 1 if n <= 3 else 2
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(6.0 if ncols == 1 else 9.5, 2.3 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharex=True, squeeze=False).ravel()
    _plot_reward(axes[0], runs, reward_key, smooth)
    for ax, key in zip(axes[1:], keys[1:], strict=False):
        for i, (label, rows) in enumerate(runs):
            steps, vals = _series(rows, key)
            if steps:
                ax.plot(
                    steps,
                    vals,
                    color=_COLORS[i % len(_COLORS)],
                    label=label,
                    linewidth=1.4,
                    marker="o" if len(steps) <= 12 else None,
                    markersize=3.5,
                )
        ax.set_title(key, fontsize=9.5, loc="left")
    if noise:
        _plot_noise(axes[len(keys)], runs, noise)
    for ax in axes[:n]:
        _style(ax)
    for ax in axes[n:]:
        ax.set_visible(False)
    for ax in axes[max(0, n - ncols) : n]:
        ax.set_xlabel("step")
        ax.xaxis.set_tick_params(labelbottom=True)
    if title:
        fig.suptitle(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="outside lower center", ncol=min(len(runs), 4), frameon=False, fontsize=8.5
    )
    return fig


def plot_dynamics(
    train_dirs: Sequence[str | Path],
    out_stem: str | Path,
    reward_key: str = "reward",
    val_key: str | Sequence[str] | None = None,
    *,
    title: str | None = None,
    smooth: int = 10,
    noise_panel: bool = True,
) -> list[Path]:
    """Training reward (top), validation accuracy and the noise panel against step, one colour per run.

    The reward is drawn per step (faint) with its centred ``smooth``-step rolling mean
    (:func:`rolling_mean`; ``smooth=1`` draws the raw line only). ``val_key`` may be several keys
    (one panel each). A key no run logs but that prefixes logged keys (``val/accuracy`` with
    ``val/accuracy/<benchmark>`` logged) expands to one panel per such key. ``val_key`` None (the
    default) finds them in what the runs logged (:func:`find_val_keys`): the demo's ``val/accuracy``
    and TRL's ``eval_reward`` (``ncgrpo train --eval_strategy``); a run trained without evaluation gets
    the reward (and noise) panels only. Rows missing a key are skipped for that key only.

    The noise panel (last; only when ``noise_panel`` and some run logs one of its keys) shows per step
    ``noise/first_token_marginal_tv`` (solid: TV between the clean first-token distribution and the
    noise-averaged one, which is what generates the noisy rollouts), ``noise/first_token_tv``
    (dashed: the mean TV of a single noise draw) and ``noise/sigma_k`` (dotted, right axis). Runs
    without these keys (vanilla GRPO) are absent from it. Returns the written paths (PNG, PDF).
    """
    fig = dynamics_figure(
        train_dirs, reward_key, val_key, title=title, smooth=smooth, noise_panel=noise_panel
    )
    return save_figure(fig, out_stem)
