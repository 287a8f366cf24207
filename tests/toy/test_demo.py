"""``ncgrpo demo``: configuration checks, the method roster, and a miniature end-to-end run.

The end-to-end test runs the real pipeline (suite export -> Geometry3K loader -> NCGRPOTrainer ->
evaluate -> compare -> plots) with a micro random Qwen2.5-VL, 2 steps, G=4 and 2 test questions per
family, then reruns it to check that finished runs are skipped and that changed settings are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncgrpo.toy.demo import run_demo
from ncgrpo.toy.demo_config import BASELINE, DemoConfig
from ncgrpo.toy.suite import first_per_family

FAMILIES = ("geometry", "counting", "bar_chart", "compare", "colour_choice", "pope")


# ------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(max_steps=0), "max_steps must be a positive integer"),
        (dict(seeds=0), "seeds must be a positive integer"),
        (
            dict(seeds=1_000_000_000),
            "seeds must be at most 1000, got 1000000000: the demo trains",
        ),  # grew to 23.7 GB
        (dict(num_generations=3), "num_generations must be even"),
        (dict(num_generations=6, all_methods=True), "multiple of 4"),
        (dict(sigma0=()), "at least one noise scale"),
        (dict(sigma0=(0.2, -0.1)), r"finite number >= 0 \(0 disables the noise\), got -0.1"),
        (dict(sigma0=(0.2, 11.0)), r"sigma0: every noise scale must be at most 10, got 11.0"),
        (dict(sigma0=(0.2, 0.2)), "twice"),
        (dict(eval_limit=0), "eval_limit"),
        (dict(val_limit=100), "val_limit=100"),
        (dict(val_every=0), "val_every"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(lr_scheduler_type="constnat"), "lr_scheduler_type must be one of .*constant"),
        (dict(rollout_methods=["latent", "imag"]), r"rollout_methods: \['imag'\] unknown"),
        (dict(rollout_methods=["spsa"]), r"rollout_methods: \['spsa'\] train only with --all_methods"),
        (dict(device="tpu"), "device must be"),
        (dict(device="cuda:x"), "device must be"),
        (dict(num_threads=-1), "num_threads"),
        (dict(noise_site="last"), "final_norm"),
    ],
)
def test_config_rejects_bad_values_and_says_what_to_fix(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        DemoConfig(**kw)


def test_config_names_a_model_folder_without_config(tmp_path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path}.*config.json"):
        DemoConfig(model_name_or_path=tmp_path)


def test_roster_schedule_and_batch() -> None:
    cfg = DemoConfig()
    assert [(m.name, m.rollout_method, m.fields) for m in cfg.methods()] == [
        (BASELINE, "vanilla", {}),
        ("NC-GRPO σ0=0.2", "latent", {"sigma0": 0.2, "noise_site": "final_norm"}),
    ]
    assert DemoConfig(max_steps=60).k_mid == 40.0  # the paper's k_mid for K = 60
    assert cfg.k_mid == 80.0 and cfg.max_steps == 120  # the demo's K: the anneal keeps its shape
    assert DemoConfig(max_steps=30).k_mid == 20.0  # scaled: the anneal keeps its shape
    assert cfg.batch_size == cfg.prompts_per_step * cfg.num_generations
    everything = DemoConfig(sigma0=(0.2, 0.5), all_methods=True, seeds=3)
    methods = [m.rollout_method for m in everything.methods()]
    assert methods == [
        "vanilla",
        "latent",
        "latent",
        "image",
        "antithetic",
        "spsa",
        "first_token_temperature",
        "first_token_marginal",
    ]
    assert len({m.slug for m in everything.methods()}) == 8
    # the controls: T0 matched on the noise-averaged first-token TV; q̄ of the first sigma0
    names = [m.name for m in everything.methods()]
    assert names[-2:] == ["First-token T0=1.02", "First-token q̄ σ0=0.2"]
    assert everything.seed_values() == [0, 1, 2]
    # the propagating variant is named by its site, in the table and in the run folders
    layered = DemoConfig(noise_site="1", all_methods=True).methods()
    assert [m.name for m in layered][1] == "NC-GRPO σ0=0.2 @L1" and layered[1].slug == "ncgrpo-sigma0.2-L1"
    assert [m.name for m in layered][2] == "NoisyRollout (image)"  # no hidden noise: no site
    assert "first_token_marginal" not in [m.rollout_method for m in layered]  # q̄ is the final-norm site's
    # a subset of the roster (one process per subset); the baseline always trains
    some = DemoConfig(sigma0=(0.2, 0.5), all_methods=True, rollout_methods=["image", "spsa"]).methods()
    assert [m.rollout_method for m in some] == ["vanilla", "image", "spsa"]
    assert [m.slug for m in DemoConfig(rollout_methods=["vanilla"]).methods()] == ["grpo"]


def test_target_rows_replace_the_sigma0_rows_of_the_methods_the_target_schedule_sets() -> None:
    cfg = DemoConfig(target_marginal_tv=[0.0066, 0.038])
    assert [(m.name, m.slug, m.fields) for m in cfg.methods()[1:]] == [
        ("NC-GRPO TV=0.0066", "ncgrpo-tv0.0066", {"sigma0": 0.2, "noise_site": "final_norm", "target_marginal_tv": 0.0066}),
        ("NC-GRPO TV=0.038", "ncgrpo-tv0.038", {"sigma0": 0.2, "noise_site": "final_norm", "target_marginal_tv": 0.038}),
    ]  # fmt: skip
    everything = DemoConfig(target_marginal_tv=[0.0066], all_methods=True).methods()
    by_method = {m.rollout_method: m for m in everything}
    assert by_method["antithetic"].fields["target_marginal_tv"] == 0.0066  # at the first target
    assert "target_marginal_tv" not in by_method["spsa"].fields  # refused by the schedule: at sigma0
    assert by_method["spsa"].slug == "spsa-sigma0.2"
    for bad, message in (
        (dict(target_marginal_tv=[0.0]), r"a TV in \(0, 1\]"),
        (dict(target_marginal_tv=[0.01, 0.01]), "lists a target twice"),
        (dict(target_marginal_tv=[0.01], noise_site="1"), "layer site"),
    ):
        with pytest.raises(ValueError, match=message):
            DemoConfig(**bad)


def test_first_per_family_keeps_order_and_limit() -> None:
    class Q:
        def __init__(self, benchmark, i):
            self.benchmark, self.i = benchmark, i

    qs = [Q("a", 0), Q("b", 1), Q("a", 2), Q("a", 3), Q("b", 4)]
    assert [q.i for q in first_per_family(qs, 2)] == [0, 1, 2, 4]
    assert [q.i for q in first_per_family(qs, None)] == [0, 1, 2, 3, 4]


def test_cli_flags_reach_the_config(monkeypatch, tmp_path, capsys) -> None:
    from ncgrpo.cli import main

    seen = {}

    def fake_run_demo(cfg):
        seen["cfg"] = cfg
        raise ValueError("stop here")

    monkeypatch.setattr("ncgrpo.toy.demo.run_demo", fake_run_demo)
    argv = ["demo", "--out", str(tmp_path), "--steps", "7", "--seeds", "3", "--sigma0", "0.2", "0.5",
            "--all-methods", "--eval_limit", "5", "--device", "cpu", "--noise-site", "1", "--threads", "0",
            "--no_progress", "--rollout_methods", "image", "latent", "--lr_scheduler_type", "constant",
            "--workers", "3"]  # fmt: skip
    assert main(argv) == 2  # the ValueError is reported, not raised
    err = capsys.readouterr().err
    assert "ncgrpo demo: error: stop here" in err
    # the old spellings still work for one release, each with a deprecation message
    for old, new in (("out", "output_dir"), ("steps", "max_steps"), ("threads", "num_threads")):
        assert f"--{old} is deprecated and will be removed in ncgrpo 0.2.0; use --{new}" in err
    cfg = seen["cfg"]
    assert (cfg.output_dir, cfg.max_steps, cfg.seeds, cfg.sigma0, cfg.all_methods) == (
        tmp_path,
        7,
        3,
        (0.2, 0.5),
        True,
    )
    assert (cfg.eval_limit, cfg.noise_site, cfg.num_threads, cfg.progress) == (5, "1", None, False)
    assert (cfg.rollout_methods, cfg.lr_scheduler_type, cfg.workers) == (("image", "latent"), "constant", 3)

    # a config file, with flags overriding it
    conf = tmp_path / "demo.yaml"
    conf.write_text("steps: 9\nsigma0: [0.3]\nval_limit: 0\nmodel: null\n")  # old keys: deprecated
    assert main(["demo", "--config", str(conf), "--max_steps", "11"]) == 2
    assert f"{conf}: key 'steps' is deprecated" in capsys.readouterr().err
    cfg = seen["cfg"]
    assert (cfg.max_steps, cfg.sigma0, cfg.val_limit, cfg.model_name_or_path) == (11, (0.3,), 0, None)

    for bad, message in [
        (["--sigma0", "0.2", "x"], "argument --sigma0: invalid float value: 'x'"),
        (["--sigma0", "0.2,0.5"], "invalid float value: '0.2,0.5'"),
        (["--num_generations", "3"], "num_generations must be even"),
        (["--max_stepz", "3"], "unknown option --max_stepz (did you mean '--max_steps'?)"),
    ]:
        assert main(["demo", *bad]) == 2
        assert message in capsys.readouterr().err
    conf.write_text("max_stepz: 9\n")
    assert main(["demo", "--config", str(conf)]) == 2
    assert f"{conf}: unknown key 'max_stepz' (did you mean 'max_steps'?)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--noise_site", "99"], "names layer 99 but .* has 3 decoder layers"),
        (["--noise_site", "1", "--all_methods"], "SPSA .*: rollout_method='spsa'.*final_norm"),
    ],
)
def test_every_setting_is_checked_before_anything_is_written(tmp_path, capsys, flags, match) -> None:
    """As ``ncgrpo train``: a noise site past the base model's layers, or one a method refuses, fails
    before the suite, the base model's records or any run is written."""
    import re

    from ncgrpo.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--output_dir", str(out), "--no_progress", *flags]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not out.exists()


def test_a_new_setting_reaches_the_demos_runs_and_their_identity_with_no_edit(monkeypatch) -> None:
    """The demo composes NCGRPOConfig: a new NCGRPOConfig field is in every run's trainer config and
    identity (config.yaml) with its default, a DemoConfig field of the same name is passed to it by
    name, and a new demo-only field is part of each run's identity, all with no edit to the demo."""
    import dataclasses

    from ncgrpo.toy.demo_config import DemoRun
    from ncgrpo.trainer import NCGRPOConfig

    @dataclasses.dataclass
    class WithANewField(NCGRPOConfig):
        brand_new_setting: int = dataclasses.field(default=0, metadata={"help": "new"})

    @dataclasses.dataclass
    class DemoWithIt(DemoConfig):
        brand_new_setting: int = dataclasses.field(default=7, metadata={"help": "the demo's value"})
        new_demo_knob: int = dataclasses.field(default=3, metadata={"help": "a demo-only setting"})
        max_grad_norm: float = dataclasses.field(default=0.25, metadata={"help": "a TRL field the demo sets"})

    def latent_run(cfg: DemoConfig) -> DemoRun:
        return DemoRun(cfg, cfg.methods()[1], 0, Path("base"), "base@0")

    monkeypatch.setattr("ncgrpo.trainer.NCGRPOConfig", WithANewField)
    monkeypatch.setattr("ncgrpo.toy.demo_config.NCGRPOConfig", WithANewField)  # where the demo reads it
    run = latent_run(DemoConfig())
    assert run.training_args().brand_new_setting == 0 and run.settings()["brand_new_setting"] == 0
    run = latent_run(DemoWithIt())
    assert run.training_args().brand_new_setting == 7
    settings = run.settings()
    assert (settings["brand_new_setting"], settings["new_demo_knob"]) == (7, 3)
    # a TRL field the demo sets for its runs (outside INHERITED_IDENTITY) is part of what they are too
    assert run.training_args().max_grad_norm == 0.25 and settings["max_grad_norm"] == 0.25
    # what selects the runs, where they run and the test evaluation are not what a run is
    assert {"seeds", "workers", "progress", "eval_limit", "max_new_tokens", "output_dir"}.isdisjoint(settings)
    assert (settings["max_steps"], settings["schedule_k_mid"], settings["model_name_or_path"]) == (
        120,
        80.0,
        "base@0",
    )


def test_the_demos_trainer_fields_take_ncgrpo_configs_defaults() -> None:
    """A DemoConfig field that is an NCGRPOConfig field has NCGRPOConfig's default where the demo sets
    none of its own, and a name NCGRPOConfig lacks fails when the field is declared."""
    from ncgrpo.toy.demo_config import _trainer_field
    from ncgrpo.trainer import NCGRPOConfig

    cfg, trainer = DemoConfig(), NCGRPOConfig.__dataclass_fields__
    for name in ("num_generations", "lr_scheduler_type", "noise_site"):
        assert getattr(cfg, name) == trainer[name].default, name
    assert list(cfg.sigma0) == [trainer["sigma0"].default]
    with pytest.raises(KeyError):
        _trainer_field("no_such_setting", "help")


def test_the_noise_site_is_part_of_only_the_hidden_noise_runs(tmp_path) -> None:
    """Vanilla GRPO (and the image method) are the same runs at any noise site, so a rerun with another
    --noise_site into the same folder reuses them; NC-GRPO's run is another run."""
    from ncgrpo.toy.demo_config import DemoRun

    def settings(cfg: DemoConfig, method: str) -> dict:
        spec = next(m for m in cfg.methods() if m.rollout_method == method)
        return DemoRun(cfg, spec, 0, tmp_path, "base@0").settings()

    paper, layer = DemoConfig(all_methods=True), DemoConfig(noise_site="1", all_methods=True)
    for method in ("vanilla", "image", "first_token_temperature"):
        assert settings(paper, method) == settings(layer, method), method
    assert (
        settings(layer, "latent")["noise_site"] == "1"
        and settings(paper, "latent")["noise_site"] == "final_norm"
    )


def test_every_demo_field_is_a_documented_flag() -> None:
    import dataclasses

    for f in dataclasses.fields(DemoConfig):
        assert f.metadata.get("help"), f"DemoConfig.{f.name} has no help text"


# ---------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    from ncgrpo.toy.synthetic import IMAGE_SIZE
    from tiny_models import build_processor, build_tokenizer, save_tiny, tiny_qwen2_5_vl

    proc = build_processor(build_tokenizer(), image_size=IMAGE_SIZE)
    model = tiny_qwen2_5_vl(
        processor=proc, seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vision_depth=1, vision_hidden_size=32, vision_intermediate_size=32,
        vision_num_heads=2,
    )  # fmt: skip
    return save_tiny(model, proc, tmp_path_factory.mktemp("micro") / "model")


def _tiny_cfg(out: Path, model: Path, **kw) -> DemoConfig:
    base = dict(
        output_dir=out, model_name_or_path=model, max_steps=2, num_generations=4, prompts_per_step=1, max_completion_length=8,
        max_new_tokens=8, eval_limit=2, val_limit=1, val_every=1, train_size=8, validation_size=2, test_size=2,
        eval_batch_size=8, progress=False,
    )  # fmt: skip
    base.update(kw)
    return DemoConfig(**base)


def test_demo_end_to_end_then_rerun_skips_finished_runs(micro_model, tmp_path) -> None:
    from ncgrpo.eval.records import read_records

    out = tmp_path / "demo"
    cfg = _tiny_cfg(out, micro_model)
    result = run_demo(cfg)

    # 1. the suite went through the Geometry3K schema
    assert sorted(p.name for p in (out / "suite" / "data").glob("*.parquet")) == [
        "test-00000-of-00001.parquet", "train-00000-of-00001.parquet", "validation-00000-of-00001.parquet",
    ]  # fmt: skip
    # 3./4. one trained and evaluated run per configuration, every family recorded
    assert [(r.name, r.method, r.trained, r.evaluated) for r in result.runs] == [
        (BASELINE, "vanilla", True, True),
        ("NC-GRPO σ0=0.2", "latent", True, True),
    ]
    for r in result.runs:
        recs = read_records(r.eval_dir / "records.jsonl")
        assert len(recs) == 2 * len(FAMILIES)
        assert {x.benchmark for x in recs} == {f"synthetic/{f}" for f in FAMILIES}
        assert {x.role for x in recs} == {"in_domain", "ood", "general"}
        assert json.loads((r.eval_dir / "run.json").read_text())["name"] == r.name
        rows = [json.loads(line) for line in (r.train_dir / "metrics.jsonl").read_text().splitlines()]
        assert all("step" in row for row in rows)
        assert [row["step"] for row in rows if "reward" in row] == [1, 2]  # each step logged once
        assert [row["step"] for row in rows if "val/accuracy" in row] == [0, 1, 2]
        # the demo's schedule reaches the trainer: TRL's linear decay by default
        lrs = sorted({row["learning_rate"] for row in rows if "reward" in row}, reverse=True)
        assert len(lrs) == 2 and cfg.learning_rate >= lrs[0] > lrs[1], lrs
        assert (r.train_dir / "model.safetensors").is_file()
    latent_rows = (result.runs[1].train_dir / "metrics.jsonl").read_text()
    assert (
        "noise/sigma_k" in latent_rows
        and "noise/sigma_k" not in (result.runs[0].train_dir / "metrics.jsonl").read_text()
    )
    # 5. tables and figures
    for key in ("table_md", "table_tex", "table_json", "gains.png", "dynamics.png", "summary"):
        assert result.files[key].is_file() and result.files[key].stat().st_size > 0, key
    assert result.files["gains.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = result.files["table_md"].read_text()
    assert "pooled OOD" in md and "synthetic/geometry" in md and "NC-GRPO σ0=0.2" in md
    assert "\\begin{tabular}" in result.files["table_tex"].read_text()
    tests = {t.scope for t in result.table.tests}
    assert {"pooled OOD", "synthetic/geometry", "synthetic/pope"} <= tests
    summary = json.loads(result.files["summary"].read_text())
    assert summary["wall_time_s"] > 0 and summary["config"]["max_steps"] == 2
    # issue 42: every folder says what made it (commit, package versions), outside its identity
    from ncgrpo.runs.provenance import provenance

    made = provenance()
    assert summary["provenance"] == made and json.loads((out / "run.json").read_text())["provenance"] == made
    for r in result.runs:
        for d in (r.train_dir, r.eval_dir):
            assert json.loads((d / "run.json").read_text())["provenance"] == made, d

    # 6. rerun: nothing retrained or re-evaluated, same records, same table
    again = run_demo(cfg)
    assert [(r.trained, r.evaluated) for r in again.runs] == [(False, False), (False, False)]
    assert [r.accuracy for r in again.runs] == [r.accuracy for r in result.runs]
    assert len(read_records(again.runs[0].eval_dir / "records.jsonl")) == 2 * len(FAMILIES)
    assert again.files["table_md"].read_text() == md

    # a folder written before a setting joined the run's identity (its config.yaml lacks the key) is reused
    import yaml

    config_yaml = result.runs[1].train_dir / "config.yaml"
    older = yaml.safe_load(config_yaml.read_text())
    assert older.pop("weight_decay") is not None and older.pop("adam_beta2") is not None
    config_yaml.write_text(yaml.safe_dump(older))
    assert [(r.trained, r.evaluated) for r in run_demo(cfg).runs] == [(False, False), (False, False)]

    # a finished run is never silently reused with other settings
    with pytest.raises(ValueError, match="steps: 2 -> 3"):
        run_demo(_tiny_cfg(out, micro_model, max_steps=3))


def test_demo_resumes_evaluation_of_a_trained_run(micro_model, tmp_path) -> None:
    """A run killed after training (run.json finished, no records yet) is evaluated, not retrained."""
    out = tmp_path / "demo"
    cfg = _tiny_cfg(out, micro_model, sigma0=(0.5,), val_limit=0, max_steps=1, lr_scheduler_type="constant")
    first = run_demo(cfg)
    rows = [json.loads(line) for line in (first.runs[1].train_dir / "metrics.jsonl").read_text().splitlines()]
    assert {row["learning_rate"] for row in rows if "reward" in row} == {cfg.learning_rate}  # constant
    victim = first.runs[1]
    (victim.eval_dir / "records.jsonl").unlink()
    again = run_demo(cfg)
    assert [(r.trained, r.evaluated) for r in again.runs] == [(False, False), (False, True)]
    assert again.runs[1].accuracy == first.runs[1].accuracy
    assert "dynamics.png" not in again.files  # no validation logged: no dynamics panel to draw


def test_note_flags_a_noisy_run_identical_to_vanilla(tmp_path) -> None:
    """Equal per-step traces mean the noise changed no rollout: the report must say so."""
    from ncgrpo.toy.demo_config import RunResult
    from ncgrpo.toy.demo_stages import _notes

    def run(name, method, rows):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return RunResult(name, method, 0, d, tmp_path / "eval", False, False, first_token_divergence=0.0)

    rows = [{"step": k, "reward": 0.1 * k, "reward_std": 0.2, "loss": 0.01, "completions/mean_length": 20.0}
            for k in (1, 2)]  # fmt: skip
    vanilla = run("v", "vanilla", [{"step": 0, "val/accuracy": 0.5}, *rows])
    same = run("same", "latent", [{"step": 0, "val/accuracy": 0.5}, *rows, {"step": 2, "val/accuracy": 0.5}])
    moved = run("moved", "latent", [rows[0], {**rows[1], "reward": 0.3}])
    (note,) = _notes(DemoConfig(), [vanilla, same, moved])
    assert note.startswith("same (seed 0; mean noise/first_token_divergence 0.0000)") and "moved" not in note
    assert "--noise-site" in note
    assert _notes(DemoConfig(), [vanilla, moved]) == []


# ------------------------------------------------------------------------------------- parallel runs
def test_worker_count(monkeypatch) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert DemoConfig().worker_count(2) == 2  # one thread per run: one run per core, at most one per run
    assert DemoConfig().worker_count(7) == 4
    assert DemoConfig(num_threads=2).worker_count(7) == 2
    assert DemoConfig(num_threads=0).worker_count(7) == 1  # torch's default threads take every core
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as far as the check goes
    assert DemoConfig(device="cuda").worker_count(7) == 1
    monkeypatch.undo()
    assert DemoConfig(workers=3).worker_count(7) == 3 and DemoConfig(workers=3).worker_count(2) == 2
    with pytest.raises(ValueError, match="workers must be a positive number of processes"):
        DemoConfig(workers=0)


def _metrics_without_times(train_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if "time" not in k and "per_second" not in k} for row in rows]


def test_runs_in_worker_processes_equal_runs_in_one_process(micro_model, tmp_path) -> None:
    """Each run is seeded by itself, so training two at once in two processes changes no record."""
    one = run_demo(_tiny_cfg(tmp_path / "one", micro_model, workers=1, val_limit=0))
    two = run_demo(_tiny_cfg(tmp_path / "two", micro_model, workers=2, val_limit=0))
    assert [(r.name, r.seed, r.trained, r.evaluated) for r in two.runs] == [
        (r.name, r.seed, r.trained, r.evaluated) for r in one.runs
    ]
    for a, b in zip(one.runs, two.runs, strict=True):
        assert (b.eval_dir / "records.jsonl").read_bytes() == (a.eval_dir / "records.jsonl").read_bytes()
        assert _metrics_without_times(b.train_dir) == _metrics_without_times(a.train_dir)
        assert b.accuracy == a.accuracy
    assert two.files["table_md"].read_text() == one.files["table_md"].read_text().replace(
        str(tmp_path / "one"), str(tmp_path / "two")
    )


def test_a_second_demo_into_the_same_folder_fails_at_once(micro_model, tmp_path) -> None:
    import subprocess
    import sys

    from ncgrpo.runs.folder import FolderBusyError

    out = tmp_path / "demo"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from ncgrpo.runs.folder import FolderLock; "
         f"FolderLock({str(out)!r}, 'other demo').acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusyError, match=rf"pid {holder.pid} \(other demo\)"):
            run_demo(_tiny_cfg(out, micro_model))
        assert not (out / "suite").exists()  # refused before writing anything
    finally:
        holder.kill()
        holder.wait()


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_sigkill_of_the_demo_kills_its_workers_and_a_rerun_finishes(micro_model, tmp_path) -> None:
    """No orphan worker goes on writing a run folder after the demo process is SIGKILLed mid-training."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "demo"
    flags = ["--output_dir", str(out), "--model_name_or_path", str(micro_model), "--max_steps", "400", "--num_generations", "4",
             "--prompts_per_step", "1", "--max_completion_length", "8", "--max_new_tokens", "8", "--eval_limit", "2",
             "--val_limit", "0", "--train_size", "8", "--validation_size", "2", "--test_size", "2",
             "--workers", "2", "--no_progress"]  # fmt: skip
    demo = subprocess.Popen([sys.executable, "-m", "ncgrpo", "demo", *flags], stdout=subprocess.DEVNULL)
    runs = [out / "train" / "grpo-seed0", out / "train" / "ncgrpo-sigma0.2-seed0"]
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while not all((d / "metrics.jsonl").is_file() for d in runs):  # both workers are training
            assert demo.poll() is None and time.monotonic() < deadline, "the demo ended or never trained"
            time.sleep(0.5)
        workers = _children(demo.pid)
        assert len(workers) >= 2
        demo.send_signal(signal.SIGKILL)
        demo.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers), "a worker outlived the demo"
        assert all(not json.loads((d / "run.json").read_text())["finished"] for d in runs)
    finally:
        if demo.poll() is None:
            demo.kill()
        for p in workers | _children(demo.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    # a rerun restarts both unfinished runs (their settings are checked only once finished) and finishes
    again = run_demo(_tiny_cfg(out, micro_model, max_steps=3, val_limit=0, workers=2))
    assert [(r.trained, r.evaluated) for r in again.runs] == [(True, True), (True, True)]


def test_note_blames_zero_reward_variance_not_the_noise(tmp_path) -> None:
    """Issue 26, item 6: every completion clipped at --max_completion_length 8 and scored 0 makes every
    logged step of every run equal whatever the noise did; the note says no group had reward variance
    (read from frac_reward_zero_std) instead of blaming the noise."""
    from ncgrpo.toy.demo_config import RunResult
    from ncgrpo.toy.demo_stages import _notes

    def run(name, method, rows):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return RunResult(name, method, 0, d, tmp_path / "eval", False, False, first_token_divergence=0.3)

    flat = [{"step": k, "reward": 0.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0, "loss": 0.0,
             "completions/mean_length": 8.0, "completions/clipped_ratio": 1.0} for k in (1, 2)]  # fmt: skip
    notes = _notes(
        DemoConfig(max_completion_length=8), [run("v", "vanilla", flat), run("nc", "latent", flat)]
    )
    assert len(notes) == 1, notes
    assert "no group had reward variance at any of the 2 logged steps" in notes[0]
    assert (
        "v (seed 0)" in notes[0] and "nc (seed 0)" in notes[0] and "100% of completions clipped" in notes[0]
    )
    assert "raise --max_completion_length" in notes[0]
    assert "noisy half sampled exactly vanilla GRPO's rollouts" not in notes[0]
    from ncgrpo.trainer.inert import reward_variance

    mixed = [*flat, {**flat[0], "step": 3, "frac_reward_zero_std": 0.5, "reward_std": 0.4}]
    assert not reward_variance(mixed).none_at_all and reward_variance(flat).none_at_all
    assert reward_variance(
        [{"step": 1, "reward": 0.2, "reward_std": 0.0}]
    ).none_at_all  # old logs: reward_std
