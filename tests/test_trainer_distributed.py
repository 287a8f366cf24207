"""Two CPU processes (torchrun + gloo) with groups spanning processes: G=4, per-device batch 2, so
rank 0 generates a prompt's clean half and rank 1 its noisy half. The rows' noise flags and keys, the
noise actually applied, sigma_k and SPSA's mu must be what one process with per-device batch 4 gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "two_process_rollouts.py"


def _run(cmd: list[str], cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.slow
def test_two_processes_plan_rows_like_one(tmp_path) -> None:
    run_torchrun(SCRIPT, str(tmp_path / "two"), "--per-device", "2", cwd=tmp_path)
    _run([sys.executable, str(SCRIPT), str(tmp_path / "one"), "--per-device", "4"], tmp_path)
    r0, r1 = (json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in (0, 1))
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    assert (r0["num_processes"], one["num_processes"]) == (2, 1)
    assert len(one["history"]) == 2
    for k, (a, b, s) in enumerate(zip(r0["history"], r1["history"], one["history"], strict=True)):
        assert a["step"] == b["step"] == s["step"] == k + 1
        assert a["sigma_k"] == b["sigma_k"] == s["sigma_k"]
        # the hook on each rank applied its slice of the one-process plan
        assert a["local_rows"] + b["local_rows"] == s["local_rows"] == s["rows"] == a["rows"] == b["rows"]
        assert [row[2] for row in s["rows"]] == [False, False, True, True]  # clean half on rank 0, noisy on 1
        # every rank holds the same gathered view (rewards, advantages, metrics)
        assert (
            a["rewards"] == b["rewards"]
            and a["advantages"] == b["advantages"]
            and a["metrics"] == b["metrics"]
        )
        assert a["mu_norm"] == b["mu_norm"]
    # step 1: same model, same prompt -> the very same perturbation landed on the same rows
    assert r0["history"][0]["rel"] == pytest.approx(one["history"][0]["rel"], abs=1e-6)
    assert all(v > 0 for v in one["history"][0]["rel"][2:]) and one["history"][0]["rel"][:2] == [0.0, 0.0]
    assert r0["mu"] == r1["mu"]  # SPSA's mu identical on every rank
    assert r0["param_sum"] == r1["param_sum"]


def test_target_schedule_solves_one_sigma_on_every_process_as_one_process_does(tmp_path) -> None:
    """target_marginal_tv: each evaluation of the solve sums the ranks' TVs, so both ranks (rank 1 holds
    only noisy rows: no prompt of its own to count) solve the one-process sigma_k, and the logged TV of
    what was generated is the target's."""
    args = ["--method", "latent", "--target", "0.002"]
    run_torchrun(SCRIPT, str(tmp_path / "two"), "--per-device", "2", *args, cwd=tmp_path)
    _run([sys.executable, str(SCRIPT), str(tmp_path / "one"), "--per-device", "4", *args], tmp_path)
    r0, r1 = (json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in (0, 1))
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    for k, (a, b, s) in enumerate(zip(r0["history"], r1["history"], one["history"], strict=True)):
        assert a["sigma_k"] == b["sigma_k"] > 0
        assert a["metrics"]["noise/target_solver_evals"] == b["metrics"]["noise/target_solver_evals"]
        if (
            k == 0
        ):  # the same weights and batch: the one-process sigma_k (step 2's weights differ by rounding)
            assert a["sigma_k"] == pytest.approx(s["sigma_k"], rel=1e-4)
        for m in (a["metrics"], s["metrics"]):  # the batch's TV at the solved sigma is the annealed target
            target = m["noise/target_marginal_tv"]
            assert abs(m["noise/target_achieved_tv"] - target) <= 0.02 * target
        # and so is the TV of what was generated (logged where a group's clean and noisy rows share a rank)
        target = s["metrics"]["noise/target_marginal_tv"]
        assert abs(s["metrics"]["noise/first_token_marginal_tv"] - target) <= 0.1 * target


def test_prompt_scope_solves_each_prompts_sigma_on_any_process_count(tmp_path) -> None:
    """target_scope='prompt': rank 0 holds the prompt's clean half (it counts the prompt), rank 1 only its
    noisy half (it solves the prompt for its own rows, with no collective in the solve); both log the
    one-process sigma, and the prompt's TV is the target on both."""
    args = ["--method", "latent", "--target", "0.002", "--scope", "prompt"]
    run_torchrun(SCRIPT, str(tmp_path / "two"), "--per-device", "2", *args, cwd=tmp_path)
    _run([sys.executable, str(SCRIPT), str(tmp_path / "one"), "--per-device", "4", *args], tmp_path)
    r0, r1 = (json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in (0, 1))
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    for k, (a, b, s) in enumerate(zip(r0["history"], r1["history"], one["history"], strict=True)):
        assert a["sigma_k"] == b["sigma_k"] > 0 and a["metrics"] == b["metrics"]
        assert (
            a["metrics"]["noise/sigma_k_min"] == a["metrics"]["noise/sigma_k_max"] == a["sigma_k"]
        )  # one prompt
        if k == 0:  # the same weights and prompt: the one-process sigma
            assert a["sigma_k"] == pytest.approx(s["sigma_k"], rel=1e-4)
        for m in (a["metrics"], s["metrics"]):
            target = m["noise/target_marginal_tv"]
            assert abs(m["noise/target_achieved_tv"] - target) <= 0.02 * target


def test_tp_group_rows_are_gathered_in_trls_prompt_order(tmp_path) -> None:
    """Colocated vLLM with TP 2: TRL all-gathers the TP group's prompts and both ranks generate all of
    them; the rows' noise specs must be gathered in the same order, so request i carries the spec of
    the row whose prompt is i, and both ranks send identical requests (two gloo processes)."""
    run_torchrun(Path(__file__).parent / "scripts" / "tp_group_rows.py", str(tmp_path), cwd=tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["rows"] == r1["rows"] == r0["local"] + r1["local"]  # rank order, as TRL's prompt gather
    assert r0["prompts"] == r1["prompts"] == [[0, i] for i in range(4)] + [[1, i] for i in range(4)]
    assert r0["scales"] == r1["scales"] == [0.0, 0.1, 0.2, 0.3, 1.0, 1.1, 1.2, 1.3]
    assert r0["none_scales"] is None and r0["same_without_scales"] and r1["same_without_scales"]
    keys = [tuple(r[1]) for r in r0["rows"] if r is not None and r[1] is not None]
    assert len(keys) == len(set(keys)) == 4  # each rank's noisy half, keys distinct across ranks
