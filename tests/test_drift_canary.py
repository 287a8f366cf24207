"""The drift canary: vanilla GRPO and NC-GRPO (sigma0 0.2) at seeds 0 and 1, four steps each on the
embedded base and the demo's own settings, and every other built-in rollout method at seed 0 for two steps, against committed golden values (tests/golden/drift_canary.json):
per step the loss, the reward, sigma_k and the logged noise effect, and a hash of the trained weights.
It fails at the first run, step and field that moved, so a change that moves results (a new estimator, a
library upgrade, a reordered random draw) is seen at once, not in a README table months later.

A change meant to move results regenerates the file in the same commit, with the reason in the message:

    NCGRPO_UPDATE_GOLDEN=1 python -m pytest tests/test_drift_canary.py

The slow twin (``-m slow``) retrains one whole seed of the default demo and compares its records with
the committed ones (docs/records/seed-table)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden" / "drift_canary.json"
FIELDS = ("loss", "reward", "noise/sigma_k", "noise/first_token_marginal_tv")
STEPS = 4
RUNS = [("vanilla", 0), ("vanilla", 1), ("latent", 0), ("latent", 1)]  # (rollout method, seed)
# every other built-in rollout method (the demo's --all_methods runs), seed 0, fewer steps to keep the
# default suite quick: enough to pin its noise, hooks, inputs and update byte for byte
EXTRA_STEPS = 2
EXTRA_RUNS = ["image", "antithetic", "spsa", "first_token_temperature", "first_token_marginal"]


def _weights_hash(folder: Path) -> str:
    """sha256 over the saved tensors (name, dtype, shape, bytes), independent of the file's metadata."""
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _train_runs(tmp: Path) -> dict[str, dict]:
    import torch

    from ncgrpo.eval.evaluate import model_id_of
    from ncgrpo.toy import demo_stages
    from ncgrpo.toy.demo import _load_questions
    from ncgrpo.toy.demo_config import DemoConfig, DemoRun

    cfg = DemoConfig(
        output_dir=tmp, max_steps=STEPS, seeds=2, sigma0=(0.2,), val_limit=0, progress=False, num_threads=1
    )
    suite = demo_stages._ensure_suite(cfg)
    base = demo_stages._base_model(cfg)
    train, val, _ = _load_questions(cfg, suite)
    specs = {s.rollout_method: s for s in cfg.methods()}
    extra_cfg = DemoConfig(
        output_dir=tmp / "all",
        max_steps=EXTRA_STEPS,
        seeds=1,
        sigma0=(0.2,),
        val_limit=0,
        progress=False,
        num_threads=1,
        all_methods=True,
    )
    extra_specs = {s.rollout_method: s for s in extra_cfg.methods()}
    assert sorted(extra_specs) == sorted({m for m, _ in RUNS} | set(EXTRA_RUNS)), (
        "a built-in method is missing"
    )
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order whatever the machine's core count
    try:
        for run_cfg, spec, seed in [(cfg, specs[m], s) for m, s in RUNS] + [
            (extra_cfg, extra_specs[m], 0) for m in EXTRA_RUNS
        ]:
            run = DemoRun(run_cfg, spec, seed, Path(base), model_id_of(Path(base)))
            demo_stages._train(run, run.settings(), train, val)
            rows = [json.loads(line) for line in (run.train_dir / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if "loss" in r]
            out[f"{spec.slug}-seed{seed}"] = {
                "steps": [{"step": r.get("step")} | {k: r.get(k) for k in FIELDS} for r in rows],
                "weights_sha256": _weights_hash(run.train_dir),
            }
    finally:
        torch.set_num_threads(threads)
    return out


def _first_difference(golden: dict, now: dict) -> str | None:
    for run, want in golden["runs"].items():
        got = now.get(run)
        if got is None:
            return f"{run}: not trained now (runs now: {sorted(now)})"
        for i, (w, g) in enumerate(zip(want["steps"], got["steps"], strict=False)):
            for k in ("step", *FIELDS):
                a, b = w.get(k), g.get(k)
                same = a == b or (
                    isinstance(a, float) and isinstance(b, float) and abs(a - b) <= 1e-9 * max(abs(a), abs(b))
                )
                if not same:
                    return f"{run} step {w.get('step', i + 1)}: {k} was {a!r}, is now {b!r}"
        if len(want["steps"]) != len(got["steps"]):
            return f"{run}: {len(want['steps'])} logged steps in the golden file, {len(got['steps'])} now"
        if want["weights_sha256"] != got["weights_sha256"]:
            return f"{run}: the trained weights' hash moved ({want['weights_sha256'][:12]} -> {got['weights_sha256'][:12]})"
    return None


def test_every_method_trains_as_the_golden_file_says(tmp_path):
    now = _train_runs(tmp_path / "canary")
    if os.environ.get("NCGRPO_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(
            json.dumps(
                {"steps": STEPS, "extra_steps": EXTRA_STEPS, "fields": list(FIELDS), "runs": now}, indent=1
            )
            + "\n"
        )
        pytest.skip(f"rewrote {GOLDEN}")
    golden = json.loads(GOLDEN.read_text())
    moved = _first_difference(golden, now)
    assert moved is None, (
        f"drift canary: {moved}. If this change is meant to move results, regenerate the golden file in the "
        "same commit (NCGRPO_UPDATE_GOLDEN=1 python -m pytest tests/test_drift_canary.py) and say why in the "
        "commit message."
    )
    # the canary can fail: the NC-GRPO runs logged live noise, and vanilla none
    assert all(s["noise/sigma_k"] and s["noise/sigma_k"] > 0 for s in now["ncgrpo-sigma0.2-seed0"]["steps"])


@pytest.mark.slow
def test_the_default_demo_retrained_gives_the_committed_records(tmp_path):
    """One whole seed of the default demo (base, vanilla and NC-GRPO sigma0 0.2, seed 0), retrained and
    evaluated now, gives the committed records of README's first table (docs/records/seed-table) record
    for record, and the same model ids. Fails with the run and the first question that moved."""
    import subprocess
    import sys

    from ncgrpo.toy.seed_runs import read_export
    from ncgrpo.toy.seed_table import export

    out = tmp_path / "demo"
    subprocess.run(
        [sys.executable, "-m", "ncgrpo", "demo", "--output_dir", str(out), "--seeds", "1", "--no_progress"],
        check=True,
        timeout=3000,
    )
    export([out], tmp_path / "records")
    committed = Path(__file__).resolve().parents[1] / "docs" / "records" / "seed-table"
    for file, slug, seed in [
        ("base.jsonl.gz", "base", None),
        ("grpo-seed0.jsonl.gz", "grpo", 0),
        ("ncgrpo-sigma0.2-seed0.jsonl.gz", "ncgrpo-sigma0.2", 0),
    ]:
        _, want, want_made = read_export(committed / file, slug, seed)
        _, got, got_made = read_export(tmp_path / "records" / file, slug, seed)
        moved = next((f"{w} -> {g}" for w, g in zip(want, got, strict=False) if w != g), None)
        assert moved is None and len(want) == len(got), f"{file}: the first record that moved: {moved}"
        if want_made.get("model") is not None:
            assert got_made["model"] == want_made["model"], f"{file}: model id moved"
