"""NC-GRPO's verl classes on verl 0.9.1's REAL code (marker ``verl``; run in .venv-verl, see
scripts/setup_verl.sh; they skip where verl is not installed).

What runs for real: verl's config (Hydra compose of its ``ppo_trainer.yaml``), ``AgentLoopWorkerTQ``'s
constructor, ``generate_sequences`` / ``_run_prompt`` / ``_run_agent_loop`` / ``_agent_loop_postprocess``
/ ``_compute_score``, its ``single_turn_agent`` loop on a tiny Qwen2 tokenizer, ``AgentLoopManagerTQ``,
``TaskRunnerV1``, the trainer registry, ``compute_advantage_for_multi_trajectories`` (the v1 trainer's
GRPO) and ``monkey_patch_compute_logits``. Replaced at their boundary: the TransferQueue calls
(``tq.init`` / ``async_kv_put`` / ``async_kv_batch_put`` / ``kv_batch_get``: an in-memory store of what
verl puts, returned through verl's own ``list_of_dict_to_tensordict``), the LLM server (a client that
records each request's sampling params and answers a fixed token per half) and the reward workers (a
rule on that token). A real noisy request through verl's vLLM server is in test_verl_server.py.

    NCGRPO_REQUIRE_VERL=1 OMP_NUM_THREADS=1 .venv-verl/bin/python -m pytest -m verl -p no:cacheprovider \\
        tests/integrations/test_verl.py
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.verl
if os.environ.get("NCGRPO_REQUIRE_VERL") == "1":
    import verl  # noqa: F401  (a broken .venv-verl fails here instead of skipping)
else:
    pytest.importorskip("verl")

import transfer_queue as tq  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.v1 import AgentLoopManagerTQ, AgentLoopWorkerTQ, PPOTrainerSync, get_trainer_cls  # noqa: E402
from verl.trainer.ppo.v1 import agent_loop_tq as verl_tq  # noqa: E402
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from ncgrpo.core.advantages import decompose_advantages, group_advantages  # noqa: E402
from ncgrpo.core.schedule import sigma_schedule  # noqa: E402
from ncgrpo.engines.vllm import EXTRA_ARGS_KEY  # noqa: E402
from ncgrpo.integrations.verl import config as ncv  # noqa: E402
from ncgrpo.integrations.verl import workers as ncw  # noqa: E402
from tiny_models import build_tokenizer, save_tiny, vllm_text_model  # noqa: E402

G = 4  # sessions per prompt: 2 clean + 2 noisy
CLEAN_TOKEN, NOISY_TOKEN = 11, 12  # what the fake server answers first, per half; the reward rule reads it


# --------------------------------------------------------------------------------------------------
# verl's config, a tiny model, and the boundaries (TransferQueue, LLM server, reward workers)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    tok = build_tokenizer()
    return str(save_tiny(vllm_text_model(tok), tok, tmp_path_factory.mktemp("tiny_qwen2")))


def verl_config(model_dir: str, *overrides: str):
    """verl 0.9.1's own ppo_trainer config, composed by Hydra as its main_ppo does, plus overrides."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.n={G}",
                "trainer.total_training_steps=60",
                "algorithm.adv_estimator=grpo",
                "+ncgrpo.rollout_method=latent",
                "+ncgrpo.sigma0=0.2",
                *overrides,
            ],
        )


class FakeTQ:
    """TransferQueue's calls the agent-loop worker and the trainer make, kept in memory."""

    def __init__(self, monkeypatch) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.status: dict[str, str] = {}
        real = verl_tq.list_of_dict_to_tensordict

        def capture(fields):  # the rows exactly as verl builds them, before they become a TensorDict
            self._pending = [dict(f) for f in fields]
            return real(fields)

        async def async_kv_put(key, partition_id, tag):
            self.status[key] = tag["status"]

        async def async_kv_batch_put(keys, fields, tags, partition_id):
            self.rows.update(zip(keys, self._pending, strict=True))

        def kv_batch_get(keys, partition_id, select_fields):
            return real([{f: self.rows[k][f] for f in select_fields} for k in keys])

        monkeypatch.setattr(verl_tq, "list_of_dict_to_tensordict", capture)
        monkeypatch.setattr(tq, "init", lambda *a, **k: None)
        monkeypatch.setattr(tq, "async_kv_put", async_kv_put)
        monkeypatch.setattr(tq, "async_kv_batch_put", async_kv_batch_put)
        monkeypatch.setattr(tq, "kv_batch_get", kv_batch_get)


class FakeServer:
    """verl's LLMServerClient.generate, recorded: a noisy request answers NOISY_TOKEN first."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        self.requests.append({"prompt_ids": list(prompt_ids), "sampling_params": dict(sampling_params)})
        noisy = EXTRA_ARGS_KEY in (sampling_params.get("extra_args") or {})
        first = NOISY_TOKEN if noisy else CLEAN_TOKEN
        return TokenOutput(
            token_ids=[first, 5, 6], log_probs=[-0.5, -0.1, -0.1], extra_fields={"global_steps": 0}
        )


class FakeRewardWorker:
    """verl's reward-loop worker handle: ``await handle.compute_score.remote(data)``; reward 1 for a clean first token."""

    def __init__(self) -> None:
        async def remote(data: DataProto) -> dict:
            first = int(data.batch["responses"][-1][0])
            return {"reward_score": float(first == CLEAN_TOKEN), "reward_extra_info": {}}

        self.compute_score = SimpleNamespace(remote=remote)


def prompts_batch(step: int, *, validate: bool = False, texts=("Find x.", "Find x."), agent_name=None):
    """A batch as verl's v1 trainer hands it to the workers (_fetch_one_gen_batch + global_steps)."""
    raw = np.empty(len(texts), dtype=object)
    for i, t in enumerate(texts):
        raw[i] = [{"role": "user", "content": t + f" ({i})"}]
    batch_dict = {
        "raw_prompt": raw,
        "uid": np.array([f"uid{i}" for i in range(len(texts))], dtype=object),
        "index": np.zeros(len(texts), dtype=np.int64),  # a dataset without extra_info.index: all 0
        "data_source": np.array(["geo3k"] * len(texts), dtype=object),
        "dummy_tensor": torch.zeros(len(texts), 1, dtype=torch.uint8),
    }
    if agent_name is not None:
        batch_dict["agent_name"] = np.array([agent_name] * len(texts), dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    if validate:
        tu.assign_non_tensor_data(batch, "validate", True)
    return batch


async def run_batch(worker, batch) -> None:
    await worker.generate_sequences(batch)  # fire-and-forget in verl's TQ worker
    while worker.background_tasks:
        await asyncio.gather(*list(worker.background_tasks))


@pytest.fixture
def setup(model_dir, monkeypatch):
    fake_tq = FakeTQ(monkeypatch)
    server = FakeServer()

    def make(*overrides: str):
        config = verl_config(model_dir, *overrides)
        worker = ncw.NCGRPOAgentLoopWorker(config, server, None, [FakeRewardWorker()])
        return config, worker

    return SimpleNamespace(tq=fake_tq, server=server, make=make)


def specs_by_session(server: FakeServer, tokenizer) -> dict:
    """{(prompt text, request number): spec or None}, in request order per prompt."""
    out: dict = {}
    for r in server.requests:
        text = tokenizer.decode(r["prompt_ids"])
        spec = (r["sampling_params"].get("extra_args") or {}).get(EXTRA_ARGS_KEY)
        out.setdefault(text, []).append(spec)
    return out


# --------------------------------------------------------------------------------------------------
# the classes are verl's
# --------------------------------------------------------------------------------------------------
def test_the_integration_extends_verls_real_classes():
    assert issubclass(ncw.NCGRPOAgentLoopWorker, AgentLoopWorkerTQ.__ray_actor_class__)
    assert issubclass(ncw.NCGRPOAgentLoopManager, AgentLoopManagerTQ)
    assert issubclass(ncw.NCGRPOTrainerSync, PPOTrainerSync)
    from verl.trainer.main_ppo import TaskRunnerV1

    assert issubclass(ncw.NCGRPOTaskRunner.__ray_actor_class__, TaskRunnerV1.__ray_actor_class__)
    from verl.utils.import_utils import load_class_from_fqn  # how verl resolves agent_loop_manager_class

    assert load_class_from_fqn(ncw.MANAGER_FQN, "AgentLoopManager") is ncw.NCGRPOAgentLoopManager


# --------------------------------------------------------------------------------------------------
# the worker: which sessions get which spec
# --------------------------------------------------------------------------------------------------
def test_the_worker_gives_exactly_the_noisy_sessions_their_specs(setup):
    config, worker = setup.make()
    asyncio.run(run_batch(worker, prompts_batch(step=7)))
    assert setup.tq.status == {"uid0": "finished", "uid1": "finished"}  # no session failed
    assert len(setup.server.requests) == 2 * G
    by_prompt = specs_by_session(setup.server, worker.tokenizer)
    sigma = sigma_schedule(7, 60, 0.2, gamma=30.0, k_mid=40.0)
    keys = []
    for specs in by_prompt.values():
        assert sum(s is None for s in specs) == G // 2  # half clean...
        noisy = [s for s in specs if s is not None]
        assert sorted(s["draw"] for s in noisy) == [0, 1]  # ...half with draws 0 .. n-1
        assert {(s["seed"], s["step"], s["sigma"], s["mode"]) for s in noisy} == {
            (1, 7, sigma, "independent")
        }
        keys += [(s["prompt_id"], s["draw"]) for s in noisy]
    assert (
        len(set(keys)) == 4 and len({k[0] for k in keys}) == 2
    )  # unique per draw; prompts differ (index is 0 for both)
    # what verl stored per row: its session, and the plan of that session (read back by the trainer)
    for key, row in setup.tq.rows.items():
        uid, session, _ = key.rsplit("_", 2)
        plan = row["extra_fields"]["ncgrpo"]
        assert plan["branch"] == int(session) and plan["noisy"] == (int(session) >= G // 2)
        assert plan["sigma"] == (sigma if plan["noisy"] else 0.0) and plan["requests"] == 1
        assert float(row["rm_scores"].sum()) == (
            0.0 if plan["noisy"] else 1.0
        )  # verl's reward path saw the half


def test_another_worker_computes_the_same_keys(setup):
    """Every agent-loop worker (and so every replica and tensor-parallel rank a request reaches) sends the
    same key for the same prompt, session and step: the key is a function of those numbers only."""
    _, w1 = setup.make()
    asyncio.run(run_batch(w1, prompts_batch(step=3)))
    first = [r["sampling_params"].get("extra_args") for r in setup.server.requests]
    setup.server.requests.clear()
    _, w2 = setup.make()
    asyncio.run(run_batch(w2, prompts_batch(step=3, texts=("Find x.", "Find x."))))
    second = [r["sampling_params"].get("extra_args") for r in setup.server.requests]
    canon = lambda xs: sorted(repr(x) for x in xs)  # noqa: E731  (sessions finish in any order)
    assert canon(first) == canon(second) and any(first)


def test_validation_is_clean(setup):
    _, worker = setup.make("actor_rollout_ref.rollout.val_kwargs.n=4")
    asyncio.run(run_batch(worker, prompts_batch(step=7, validate=True)))
    assert setup.tq.status == {"uid0": "finished", "uid1": "finished"}
    assert len(setup.server.requests) == 2 * G
    assert all(
        EXTRA_ARGS_KEY not in (r["sampling_params"].get("extra_args") or {}) for r in setup.server.requests
    )
    assert all(not row["extra_fields"]["ncgrpo"]["noisy"] for row in setup.tq.rows.values())


def test_sigma_follows_verls_global_step(setup):
    _, worker = setup.make("ncgrpo.sigma0=0.5")
    seen = {}
    for step in (1, 40, 55):
        setup.server.requests.clear()
        asyncio.run(run_batch(worker, prompts_batch(step=step)))
        sig = {
            r["sampling_params"]["extra_args"][EXTRA_ARGS_KEY]["sigma"]
            for r in setup.server.requests
            if r["sampling_params"].get("extra_args")
        }
        steps = {
            r["sampling_params"]["extra_args"][EXTRA_ARGS_KEY]["step"]
            for r in setup.server.requests
            if r["sampling_params"].get("extra_args")
        }
        assert steps == {step}
        (seen[step],) = sig
    assert seen == {k: sigma_schedule(k, 60, 0.5, gamma=30.0, k_mid=40.0) for k in (1, 40, 55)}
    assert seen[40] == pytest.approx(0.25) and seen[55] < 0.01


def test_antithetic_and_the_temperature_control_through_the_worker(setup):
    config, worker = setup.make("ncgrpo.rollout_method=antithetic")
    asyncio.run(run_batch(worker, prompts_batch(step=2, texts=("Find x.",))))
    specs = [
        r["sampling_params"]["extra_args"][EXTRA_ARGS_KEY]
        for r in setup.server.requests
        if r["sampling_params"].get("extra_args")
    ]
    assert sorted((s["draw"], s["sign"], s["mode"]) for s in specs) == [
        (0, -1, "antithetic"),
        (0, 1, "antithetic"),
    ]
    setup.server.requests.clear()
    config, worker = setup.make(
        "ncgrpo.rollout_method=first_token_temperature", "+ncgrpo.first_token_temperature=3.0"
    )
    asyncio.run(run_batch(worker, prompts_batch(step=40, texts=("Find x.",))))
    t = float(config.actor_rollout_ref.rollout.temperature)
    t_k = t + (3.0 - t) * sigma_schedule(40, 60, 1.0)
    specs = [r["sampling_params"].get("extra_args") for r in setup.server.requests]
    assert sorted(repr(s) for s in specs) == sorted(
        [repr(None)] * 2 + [repr({EXTRA_ARGS_KEY: {"logit_scale": t / t_k}})] * 2
    )


@register("ncgrpo_test_two_turns")
class TwoTurnAgentLoop(AgentLoopBase):
    """A real verl agent loop that, like the tool agent loop, reuses one sampling_params dict per turn."""

    async def run(self, sampling_params, **kwargs) -> AgentLoopOutput:
        before = dict(sampling_params)
        ids = [1, 2, 3]
        first = await self.server_manager.generate(
            request_id="a", prompt_ids=ids, sampling_params=sampling_params
        )
        second = await self.server_manager.generate(
            request_id="a", prompt_ids=ids + first.token_ids + [4], sampling_params=sampling_params
        )
        assert sampling_params == before  # the caller's dict is never changed
        resp = first.token_ids + [4] + second.token_ids
        return AgentLoopOutput(
            prompt_ids=ids,
            response_ids=resp,
            response_mask=[1] * len(first.token_ids) + [0] + [1] * len(second.token_ids),
            num_turns=3,
            metrics={},
        )


def test_multi_turn_sessions_are_perturbed_at_their_first_request_only(setup):
    _, worker = setup.make()
    asyncio.run(
        run_batch(worker, prompts_batch(step=5, texts=("Find x.",), agent_name="ncgrpo_test_two_turns"))
    )
    assert setup.tq.status == {"uid0": "finished"}
    reqs = setup.server.requests
    assert len(reqs) == 2 * G
    firsts = [r for r in reqs if len(r["prompt_ids"]) == 3]
    seconds = [r for r in reqs if len(r["prompt_ids"]) > 3]
    assert sum(bool(r["sampling_params"].get("extra_args")) for r in firsts) == G // 2
    assert not any(r["sampling_params"].get("extra_args") for r in seconds)  # later turns: clean
    assert sorted(row["extra_fields"]["ncgrpo"]["requests"] for row in setup.tq.rows.values()) == [2] * G


def test_the_worker_refuses_verls_fully_async_client(setup, model_dir):
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    client = FullyAsyncLLMServerClient.__new__(FullyAsyncLLMServerClient)
    with pytest.raises(ValueError, match="trainer_mode=sync"):
        ncw.NCGRPOAgentLoopWorker(verl_config(model_dir), client)


# --------------------------------------------------------------------------------------------------
# the trainer side: verl's GRPO on the two-pass group is Prop. 2; the per-half metrics
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_verls_grpo_advantage_on_a_two_pass_batch_is_prop_2(seed, norm):
    """verl's v1 trainer's GRPO (compute_advantage_for_multi_trajectories) on a hand-made batch of B groups of
    2n sessions (one uid per group, rows shuffled, variable response lengths) equals ncgrpo's
    group_advantages with verl's eps, and within-half + contrast (eq. 5)."""
    g = torch.Generator().manual_seed(seed)
    B, n, T = 3, 3, 5
    rewards = (torch.rand(B, 2 * n, generator=g) < 0.5).float() * 0.9 + 0.1 * torch.rand(
        B, 2 * n, generator=g
    )
    lengths = torch.randint(1, T + 1, (B * 2 * n,), generator=g)
    order = torch.randperm(B * 2 * n, generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # [N, T]
    scores = torch.zeros(B * 2 * n, T)
    scores[torch.arange(B * 2 * n), lengths - 1] = rewards.flatten()  # reward on the last token
    uid = np.array([f"u{i // (2 * n)}" for i in range(B * 2 * n)], dtype=object)
    keys = [f"u{i // (2 * n)}_{i % (2 * n)}_0" for i in range(B * 2 * n)]
    data = DataProto.from_dict(
        tensors={"token_level_rewards": scores[order], "response_mask": mask[order]},
        non_tensors={"uid": uid[order.numpy()]},
    )
    out = compute_advantage_for_multi_trajectories(
        data,
        batch_keys=[keys[i] for i in order],
        adv_estimator=core_algos.AdvantageEstimator.GRPO,
        norm_adv_by_std_in_grpo=norm,
    )
    adv = torch.zeros(B * 2 * n)
    adv[order] = (out.batch["advantages"] * mask[order]).sum(-1) / mask[order].sum(
        -1
    )  # constant over the response
    ours, _ = group_advantages(
        rewards.flatten(),
        torch.arange(B * 2 * n) // (2 * n),
        scale="group" if norm else "none",
        eps=ncv.VERL_EPS,
    )
    assert torch.allclose(adv, ours, atol=1e-5)
    noisy = torch.tensor([False] * n + [True] * n)
    within, contrast = decompose_advantages(
        rewards, noisy, scale="group" if norm else "none", eps=ncv.VERL_EPS
    )
    assert torch.allclose(adv.view(B, 2 * n), within + contrast, atol=1e-5)
    assert not torch.allclose(adv.view(B, 2 * n), within, atol=1e-3)  # the contrast is really there


def test_the_trainer_logs_the_per_half_metrics_from_what_the_worker_stored(setup, monkeypatch):
    config, worker = setup.make()
    asyncio.run(run_batch(worker, prompts_batch(step=9)))
    trainer = ncw.NCGRPOTrainerSync.__new__(ncw.NCGRPOTrainerSync)
    trainer.config = config
    keys = sorted(setup.tq.rows)
    batch = tq.KVBatchMeta(
        partition_id="train", keys=keys + ["pad_0_0"], tags=[{}] * len(keys) + [{"is_padding": True}]
    )
    calls = []
    monkeypatch.setattr(
        PPOTrainerSync, "_compute_metrics", lambda self, b, m, *a: calls.append(b) or m.update(x=1.0)
    )
    metrics: dict = {}
    trainer._compute_metrics(batch, metrics, {}, 9, 0)
    sigma = sigma_schedule(9, 60, 0.2, gamma=30.0, k_mid=40.0)
    assert calls == [batch] and metrics["x"] == 1.0  # verl's own metrics first
    assert metrics["reward/clean"] == 1.0 and metrics["reward/noisy"] == 0.0
    assert metrics["noise/sigma_k"] == pytest.approx(sigma)
    s = float(torch.tensor([1.0, 1.0, 0.0, 0.0]).std())
    assert metrics["reward/contrast"] == pytest.approx(1.0 / (2 * (s + ncv.VERL_EPS)))


# --------------------------------------------------------------------------------------------------
# the target schedule (target_marginal_tv, target_scope prompt): each prompt's sigma solved in vLLM
# --------------------------------------------------------------------------------------------------
TARGET = (
    "+ncgrpo.target_marginal_tv=0.02",
    "+ncgrpo.target_scope=prompt",
    "+ncgrpo.marginal_tv_draws=16",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # verl's default is 2; the solve needs 1
)


def test_the_worker_asks_for_each_prompts_target_on_the_noisy_half_and_nothing_on_the_clean_half(setup):
    config, worker = setup.make(*TARGET, "actor_rollout_ref.rollout.temperature=0.8")
    asyncio.run(run_batch(worker, prompts_batch(step=7)))
    assert setup.tq.status == {"uid0": "finished", "uid1": "finished"}
    tv = 0.02 * sigma_schedule(7, 60, 1.0, gamma=30.0, k_mid=40.0)
    target = {
        "tv": tv,
        "draws": 16,
        "temperature": 0.8,
        "start": 0.2,
        "sigma_max": 2.0,
        "mode": "independent",
        "rtol": 0.02,
    }
    by_prompt = specs_by_session(setup.server, worker.tokenizer)
    assert len(by_prompt) == 2
    for specs in by_prompt.values():
        assert sum(s is None for s in specs) == G // 2  # the clean half: no spec at all
        noisy = [s for s in specs if s is not None]
        assert len(noisy) == G // 2 and all(s["target"] == target for s in noisy)
        assert {(s["seed"], s["step"], s["sigma"]) for s in noisy} == {(1, 7, 0.0)}  # sigma: the engine's
        assert sorted(s["draw"] for s in noisy) == [0, 1] and len({s["prompt_id"] for s in noisy}) == 1
    for row in setup.tq.rows.values():
        plan = row["extra_fields"]["ncgrpo"]
        if plan["noisy"]:
            assert plan["target"] == tv and np.isnan(plan["sigma"]) and plan["prompt_id"] is not None
        else:
            assert plan["target"] is None and plan["sigma"] == 0.0


def test_the_batch_scope_is_refused_on_verl_with_its_reason(model_dir):
    for scope in ([], ["+ncgrpo.target_scope=batch"]):
        config = verl_config(model_dir, "+ncgrpo.target_marginal_tv=0.02", *scope)
        with pytest.raises(ValueError, match="asynchronous.*target_scope=prompt"):
            ncw.NCGRPOAgentLoopManager(config, llm_client=None)
        with pytest.raises(ValueError, match="target_scope='batch' is not supported on verl"):
            ncw.NCGRPOAgentLoopWorker(config, FakeServer(), None, [FakeRewardWorker()])
    manager = ncw.NCGRPOAgentLoopManager(verl_config(model_dir, *TARGET), llm_client=None)
    assert manager.ncgrpo.target_scope == "prompt" and manager.ncgrpo.target_marginal_tv == 0.02
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2.*ParallelLMHead"):  # verl's default TP
        ncw.NCGRPOAgentLoopManager(verl_config(model_dir, *TARGET[:-1]), llm_client=None)


@pytest.fixture
def local_ray():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_the_trainer_reads_the_solved_sigmas_back_from_the_servers(setup, monkeypatch, local_ray):
    """The trainer asks every vLLM server (a real Ray async actor standing in for verl's ``vLLMHttpServer``:
    an ``engine`` whose ``collective_rpc`` is a coroutine on the actor's event loop, as ``AsyncLLM``'s is)
    for the step's solves, once, before verl puts the replicas to sleep, and logs them."""
    ray = local_ray
    config, worker = setup.make(*TARGET)
    asyncio.run(run_batch(worker, prompts_batch(step=9)))
    plans = [row["extra_fields"]["ncgrpo"] for row in setup.tq.rows.values()]
    prompt_ids = sorted({p["prompt_id"] for p in plans if p["noisy"]})
    assert len(prompt_ids) == 2

    def solve(pid, sigma, tv, evals, at_max=False):
        return {
            "seed": 1,
            "step": 9,
            "prompt_id": pid,
            "sigma": sigma,
            "tv": tv,
            "evals": evals,
            "at_max": at_max,
        }

    replica_a = [[solve(prompt_ids[0], 0.3, 0.0195, 4)], [solve(prompt_ids[0], 0.3, 0.0195, 4)]]  # 2 workers
    replica_b = [[solve(prompt_ids[1], 2.0, 0.01, 2, at_max=True), solve(12345, 9.0, 0.5, 9)]]

    @ray.remote
    class Server:
        def __init__(self, per_worker) -> None:
            self.per_worker, self.calls = per_worker, []

        async def start(self) -> None:
            calls, per_worker = self.calls, self.per_worker

            class Engine:
                async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
                    calls.append((method, tuple(args)))
                    await asyncio.sleep(0.01)  # a real await on the actor's loop
                    return per_worker

            async def forever():
                await asyncio.Event().wait()

            self.engine = Engine()
            self.engine.output_handler = asyncio.get_running_loop().create_task(forever())

        async def rpc_calls(self):
            return self.calls

        async def set_solves(self, per_worker) -> None:
            self.per_worker[:] = per_worker

    servers = [Server.remote(replica_a), Server.remote([[]])]  # replica b: its prompt not solved yet
    ray.get([s.start.remote() for s in servers])

    trainer = ncw.NCGRPOTrainerSync.__new__(ncw.NCGRPOTrainerSync)
    trainer.config, trainer.global_steps = config, 9
    trainer.llm_server_manager = SimpleNamespace(server_handles=servers)
    slept = []
    monkeypatch.setattr(PPOTrainerSync, "on_sample_end", lambda self: slept.append(len(self._nc_solves[9])))
    monkeypatch.setattr(PPOTrainerSync, "_compute_metrics", lambda self, b, m, *a: m.update(x=1.0))
    trainer.on_sample_end()
    assert slept == [2]  # read before verl's on_sample_end (the replicas' sleep)
    ray.get(servers[1].set_solves.remote(replica_b))  # (a later part of the step: parameter_sync_step > 1)
    trainer.on_sample_end()
    assert slept == [2, 4]
    keys = sorted(setup.tq.rows)
    batch = tq.KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys))
    metrics: dict = {}
    trainer._compute_metrics(batch, metrics, {}, 9, 0)
    calls = ray.get([s.rpc_calls.remote() for s in servers])
    assert calls == [[(ncw.TARGET_SOLVES_RPC, (1, 9))] * 2] * 2  # per sample, per server, (noise_seed, step)
    assert metrics["x"] == 1.0 and metrics["reward/clean"] == 1.0
    assert metrics["noise/target_marginal_tv"] == pytest.approx(0.02 * sigma_schedule(9, 60, 1.0))
    assert metrics["noise/sigma_k"] == pytest.approx(1.15)  # each prompt once; 12345 is not the batch's
    assert (metrics["noise/sigma_k_min"], metrics["noise/sigma_k_max"]) == (
        pytest.approx(0.3),
        pytest.approx(2.0),
    )
    assert metrics["noise/target_achieved_tv"] == pytest.approx((0.0195 + 0.01) / 2)
    assert metrics["noise/target_solver_evals"] == pytest.approx(3.0)
    assert metrics["noise/sigma_at_max"] == pytest.approx(0.5)
    # a prompt missing from what was read at on_sample_end: the metrics read again
    trainer._nc_solves = {9: [s for s in trainer._nc_solves[9] if s["prompt_id"] != prompt_ids[1]]}
    again: dict = {}
    trainer._compute_metrics(batch, again, {}, 9, 0)
    assert len(ray.get(servers[0].rpc_calls.remote())) == 3 and again == metrics


# --------------------------------------------------------------------------------------------------
# the manager, the task runner, the trainer registry
# --------------------------------------------------------------------------------------------------
def test_the_manager_checks_the_config_and_starts_ncgrpo_workers(model_dir):
    config = verl_config(model_dir)
    manager = ncw.NCGRPOAgentLoopManager(config, llm_client=None)
    assert manager.agent_loop_workers_class.__ray_actor_class__ is ncw.NCGRPOAgentLoopWorker
    with pytest.raises(ValueError, match="reweight or drop"):
        ncw.NCGRPOAgentLoopManager(
            verl_config(model_dir, "algorithm.rollout_correction.rollout_is=sequence"), llm_client=None
        )
    with pytest.raises(ValueError, match="resume"):
        ncw.NCGRPOAgentLoopManager(
            verl_config(model_dir, "trainer.v1.trainer_mode=colocate_async"), llm_client=None
        )


def test_the_task_runner_trains_with_the_ncgrpo_trainer_and_manager(model_dir, monkeypatch):
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_actor_class__
    seen = {}
    monkeypatch.setattr(base, "run", lambda self, config: seen.update(trainer=get_trainer_cls("sync")))
    monkeypatch.setattr(
        base,
        "init_agent_loop_manager",
        lambda self: seen.update(
            manager=self.config.actor_rollout_ref.rollout.agent.agent_loop_manager_class
        ),
    )
    runner = ncw.NCGRPOTaskRunner.__ray_actor_class__()
    runner.run(verl_config(model_dir))
    assert seen["trainer"] is ncw.NCGRPOTrainerSync
    assert get_trainer_cls("sync") is not ncw.NCGRPOTrainerSync  # restored after the run
    runner.config = verl_config(model_dir)
    runner.init_agent_loop_manager()
    assert seen["manager"] == ncw.MANAGER_FQN  # unset: NC-GRPO's manager
    runner.config = verl_config(
        model_dir,
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl.trainer.ppo.v1.AgentLoopManagerTQ",
    )
    with pytest.raises(ValueError, match="would be clean"):
        runner.init_agent_loop_manager()
    with pytest.raises(ValueError, match="reweight or drop"):
        runner.run(verl_config(model_dir, "algorithm.rollout_correction.rollout_rs=seq_mean_k3"))


# --------------------------------------------------------------------------------------------------
# the vLLM plugin chained with verl's compute_logits patch, in both orders
# --------------------------------------------------------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self, d=8, v=10) -> None:
        super().__init__()
        self.w = torch.randn(d, v, generator=torch.Generator().manual_seed(0))

    def compute_logits(self, h):
        return h @ self.w


@pytest.mark.parametrize("order", ["verl_first", "plugin_first"])
def test_the_plugin_chains_with_verls_compute_logits_patch(order):
    from verl.workers.rollout.vllm_rollout.utils import monkey_patch_compute_logits

    from ncgrpo.core.noise import NoiseKey, RowNoise, perturb_rows
    from ncgrpo.engines.vllm import parse_noise_spec
    from ncgrpo.engines.vllm_worker import _ArmedLogits

    vocab, banned = 8, [3]  # verl masks the OOV tail (ids >= 8) and the vision placeholders
    spec = parse_noise_spec({EXTRA_ARGS_KEY: {"seed": 1, "step": 2, "prompt_id": 3, "draw": 0, "sigma": 1.0}})
    h = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    model = _Model()
    noisy_h, _ = perturb_rows(h[1][None, None], [RowNoise(1.0, NoiseKey(1, 2, 3, 0))])
    expected = torch.stack([h[0], noisy_h[0, 0]]) @ model.w
    expected[:, vocab:] = float("-inf")
    expected[:, banned] = float("-inf")
    if order == "verl_first":  # verl patches at server start; the plugin arms per step on top
        monkey_patch_compute_logits(model, vocab, banned)
        with _ArmedLogits(model, lambda hs: [(1, spec)]):
            out = model.compute_logits(h)
    else:  # a patch installed while the plugin's wrapper is in place wraps the wrapper
        with _ArmedLogits(model, lambda hs: [(1, spec)]):
            monkey_patch_compute_logits(model, vocab, banned)
            out = model.compute_logits(h)
    assert torch.equal(out, expected)
    clean = h @ model.w  # after the step: verl's mask still on, no noise
    clean[:, vocab:] = float("-inf")
    clean[:, banned] = float("-inf")
    assert torch.equal(model.compute_logits(h), clean)
    with _ArmedLogits(model, lambda hs: [(1, spec)]):  # and the next step perturbs again, under the mask
        assert torch.equal(model.compute_logits(h), expected)


# --------------------------------------------------------------------------------------------------
# the recipes: verl composes them, verl's own checks pass, and the protocol is recipes/base's
# --------------------------------------------------------------------------------------------------
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def compose_recipe(name: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(RECIPES / "verl"), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


@pytest.mark.parametrize("name", ["geo3k_qwen2_5_vl_7b_latent_sigma0.2", "geo3k_qwen2_5_vl_7b_vanilla"])
def test_the_verl_recipes_are_the_papers_protocol(name):
    import yaml
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    cfg = compose_recipe(name)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert not need_reference_policy(cfg) and not need_critic(
        cfg
    )  # KL off: no reference model; GRPO: no critic
    base = yaml.safe_load((RECIPES / "base" / "geo3k_qwen2_5_vl_7b.yaml").read_text())
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert rollout.n == base["num_generations"] == 12
    # TRL counts completions: rollout batch 6144 = 512 prompts x 12, update batch 1536 = 128 x 12
    per_step = base["per_device_train_batch_size"] * 8 * base["steps_per_generation"]
    per_update = base["per_device_train_batch_size"] * 8 * base["gradient_accumulation_steps"]
    assert (
        cfg.data.train_batch_size * rollout.n == per_step
        and actor.ppo_mini_batch_size * rollout.n == per_update
    )
    assert cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes == 8
    # 60 verl steps = 240 optimizer updates = recipes/base's max_steps
    assert (
        cfg.trainer.total_training_steps * (cfg.data.train_batch_size // actor.ppo_mini_batch_size)
        == base["max_steps"]
    )
    assert cfg.trainer.total_epochs * (2101 // cfg.data.train_batch_size) == cfg.trainer.total_training_steps
    assert actor.optim.lr == base["learning_rate"] and actor.optim.lr_scheduler_type == "constant"
    assert actor.optim.weight_decay == base["weight_decay"] and actor.optim.clip_grad == base["max_grad_norm"]
    assert (
        actor.clip_ratio_low == actor.clip_ratio_high == base["epsilon"]
        and actor.ppo_epochs == base["num_iterations"]
    )
    assert not actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward and base["beta"] == 0.0
    assert actor.entropy_coeff == 0 and actor.freeze_vision_tower and base["freeze_vision_tower"]
    assert rollout.temperature == base["temperature"] and rollout.top_p == base["top_p"]
    assert cfg.data.max_response_length == base["max_completion_length"]
    assert dict(cfg.data.mm_processor_kwargs) == {
        "min_pixels": base["min_pixels"],
        "max_pixels": base["max_pixels"],
    }
    assert (
        cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo
    )  # scale_rewards: group
    assert rollout.tensor_model_parallel_size == 4 and rollout.val_kwargs.temperature == 0
    if "vanilla" in name:
        assert cfg.get("ncgrpo") is None and not rollout.agent.get("agent_loop_manager_class")
        return
    nc = ncv.NCGRPOVerlConfig.from_verl_config(cfg)
    ncv.check_verl_config(cfg, nc)  # NC-GRPO's own refusals pass
    assert (nc.rollout_method, nc.sigma0, nc.sigma_schedule) == ("latent", 0.2, "sigmoid")
    assert (nc.schedule_gamma, nc.schedule_k_mid, nc.schedule_total_steps) == (30.0, 40.0, 60)
    assert nc.schedule_gamma == base["schedule_gamma"] and nc.schedule_k_mid == base["schedule_k_mid"]
    assert rollout.agent.agent_loop_manager_class == ncw.MANAGER_FQN
    assert (
        cfg.algorithm.rollout_correction.rollout_is is None
        and cfg.algorithm.rollout_correction.rollout_rs is None
    )
    with pytest.raises(ValueError, match="reweight or drop"):  # a user override is caught
        ncv.check_verl_config(compose_recipe(name, "algorithm.rollout_correction.rollout_is=token"))


def test_prepare_geo3k_writes_what_verls_dataset_reads(tmp_path):
    """recipes/verl/prepare_geo3k.py's parquet through verl's RLHFDataset: the prompt is ncgrpo's, the
    image arrives, verl's geo3k score grades the gold answer, and the prompt id is the TRL trainer's."""
    import importlib.util

    from omegaconf import OmegaConf
    from PIL import Image
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.reward_score import default_compute_score

    from ncgrpo.core.plan import prompt_id_for
    from ncgrpo.data.prompts import prompt_text
    from ncgrpo.data.types import Question
    from tiny_models import load_tiny, save_tiny_vl

    spec = importlib.util.spec_from_file_location("prepare_geo3k", RECIPES / "verl" / "prepare_geo3k.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    qs = [
        Question("geo3k", "7", "<image>Find x.", "3", images=[Image.new("RGB", (56, 56), (200, 10, 10))]),
        Question("geo3k", "8", "Find y.", "12", images=[Image.new("RGB", (56, 56), (10, 200, 10))]),
    ]
    path = prep.write(qs, "train", tmp_path)
    _, processor = load_tiny(save_tiny_vl(tmp_path / "vl"))
    data_cfg = OmegaConf.create({"max_prompt_length": 4096, "image_key": "images", "return_raw_chat": True})
    ds = RLHFDataset(
        data_files=[str(path)], tokenizer=processor.tokenizer, config=data_cfg, processor=processor
    )
    assert len(ds) == 2
    for q, i in zip(qs, range(2), strict=True):
        item = ds[i]
        (msg,) = item["raw_prompt"]
        parts = msg["content"]
        assert [p["type"] for p in parts] == ["image", "text"]
        assert parts[1]["text"] == prompt_text(q).replace("<image>", "")
        assert parts[0]["image"].size == (56, 56)
        assert item["extra_info"]["question_id"] == q.question_id
        assert ncv.verl_prompt_id(item) == prompt_id_for(question_id=q.question_id)  # the TRL path's id
        gold = item["reward_model"]["ground_truth"]
        assert (
            default_compute_score(item["data_source"], "<think>x</think> \\boxed{" + q.answer + "}", gold)
            == 1.0
        )
        assert default_compute_score(item["data_source"], "\\boxed{" + q.answer + "}", gold) == pytest.approx(
            0.9
        )


def test_main_ppo_is_verls_main_with_the_ncgrpo_task_runner(monkeypatch):
    import verl.trainer.main_ppo as verl_main

    from ncgrpo.integrations.verl import main_ppo

    seen = []
    monkeypatch.setattr(verl_main, "TaskRunnerV1", verl_main.TaskRunnerV1)  # restored after the test
    monkeypatch.setattr(verl_main, "main", lambda: seen.append(verl_main.TaskRunnerV1))
    main_ppo.main()
    assert seen == [ncw.NCGRPOTaskRunner]


def test_the_launch_line_composes_the_recipe_through_verls_hydra_main(tmp_path):
    """The documented launch line, with Hydra's --cfg job (print the composed config, run nothing)."""
    import subprocess
    import sys

    import yaml

    cmd = [
        sys.executable,
        "-m",
        "ncgrpo.integrations.verl.main_ppo",
        "--config-path",
        str(RECIPES / "verl"),
        "--config-name",
        "geo3k_qwen2_5_vl_7b_latent_sigma0.2",
        "ncgrpo.sigma0=0.3",
        "--cfg",
        "job",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load(out.stdout[out.stdout.index("actor_rollout_ref:") :])
    assert cfg["ncgrpo"]["sigma0"] == 0.3 and cfg["actor_rollout_ref"]["rollout"]["n"] == 12
    assert cfg["actor_rollout_ref"]["rollout"]["agent"]["agent_loop_manager_class"] == ncw.MANAGER_FQN
