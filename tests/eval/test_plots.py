"""Figures render from saved files: gains vs. baseline and training dynamics (PNG + PDF)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ncgrpo import cli
from ncgrpo.eval.plots import (
    dynamics_figure,
    plot_dynamics,
    plot_gains,
    read_metrics,
    rolling_mean,
    run_label,
)
from ncgrpo.eval.report import compare, load_runs

ROOT = Path(__file__).resolve().parents[2]


def _examples():
    spec = importlib.util.spec_from_file_location("make_examples", ROOT / "docs/figures/make_examples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_figures(paths: list[Path], stem: Path) -> None:
    assert paths == [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    png, pdf = (p.read_bytes() for p in paths)
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert pdf.startswith(b"%PDF") and len(pdf) > 5_000


def write_metrics(d: Path, rows: list[dict], *, torn: str | None = None, config: dict | None = None) -> Path:
    d.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + (torn or "")
    (d / "metrics.jsonl").write_text(text)
    if config is not None:
        (d / "run.json").write_text(json.dumps(config))
    return d


def test_gains_from_runs_and_from_table(tmp_path):
    ex = _examples()
    runs = load_runs(ex.write_eval_runs(tmp_path / "runs"))
    assert_figures(plot_gains(runs, "Vanilla GRPO", tmp_path / "a" / "gains"), tmp_path / "a" / "gains")
    ct = compare(runs, "Vanilla GRPO", ["geo3k", "mathverse", "wemath"])
    assert_figures(plot_gains(ct, None, tmp_path / "b"), tmp_path / "b")
    with pytest.raises(ValueError, match="baseline"):
        plot_gains(runs, None, tmp_path / "c")
    with pytest.raises(ValueError, match="non-baseline"):
        plot_gains(runs[:1], "Vanilla GRPO", tmp_path / "d")


def test_make_examples_writes_both_figures(tmp_path):
    paths = _examples().main(tmp_path)
    assert [p.name for p in paths] == ["example_gains.png", "example_dynamics.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["example_dynamics.png", "example_gains.png"]


def test_example_train_runs_are_deterministic_and_log_noise_for_nc_grpo_only(tmp_path):
    ex = _examples()
    a, b = ex.write_train_runs(tmp_path / "a"), ex.write_train_runs(tmp_path / "b")
    assert [read_metrics(d) for d in a] == [read_metrics(d) for d in b]
    for d in a:
        logged = {k for row in read_metrics(d) for k in row}
        noisy = run_label(d).startswith("NC-GRPO")
        assert ({"noise/sigma_k", "noise/first_token_tv", "noise/first_token_marginal_tv"} <= logged) == noisy
        assert noisy or not any(k.startswith("noise/") for k in logged)


def test_dynamics_missing_keys_and_prefix_expansion(tmp_path):
    rows = [{"step": s, "reward": 0.5 + s / 100} for s in range(20)]
    for r in rows[::5]:
        r["val/accuracy/geo3k"] = 0.4 + r["step"] / 100
        r["val/accuracy/mathverse"] = 0.3
    a = write_metrics(tmp_path / "a", rows, torn='{"step": 20, "rew', config={"name": "Vanilla GRPO"})
    b = write_metrics(tmp_path / "b", rows[:10])
    assert len(read_metrics(a)) == 20  # torn last line dropped
    assert run_label(a) == "Vanilla GRPO" and run_label(b) == "b"
    stem = tmp_path / "out" / "dyn"
    assert_figures(plot_dynamics([a, b], stem), stem)  # val/accuracy -> two per-benchmark panels
    assert_figures(plot_dynamics([a], stem, val_key=["val/accuracy/geo3k"]), stem)
    with pytest.raises(ValueError, match="no run logs"):
        plot_dynamics([a], stem, val_key="val/loss")
    with pytest.raises(ValueError, match="no run logs"):
        plot_dynamics([a], stem, reward_key="train/reward")
    with pytest.raises(FileNotFoundError):
        plot_dynamics([tmp_path / "nope"], stem)


def test_run_label_from_config(tmp_path):
    d = tmp_path / "run7"
    d.mkdir()
    (d / "config.yaml").write_text("run_name: NC-GRPO σ0=0.2\nlr: 1e-6\n", encoding="utf-8")
    assert run_label(d) == "NC-GRPO σ0=0.2"
    (d / "config.yaml").write_text(": not yaml : [", encoding="utf-8")
    assert run_label(d) == "run7"


def test_plot_cli(tmp_path, capsys):
    ex = _examples()
    dirs = [str(d) for d in ex.write_eval_runs(tmp_path / "runs")]
    argv = [
        "plot",
        "gains",
        "--runs",
        *dirs,
        "--baseline",
        "Vanilla GRPO",
        "--output_dir",
        str(tmp_path / "o"),
    ]
    assert cli.main(argv) == 0
    assert (tmp_path / "o" / "gains.png").stat().st_size > 0 and (tmp_path / "o" / "gains.pdf").exists()
    train = [str(d) for d in ex.write_train_runs(tmp_path / "train")]
    o = str(tmp_path / "o")
    argv = [
        "plot",
        "dynamics",
        "--train-dirs",
        *train,
        "--output_dir",
        o,
        "--val-key",
        "val/accuracy/geo3k",
        "val/accuracy/mathverse",
    ]
    assert cli.main(argv) == 0
    assert (tmp_path / "o" / "dynamics.png").stat().st_size > 0
    assert cli.main(["plot", "dynamics", "--train_dirs", *train, "--output_dir", o, "--val_key", "nope"]) == 2
    assert "ncgrpo plot dynamics: error: no run logs" in capsys.readouterr().err


def test_plot_dynamics_without_a_step_column_is_an_error(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    rows = [{"reward": 0.1 * i, "val/accuracy": 0.5} for i in range(5)]  # no "step"
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="numeric 'step'"):
        plot_dynamics([d], tmp_path / "o" / "dyn")
    assert not (tmp_path / "o").exists()
    assert cli.main(["plot", "dynamics", "--train_dirs", str(d), "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo plot dynamics: error:") and str(d / "metrics.jsonl") in err


def test_read_metrics_ignores_a_tail_torn_inside_a_utf8_character(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    good = json.dumps({"step": 1, "reward": 0.5, "note": "σ"}, ensure_ascii=False) + "\n"
    torn = (json.dumps({"step": 2, "note": "σσ"}, ensure_ascii=False) + "\n").encode()
    cut = torn.index("σ".encode()) + 1  # inside the two-byte character
    (d / "metrics.jsonl").write_bytes(good.encode() + torn[:cut])
    assert read_metrics(d) == [json.loads(good)]
    (d / "metrics.jsonl").write_bytes(torn[:cut] + b"\n" + good.encode())  # the same bytes mid-file
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not UTF-8"):
        read_metrics(d)


def test_plots_use_no_pyplot_and_no_torch():
    code = (
        "import sys, ncgrpo.eval.plots, ncgrpo.commands.plot, ncgrpo.commands.compare; "
        "bad = {'torch', 'matplotlib.pyplot'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- reward smoothing and the noise panel ------------------------------------------------------

NAN = float("nan")


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y) for x, y in zip(a, b, strict=True)
    )


def test_rolling_mean_by_hand():
    steps = [0, 1, 2, 3, 4, 5]
    # window 3 at step s: steps s-1..s+1; the ends average the two that exist; NaN is left out
    assert same(rolling_mean(steps, [1, 2, NAN, 4, 5, 6], 3), [1.5, 1.5, 3.0, 4.5, 5.0, 5.5])
    # even window 4 at step s: steps s-2..s+1
    assert same(rolling_mean(steps, [1, 2, 3, 4, 5, 6], 4), [1.5, 2.0, 2.5, 3.5, 4.5, 5.0])
    assert same(rolling_mean(steps, [1, 2, 3, 4, 5, 6], 1), [1, 2, 3, 4, 5, 6])  # window 1: unchanged
    # a run shorter than the window: every step averages the whole run
    assert same(rolling_mean([0, 1, 2], [1, 2, 6], 10), [3.0, 3.0, 3.0])
    # the window counts steps, not rows: a gap in the log narrows it
    assert same(rolling_mean([0, 1, 10, 11], [1, 3, 10, 20], 3), [2.0, 2.0, 15.0, 15.0])
    # a window with no finite value gives NaN
    assert same(rolling_mean([0, 1, 5], [NAN, NAN, 7], 3), [NAN, NAN, 7.0])
    assert rolling_mean([], [], 10) == []
    with pytest.raises(ValueError, match="window"):
        rolling_mean(steps, [1] * 6, 0)
    with pytest.raises(ValueError, match="ascending"):
        rolling_mean([0, 2, 1], [1, 2, 3], 3)
    with pytest.raises(ValueError, match="3 steps but 2 values"):
        rolling_mean([0, 1, 2], [1, 2], 3)


def train_rows(n: int, *, noise: tuple[str, ...] = (), val_every: int = 5) -> list[dict]:
    rows = []
    for s in range(n):
        row: dict = {"step": s, "reward": 0.5 + 0.01 * s + (0.02 if s % 2 else -0.02)}
        if s % val_every == 0:
            row["val/accuracy"] = 0.4 + 0.005 * s
        sigma = 0.3 if s < n // 2 else 0.0
        values = {
            "noise/sigma_k": sigma,
            "noise/first_token_tv": sigma,
            "noise/first_token_marginal_tv": sigma / 10,
        }
        row.update({k: values[k] for k in noise})
        rows.append(row)
    return rows


ALL_NOISE = ("noise/sigma_k", "noise/first_token_tv", "noise/first_token_marginal_tv")


def panels(fig) -> dict[str, object]:
    """Visible axes by left title; a twin axis (no title of its own) under '<title> (twin)'."""
    out = {}
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        title = ax.get_title(loc="left")
        if title:
            out[title] = ax
    for ax in fig.axes:
        if ax.get_visible() and not ax.get_title(loc="left"):
            parent = next(t for t, a in out.items() if a.get_position().bounds == ax.get_position().bounds)
            out[parent + " (twin)"] = ax
    return out


def line_labels(ax) -> list[str]:
    return [ln.get_label() for ln in ax.get_lines()]


def legend_texts(ax) -> list[str]:
    leg = ax.get_legend()
    return [t.get_text() for t in leg.get_texts()] if leg is not None else []


def test_noise_panel_drawn_exactly_when_a_run_logged_noise(tmp_path):
    van = write_metrics(tmp_path / "van", train_rows(30), config={"name": "Vanilla"})
    nc = write_metrics(tmp_path / "nc", train_rows(30, noise=ALL_NOISE), config={"name": "NC"})

    p = panels(dynamics_figure([van]))  # vanilla alone: reward and validation, no empty noise axes
    assert sorted(p) == ["reward (faint: per step; line: centred 10-step mean)", "val/accuracy"]
    assert len(dynamics_figure([nc], noise_panel=False).axes) == 2

    fig = dynamics_figure([van, nc])
    p = panels(fig)
    noise_title = "noise: first-token TV (clean vs. noisy) and $\\sigma_k$"
    assert sorted(p) == sorted([*panels(dynamics_figure([van])), noise_title, noise_title + " (twin)"])
    ax, twin = p[noise_title], p[noise_title + " (twin)"]
    # vanilla is absent; NC has one line per quantity in its reward colour, one style per quantity
    assert line_labels(ax) == ["NC: marginal TV", "NC: per-draw TV"] and line_labels(twin) == ["NC: sigma_k"]
    reward = p["reward (faint: per step; line: centred 10-step mean)"]
    nc_color = next(ln.get_color() for ln in reward.get_lines() if ln.get_label() == "NC")
    assert {ln.get_color() for ln in [*ax.get_lines(), *twin.get_lines()]} == {nc_color}
    assert [ln.get_linestyle() for ln in [*ax.get_lines(), *twin.get_lines()]] == ["-", "--", ":"]
    marginal = ax.get_lines()[0]
    assert list(marginal.get_xdata()) == list(range(30))
    assert list(marginal.get_ydata()) == pytest.approx([0.03] * 15 + [0.0] * 15)
    assert legend_texts(twin) == [
        "first-token TV, noise-averaged (what rollouts see)",
        "first-token TV, per draw",
        "$\\sigma_k$, noise scale (right axis)",
    ]
    assert ax.get_ylabel() == "first-token TV" and twin.get_ylabel() == "$\\sigma_k$ (noise scale)"
    assert ax.get_ylim()[0] == 0 and twin.get_ylim()[0] == 0
    assert [a.get_xlabel() for a in fig.axes if a.get_visible() and a is not twin] == ["", "", "step"]
    stem = tmp_path / "out" / "dyn"
    assert_figures(plot_dynamics([van, nc], stem), stem)


def test_metrics_without_the_marginal_tv_or_sigma_still_plot(tmp_path):
    old = write_metrics(
        tmp_path / "old",
        train_rows(20, noise=("noise/sigma_k", "noise/first_token_tv")),
        config={"name": "old"},
    )
    p = panels(dynamics_figure([old]))
    title = "noise: first-token TV (clean vs. noisy) and $\\sigma_k$"
    assert line_labels(p[title]) == ["old: per-draw TV"] and line_labels(p[title + " (twin)"]) == [
        "old: sigma_k"
    ]
    assert "first-token TV, noise-averaged (what rollouts see)" not in legend_texts(p[title + " (twin)"])
    stem = tmp_path / "o" / "old"
    assert_figures(plot_dynamics([old], stem), stem)

    # the temperature control logs a TV but no sigma_k: no twin axis
    ctl = write_metrics(tmp_path / "ctl", train_rows(20, noise=("noise/first_token_tv",)))
    p = panels(dynamics_figure([ctl]))
    assert "noise: first-token TV (clean vs. noisy)" in p and not any(t.endswith("(twin)") for t in p)
    # sigma_k alone is drawn on the panel's own axis
    sig = write_metrics(tmp_path / "sig", train_rows(20, noise=("noise/sigma_k",)))
    p = panels(dynamics_figure([sig]))
    assert line_labels(p["noise: $\\sigma_k$"]) == ["sig: sigma_k"]
    assert legend_texts(p["noise: $\\sigma_k$"]) == ["$\\sigma_k$, noise scale"]


def test_reward_is_faint_per_step_under_its_rolling_mean(tmp_path):
    rows = train_rows(30)
    rows[7]["reward"] = NAN  # written as NaN by json.dumps; read back as a float NaN
    rows[8]["reward"] = None
    a = write_metrics(tmp_path / "a", rows, config={"name": "A"})
    b = write_metrics(tmp_path / "b", train_rows(4), config={"name": "B"})  # shorter than the window
    fig = dynamics_figure([a, b], smooth=5)
    reward = panels(fig)["reward (faint: per step; line: centred 5-step mean)"]
    raw_a, smooth_a, raw_b, smooth_b = reward.get_lines()
    steps = [s for s in range(30) if s not in (7, 8)]
    assert list(raw_a.get_xdata()) == steps and list(smooth_a.get_xdata()) == steps
    vals = [r["reward"] for r in rows if r["step"] in steps]
    assert list(smooth_a.get_ydata()) == pytest.approx(rolling_mean(steps, vals, 5))
    assert smooth_a.get_ydata()[0] == pytest.approx((0.48 + 0.53 + 0.50) / 3)  # steps 0..2 by hand
    assert raw_a.get_alpha() < 0.5 and smooth_a.get_alpha() is None
    assert raw_a.get_color() == smooth_a.get_color() != smooth_b.get_color()
    assert len(smooth_b.get_ydata()) == 4 and all(math.isfinite(v) for v in smooth_b.get_ydata())
    # only the smoothed lines carry the run names (the figure legend's entries)
    assert [ln.get_label() for ln in (smooth_a, smooth_b)] == ["A", "B"]
    assert all(ln.get_label().startswith("_") for ln in (raw_a, raw_b))
    assert fig.legends[0].get_texts()[0].get_text() == "A"

    unsmoothed = panels(dynamics_figure([a, b], smooth=1))["reward"]
    assert line_labels(unsmoothed) == ["A", "B"]
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="smooth"):
            dynamics_figure([a], smooth=bad)


def test_plot_cli_smooth_and_noise_panel(tmp_path, capsys):
    nc = write_metrics(tmp_path / "nc", train_rows(20, noise=ALL_NOISE))
    o = str(tmp_path / "o")
    base = ["plot", "dynamics", "--train_dirs", str(nc), "--output_dir", o]
    assert cli.main([*base, "--smooth", "1", "--no_noise_panel", "--name", "plain"]) == 0
    assert cli.main([*base, "--smooth", "5"]) == 0
    assert (tmp_path / "o" / "plain.png").exists() and (tmp_path / "o" / "dynamics.png").exists()
    assert cli.main([*base, "--smooth", "0"]) == 2
    assert "--smooth 0" in capsys.readouterr().err


# --- plot works on any run it is given (issue 32, item 4) ------------------------------------


def _panel_titles(fig) -> list[str]:
    return [ax.get_title(loc="left") for ax in fig.axes if ax.get_visible() and ax.get_title(loc="left")]


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory) -> dict[str, Path]:
    """Two real `ncgrpo train` runs of the tiny recipe (2 steps): one with TRL's own evaluation every step
    (`--eval_strategy steps`: it logs eval_reward, eval_loss, ..., never val/accuracy), one without."""
    from test_train_cli import TINY_RECIPE, write_geo3k_parquet
    from tiny_models import save_tiny_vl

    root = tmp_path_factory.mktemp("train-runs")
    geo3k, model = write_geo3k_parquet(root / "geo3k"), save_tiny_vl(root / "tiny-vl")
    small = [
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "1",
    ]
    evals = ["--eval_strategy", "steps", "--eval_steps", "1", "--eval_dataset_splits", "train"]
    evals += ["--eval_dataset_limit", "2", "--per_device_eval_batch_size", "2"]
    out = {}
    for name, extra in (("with_eval", evals), ("no_eval", [])):
        out[name] = root / name
        argv = [
            "train",
            "--config",
            str(TINY_RECIPE),
            "--output_dir",
            str(out[name]),
            "--dataset_name",
            "geo3k",
        ]
        argv += ["--dataset_path", str(geo3k), "--model_name_or_path", str(model), "--run_name", name, *small]
        assert cli.main([*argv, *extra]) == 0
    return out


def test_plot_dynamics_of_a_real_train_run_finds_its_validation_key(train_runs, tmp_path, capsys) -> None:
    run, plain = str(train_runs["with_eval"]), str(train_runs["no_eval"])
    logged = {k for row in read_metrics(run) for k in row}
    assert "eval_reward" in logged and "val/accuracy" not in logged  # what TRL's evaluation logs
    out = tmp_path / "figs"
    assert cli.main(["plot", "dynamics", "--train_dirs", run, "--output_dir", str(out)]) == 0
    assert "validation: eval_reward" in capsys.readouterr().out
    assert (out / "dynamics.png").stat().st_size > 10_000 and (out / "dynamics.pdf").is_file()
    titles = _panel_titles(dynamics_figure([run]))
    assert titles[0].startswith("reward") and titles[1] == "eval_reward" and titles[2].startswith("noise")
    # a run trained without evaluation: the reward and noise panels, no validation panel, no error
    assert (
        cli.main(["plot", "dynamics", "--train_dirs", plain, run, "--output_dir", str(tmp_path / "b")]) == 0
    )
    assert "validation: eval_reward" in capsys.readouterr().out
    assert cli.main(["plot", "dynamics", "--train_dirs", plain, "--output_dir", str(tmp_path / "c")]) == 0
    assert "validation: none logged" in capsys.readouterr().out
    titles = _panel_titles(dynamics_figure([plain]))
    assert len(titles) == 2 and titles[0].startswith("reward") and titles[1].startswith("noise")


def test_a_refused_plot_writes_nothing(train_runs, tmp_path, capsys) -> None:
    run = str(train_runs["with_eval"])
    out = tmp_path / "never"
    # a key the run did not log: the error lists what it logged, and no folder is left behind
    assert (
        cli.main(
            ["plot", "dynamics", "--train_dirs", run, "--output_dir", str(out), "--val_key", "val/accuracy"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "ncgrpo plot dynamics: error: no run logs ['val/accuracy']" in err and "eval_reward" in err
    assert not out.exists()
    # gains with a baseline no run has
    ex = _examples()
    evals = [str(d) for d in ex.write_eval_runs(tmp_path / "evals")]
    assert cli.main(["plot", "gains", "--runs", *evals, "--baseline", "nope", "--output_dir", str(out)]) == 2
    assert "baseline 'nope' is not among" in capsys.readouterr().err
    assert not out.exists()
    # an evaluation given to dynamics, a training run given to gains or compare: named, nothing written
    assert cli.main(["plot", "dynamics", "--train_dirs", evals[0], "--output_dir", str(out)]) == 2
    assert f"{evals[0]} is an evaluation" in capsys.readouterr().err
    assert (
        cli.main(
            ["plot", "gains", "--runs", run, *evals, "--baseline", "Vanilla GRPO", "--output_dir", str(out)]
        )
        == 2
    )
    assert f"{run} is a training run, not an evaluation" in capsys.readouterr().err
    assert cli.main(["compare", "--runs", run, *evals, "--baseline", "Vanilla GRPO"]) == 2
    assert f"{run} is a training run, not an evaluation" in capsys.readouterr().err
    assert not out.exists()


def _demo_folder(root: Path) -> Path:
    """A demo's output folder as ncgrpo demo lays it out: run.json kind demo, train/<run>/metrics.jsonl
    (the demo logs val/accuracy and val/accuracy/<role>), eval/<run>/ (run.json + records.jsonl)."""
    from ncgrpo.runs.folder import atomic_write_json

    atomic_write_json(root / "run.json", {"kind": "demo"})
    for k, name in enumerate(("Vanilla GRPO", "NC-GRPO σ0=0.2")):
        rows = [{"step": s, "reward": 0.1 * s + k} for s in range(1, 4)]
        rows += [{"step": s, "val/accuracy": 0.5, "val/accuracy/ood": 0.4} for s in range(0, 4)]
        write_metrics(root / "train" / f"run{k}", rows, config={"kind": "train", "name": name})
    _examples().write_eval_runs(root / "eval")
    return root


def test_plot_takes_a_demo_folder_for_its_runs(tmp_path, capsys) -> None:
    demo = _demo_folder(tmp_path / "demo")
    assert cli.main(["plot", "dynamics", "--train_dirs", str(demo), "--output_dir", str(tmp_path / "o")]) == 0
    assert "validation: val/accuracy" in capsys.readouterr().out
    fig = dynamics_figure([demo / "train" / "run0", demo / "train" / "run1"])
    assert _panel_titles(fig)[1] == "val/accuracy"
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == ["NC-GRPO σ0=0.2", "Vanilla GRPO"]
    argv = [
        "plot",
        "gains",
        "--runs",
        str(demo),
        "--baseline",
        "Vanilla GRPO",
        "--output_dir",
        str(tmp_path / "o"),
    ]
    assert cli.main(argv) == 0
    assert (tmp_path / "o" / "gains.png").is_file() and (tmp_path / "o" / "dynamics.png").is_file()
    assert cli.main(["compare", "--runs", str(demo), "--baseline", "Vanilla GRPO"]) == 0
    assert "NC-GRPO" in capsys.readouterr().out


@pytest.mark.slow
def test_plot_and_compare_a_real_demo_folder(tmp_path, capsys) -> None:
    """A real (tiny) ncgrpo demo on the embedded base: its output folder is all plot and compare need."""
    from ncgrpo.toy.demo import run_demo
    from ncgrpo.toy.demo_config import DemoConfig

    demo = tmp_path / "demo"
    run_demo(
        DemoConfig(
            output_dir=demo, max_steps=2, num_generations=4, prompts_per_step=1, max_completion_length=8,
            max_new_tokens=8, eval_limit=2, val_limit=1, val_every=1, train_size=8, validation_size=2,
            test_size=2, eval_batch_size=8, progress=False,
        )
    )  # fmt: skip
    out = tmp_path / "figs"
    assert cli.main(["plot", "dynamics", "--train_dirs", str(demo), "--output_dir", str(out)]) == 0
    assert "validation: val/accuracy" in capsys.readouterr().out
    base = "Vanilla GRPO"
    assert cli.main(["plot", "gains", "--runs", str(demo), "--baseline", base, "--output_dir", str(out)]) == 0
    assert cli.main(["compare", "--runs", str(demo), "--baseline", base]) == 0
    assert (out / "dynamics.png").is_file() and (out / "gains.png").is_file()
