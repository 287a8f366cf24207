"""A user's own benchmark through ncgrpo eval, compare and plot; the prompt template train and eval
share; an eval of a training run carries its name and method (issue 32, item 7).

Before: ``--benchmarks`` knew only the built-in names, so a benchmark of one's own had to pass as
``--data geo3k=my.jsonl`` (images required, labelled "Geo3K (ID)"); eval had no ``--math_prompt``; an
eval folder of a training run was named after the model's folder and hash, not the run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ncgrpo import cli
from ncgrpo.eval.records import read_records
from ncgrpo.eval.report import compare, load_runs, to_markdown


def write_own_benchmark(folder: Path) -> Path:
    """tests/data/own_benchmark.py's benchmark file of one's own (two rows with figures, two text-only)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "data" / "own_benchmark.py"
    spec = importlib.util.spec_from_file_location("_own_benchmark", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_own_benchmark(folder)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """A 1-step `ncgrpo train` run (tiny recipe, latent noise, seed 3) and its base model."""
    from test_train_cli import TINY_RECIPE, write_geo3k_parquet
    from tiny_models import save_tiny_vl

    root = tmp_path_factory.mktemp("own")
    geo3k, base = write_geo3k_parquet(root / "geo3k"), save_tiny_vl(root / "base")
    run = root / "runs" / "r3"
    argv = ["train", "--config", str(TINY_RECIPE), "--output_dir", str(run), "--dataset_name", "geo3k"]
    argv += [
        "--dataset_path",
        str(geo3k),
        "--model_name_or_path",
        str(base),
        "--max_steps",
        "1",
        "--seed",
        "3",
    ]
    argv += [
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "1",
    ]
    argv += ["--run_name", "my-latent"]
    assert cli.main(argv) == 0
    return {"base": base, "run": run, "data": write_own_benchmark(root / "data"), "root": root}


def _eval(model: Path, *extra: str) -> int:
    argv = ["eval", "--model_name_or_path", str(model), "--max_new_tokens", "3", "--device", "cpu"]
    return cli.main([*argv, "--no_progress", *extra])


def test_own_benchmarks_are_first_class_through_eval_compare_and_plots(
    trained, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    data = trained["data"]
    # text-only rows and figures in one file, any name, a role each; --benchmarks may be left out
    own = ["--data", f"shapes_v2={data}:ood", f"arith={data}:general", f"mine={data}"]
    assert _eval(trained["run"], *own) == 0
    err = capsys.readouterr().err
    # an eval of a training run: its name, method and seed, in the folder's name and its records
    out = tmp_path / "evals" / "my-latent-latent-seed3"
    assert f"training run 'my-latent' (method latent, seed 3) -> {Path('evals') / out.name}" in err
    info = json.loads((out / "run.json").read_text())
    assert (info["name"], info["method"], info["seed"]) == ("my-latent", "latent", 3)
    assert info["benchmarks"] == ["shapes_v2", "arith", "mine"]
    recs = read_records(out / "records.jsonl")
    assert {(r.name, r.method, r.seed) for r in recs} == {("my-latent", "latent", 3)}
    roles = {r.benchmark: r.role for r in recs}
    assert roles == {"shapes_v2": "ood", "arith": "general", "mine": "in_domain"}
    assert sum(1 for r in recs if r.benchmark == "arith" and not r.image_hash) == 2  # the text-only rows

    # the baseline: the base model, named explicitly into a folder of its own
    assert _eval(trained["base"], *own, "--name", "base", "--output_dir", "evals/base") == 0
    capsys.readouterr()
    runs = load_runs([tmp_path / "evals" / "base", out])
    ct = compare(runs, "base")
    md = to_markdown(ct)
    assert "| Method | mine (ID) | shapes_v2 | OOD avg |" in md and "| Method | arith |" in md
    assert "Geo3K" not in md
    from ncgrpo.eval.plots import gains_figure

    fig = gains_figure(runs, "base")
    ticks = [t.get_text().split("\n")[0] for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["mine (ID)", "shapes_v2", "OOD avg"]
    argv = ["plot", "gains", "--runs", "evals/base", str(out), "--baseline", "base", "--output_dir", "figs"]
    assert cli.main(argv) == 0 and (tmp_path / "figs" / "gains.png").is_file()


def test_eval_of_a_checkpoint_and_defaults_for_any_other_model(trained, tmp_path, monkeypatch, capsys):
    from ncgrpo.commands.eval import EvalArgs

    ckpt = trained["root"] / "runs" / "r3-ckpt" / "checkpoint-1"
    ckpt.parent.mkdir(parents=True)
    (ckpt.parent / "run.json").write_text(
        json.dumps({"kind": "train", "name": "n", "method": "spsa", "seed": 1})
    )
    ckpt.mkdir()
    args = EvalArgs(model_name_or_path=str(ckpt), data=[f"mine={trained['data']}"])
    assert (args.name, args.rollout_method, args.seed, args.checkpoint) == ("n", "spsa", 1, "checkpoint-1")
    assert args.output_dir == str(Path("evals") / "n-spsa-seed1-checkpoint-1")
    args = EvalArgs(model_name_or_path=str(ckpt), data=[f"mine={trained['data']}"], seed=9, name="x")
    assert (args.name, args.seed) == ("x", 9)  # given values win
    args = EvalArgs(model_name_or_path=str(trained["base"]), data=[f"mine={trained['data']}"])
    assert (args.name, args.rollout_method, args.output_dir) == (None, None, str(Path("evals") / "base"))


def test_train_and_eval_share_one_prompt_template_setting(trained, tmp_path, monkeypatch, capsys):
    from ncgrpo.commands.eval import EvalArgs
    from ncgrpo.commands.train_settings import ScriptArguments

    for name in ("math_prompt", "system_prompt"):  # one name, default and meaning in both commands
        t, e = ScriptArguments.__dataclass_fields__[name], EvalArgs.__dataclass_fields__[name]
        assert t.default is e.default is None and t.metadata["help"] == e.metadata["help"], name
    monkeypatch.chdir(tmp_path)
    data = f"mine={trained['data']}"
    assert _eval(trained["base"], "--data", data, "--output_dir", "a") == 0
    assert (
        _eval(trained["base"], "--data", data, "--output_dir", "b", "--math_prompt", "Answer in \\boxed{}.")
        == 0
    )
    a, b = (read_records(tmp_path / d / "records.jsonl") for d in ("a", "b"))
    assert b[0].decoding["math_prompt"] == "Answer in \\boxed{}." and a[0].decoding["math_prompt"] != ""
    assert all(x.prompt_hash != y.prompt_hash for x, y in zip(a, b, strict=True))
    # a training run evaluated with another template than it trained with: a note says so
    capsys.readouterr()
    assert _eval(trained["run"], "--data", data, "--output_dir", "c", "--math_prompt", "") == 0
    assert "the run trained with math_prompt" in capsys.readouterr().err
    # the template is part of the folder's identity
    assert _eval(trained["base"], "--data", data, "--output_dir", "a", "--math_prompt", "") == 2
    assert "math_prompt" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("data", "extra", "message"),
    [
        ("mine={data}:training", [], "'training' is not a role"),
        ("my/bench={data}", [], "letters, digits"),
        ("mine={data}", ["--benchmarks", "mine", "other"], "--data other=FILE.jsonl"),
        ("mine={data}", ["--benchmarks", "pope"], "'mine' is not among --benchmarks"),
        ("mine=/no/such.jsonl", [], "does not exist"),
    ],
)
def test_bad_own_benchmark_options_exit_2_writing_nothing(trained, tmp_path, capsys, data, extra, message):
    out = tmp_path / "out"
    assert (
        _eval(trained["base"], "--data", data.format(data=trained["data"]), "--output_dir", str(out), *extra)
        == 2
    )
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_rerun_with_another_role_is_refused(trained, tmp_path, capsys):
    out = str(tmp_path / "o")
    assert (
        _eval(trained["base"], "--data", f"mine={trained['data']}:ood", "--output_dir", out, "--limit", "1")
        == 0
    )
    before = (tmp_path / "o" / "records.jsonl").read_bytes()
    assert _eval(trained["base"], "--data", f"mine={trained['data']}:general", "--output_dir", out) == 2
    assert "benchmark 'mine' is recorded with role 'ood', not 'general'" in capsys.readouterr().err
    assert (tmp_path / "o" / "records.jsonl").read_bytes() == before


def test_a_rerun_with_another_role_is_refused_before_the_model_loads(trained, tmp_path, capsys, monkeypatch):
    import ncgrpo.eval.evaluate as evaluate_module

    out = str(tmp_path / "o")
    assert (
        _eval(trained["base"], "--data", f"mine={trained['data']}:ood", "--output_dir", out, "--limit", "1")
        == 0
    )

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the role check")

    monkeypatch.setattr(evaluate_module, "load_for_eval", no_load)
    assert _eval(trained["base"], "--data", f"mine={trained['data']}:general", "--output_dir", out) == 2
    assert "benchmark 'mine' is recorded with role 'ood', not 'general'" in capsys.readouterr().err


def test_own_benchmark_options_are_dataclass_fields() -> None:
    from ncgrpo.commands.eval import EvalArgs

    fields = {f.name: f for f in dataclasses.fields(EvalArgs)}
    assert "NAME=PATH[:ROLE]" in fields["data"].metadata["help"]
