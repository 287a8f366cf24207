"""Figures render from saved files: gains vs. baseline and training dynamics (PNG + PDF)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ncgrpo import cli
from ncgrpo.eval.plots import plot_dynamics, plot_gains, read_metrics, run_label
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
    argv = ["plot", "gains", "--runs", *dirs, "--baseline", "Vanilla GRPO", "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 0
    assert (tmp_path / "o" / "gains.png").stat().st_size > 0 and (tmp_path / "o" / "gains.pdf").exists()
    train = [str(d) for d in ex.write_train_runs(tmp_path / "train")]
    o = str(tmp_path / "o")
    argv = [
        "plot",
        "dynamics",
        "--train-dirs",
        *train,
        "--out",
        o,
        "--val-key",
        "val/accuracy/geo3k",
        "val/accuracy/mathverse",
    ]
    assert cli.main(argv) == 0
    assert (tmp_path / "o" / "dynamics.png").stat().st_size > 0
    assert cli.main(["plot", "dynamics", "--train_dirs", *train, "--out", o, "--val_key", "nope"]) == 2
    assert "ncgrpo plot dynamics: error: no run logs" in capsys.readouterr().err


def test_plot_dynamics_without_a_step_column_is_an_error(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    rows = [{"reward": 0.1 * i, "val/accuracy": 0.5} for i in range(5)]  # no "step"
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="numeric 'step'"):
        plot_dynamics([d], tmp_path / "o" / "dyn")
    assert not (tmp_path / "o").exists()
    assert cli.main(["plot", "dynamics", "--train_dirs", str(d), "--out", str(tmp_path / "o")]) == 2
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
