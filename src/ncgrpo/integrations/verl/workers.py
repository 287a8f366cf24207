"""NC-GRPO's verl classes (this module imports verl 0.9.1 and Ray; only verl users import it).

- :class:`NCGRPOAgentLoopWorker`: verl's v1 agent-loop worker (``AgentLoopWorkerTQ``) whose sessions
  ``n .. G-1`` of each training prompt send the vLLM plugin's noise spec with their first request
  (:func:`ncgrpo.integrations.verl.config.plan_session`); validation and later turns are clean. Each
  row's plan goes into verl's ``extra_fields["ncgrpo"]``.
- :class:`NCGRPOAgentLoopManager`: verl's ``AgentLoopManagerTQ`` starting those workers; name it in
  ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``.
- :class:`NCGRPOTrainerSync`: verl's sync trainer plus the per-half metrics (``reward/clean``,
  ``reward/noisy``, ``reward/contrast``, ``noise/sigma_k``) in verl's metrics, and under
  ``target_marginal_tv`` the per-prompt sigmas the vLLM plugin solved, read back from verl's vLLM servers
  (:func:`read_target_solves`; ``noise/sigma_k`` / ``_min`` / ``_max``, ``noise/target_*``, ``noise/sigma_at_max``).
- :data:`NCGRPOTaskRunner`: verl's ``TaskRunnerV1`` that trains with those two (the entry point
  :mod:`ncgrpo.integrations.verl.main_ppo` runs verl's ``main_ppo`` with it).

Where verl's code is extended (verl 0.9.1; docs/verl.md lists the lines):
``AgentLoopWorkerTQ._run_prompt`` starts ``rollout.n`` sessions of one prompt, each through
``AgentLoopWorker._run_agent_loop(sampling_params, trajectory, session_id=i, **prompt)``, which runs the
agent loop; the loop calls ``self.llm_client.generate(..., sampling_params=...)`` once per turn and
``vLLMHttpServer.generate`` builds ``SamplingParams(**sampling_params)``, ``extra_args`` included.
The worker's client is wrapped (:class:`FirstRequestNoiseClient`) so that the first request of a
session carries that session's spec; the session is found through a context variable set in
``_run_agent_loop`` (each session is its own asyncio task, so sessions cannot see each other's).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Mapping
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import open_dict
from verl.trainer.main_ppo import TaskRunnerV1
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.import_utils import load_class_from_fqn
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

from ncgrpo.engines.vllm import TARGET_SOLVES_RPC
from ncgrpo.integrations.verl.config import (
    NCGRPOVerlConfig,
    SessionNoise,
    check_verl_config,
    half_metrics,
    plan_session,
    target_metrics,
    verl_prompt_id,
    with_noise,
)

__all__ = [
    "FirstRequestNoiseClient",
    "NCGRPOAgentLoopManager",
    "NCGRPOAgentLoopWorker",
    "NCGRPOTaskRunner",
    "NCGRPOTrainerSync",
    "read_target_solves",
]

logger = logging.getLogger(__name__)
MANAGER_FQN = "ncgrpo.integrations.verl.NCGRPOAgentLoopManager"


class _Session:
    """The running session's noise and how many requests it has sent so far."""

    __slots__ = ("noise", "requests")

    def __init__(self, noise: SessionNoise) -> None:
        self.noise = noise
        self.requests = 0


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar(
    "ncgrpo_verl_session", default=None
)


class FirstRequestNoiseClient:
    """verl's ``LLMServerClient`` with the running session's spec merged into its FIRST request.

    The noise is a branch-point intervention (section 3.1): one perturbed first-token row per rollout.
    A multi-turn agent loop reuses one ``sampling_params`` dict for every turn; each turn is a new vLLM
    request with its own prefill, so passing the spec every turn would perturb each turn's first token.
    Everything else is the wrapped client's (attribute reads and writes go through).
    """

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    async def generate(self, request_id, *, sampling_params: dict[str, Any], **kwargs: Any):
        session = _SESSION.get()
        if session is not None:
            if session.requests == 0 and session.noise.extra_args:
                sampling_params = with_noise(sampling_params, session.noise.extra_args)
            session.requests += 1
        return await self._inner.generate(request_id, sampling_params=sampling_params, **kwargs)


class NCGRPOAgentLoopWorker(AgentLoopWorkerTQ.__ray_actor_class__):
    """verl 0.9.1's ``AgentLoopWorkerTQ`` (the class under its ``@ray.remote``) with NC-GRPO's rollouts.

    Per training prompt: its id (:func:`~ncgrpo.integrations.verl.config.verl_prompt_id`, once per
    prompt) and group size ``G`` (verl's ``__rollout_n__`` override or ``rollout.n``); per session
    ``i``: :func:`~ncgrpo.integrations.verl.config.plan_session` at ``k = trajectory["step"]``
    (verl's ``global_steps``).
    """

    def __init__(self, config, llm_client, *args, **kwargs) -> None:
        if isinstance(llm_client, FullyAsyncLLMServerClient):
            raise ValueError(
                "NC-GRPO on verl needs trainer.v1.trainer_mode=sync: the fully-async client resumes an interrupted "
                "request as prompt + partial response, whose first token the plugin would perturb again"
            )
        self.ncgrpo = NCGRPOVerlConfig.from_verl_config(config)
        self._nc_groups: dict[Any, tuple[int, int]] = {}  # uid -> (prompt id, G) while its sessions run
        super().__init__(config, FirstRequestNoiseClient(llm_client), *args, **kwargs)

    async def _run_prompt(
        self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False
    ) -> None:
        validate = bool(trajectory["validate"])
        uid = prompt["uid"]
        if not validate and self.ncgrpo.method.two_pass:
            rollout = self.config.actor_rollout_ref.rollout
            G = int(prompt.get("__rollout_n__", rollout.n))  # as verl's _run_prompt picks it
            self._nc_groups[uid] = (verl_prompt_id(prompt), G)
        try:
            await super()._run_prompt(prompt, sampling_params, trajectory, trace=trace)
        finally:
            self._nc_groups.pop(uid, None)

    def _nc_session(
        self, sampling_params: Mapping[str, Any], trajectory: Mapping[str, Any], kwargs
    ) -> SessionNoise:
        step, validate = int(trajectory["step"]), bool(trajectory["validate"])
        group = self._nc_groups.get(kwargs.get("uid"))
        if validate or group is None:
            return SessionNoise(step, int(kwargs.get("session_id", 0)))
        prompt_id, G = group
        return plan_session(
            self.ncgrpo,
            step=step,
            prompt_id=prompt_id,
            session_id=int(kwargs["session_id"]),
            group_size=G,
            temperature=float(sampling_params.get("temperature", 1.0)),
        )

    async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
        token = _SESSION.set(_Session(self._nc_session(sampling_params, trajectory, kwargs)))
        try:
            return await super()._run_agent_loop(
                sampling_params, trajectory, agent_name=agent_name, trace=trace, **kwargs
            )
        finally:
            _SESSION.reset(token)

    async def _agent_loop_postprocess(self, output, validate, **kwargs) -> None:
        session = _SESSION.get()
        if session is not None:
            record = dict(session.noise.provenance(), requests=session.requests)
            for out in output if isinstance(output, list) else [output]:
                out.extra_fields["ncgrpo"] = record
        return await super()._agent_loop_postprocess(output, validate, **kwargs)


class NCGRPOAgentLoopManager(AgentLoopManagerTQ):
    """verl 0.9.1's ``AgentLoopManagerTQ`` starting :class:`NCGRPOAgentLoopWorker` s.

    ``actor_rollout_ref.rollout.agent.agent_loop_manager_class=ncgrpo.integrations.verl.NCGRPOAgentLoopManager``.
    The config is checked here, before any worker starts (:func:`~ncgrpo.integrations.verl.config.check_verl_config`).
    """

    def __init__(self, config, *args, **kwargs) -> None:
        self.ncgrpo = NCGRPOVerlConfig.from_verl_config(config)
        check_verl_config(config, self.ncgrpo)
        super().__init__(config, *args, **kwargs)
        self.agent_loop_workers_class = ray.remote(NCGRPOAgentLoopWorker)


# --------------------------------------------------------------------------------------------------
# the target schedule's read-back: the per-prompt sigmas the plugin solved, from verl's vLLM servers
# --------------------------------------------------------------------------------------------------


def _server_target_solves(server, method: str, seed: int, step: int, timeout: float) -> list[dict[str, Any]]:
    """Runs inside one of verl's ``vLLMHttpServer`` actors (Ray's ``__ray_call__``): the engine workers'
    solves of ``(seed, step)`` (``method``: the plugin's :data:`~ncgrpo.engines.vllm.TARGET_SOLVES_RPC`),
    flattened over the workers.

    verl's own ``vLLMHttpServer.collective_rpc`` awaits the engine's ``collective_rpc`` but drops its
    result (verl 0.9.1), so the call is made here on the server's ``AsyncLLM`` (``server.engine``). Ray runs
    ``__ray_call__`` on the actor's task thread, not on its event loop, so the coroutine is handed to that
    loop (the one the engine's output handler runs on) and waited for here."""
    engine = server.engine
    handler = getattr(engine, "output_handler", None)
    if handler is None:
        raise RuntimeError(
            "the vLLM engine of this verl server has no running output handler (it was not started in the "
            "server's event loop, or has stopped); cannot read back the target schedule's solves"
        )
    loop = handler.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError("_server_target_solves runs off the server's event loop (it waits on that loop)")
    coro = engine.collective_rpc(method, timeout=timeout, args=(int(seed), int(step)))
    per_worker = asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)
    return [dict(s) for solves in per_worker for s in (solves or [])]


def read_target_solves(
    server_handles, seed: int, step: int, *, timeout: float = 120.0
) -> list[dict[str, Any]]:
    """The vLLM plugin's per-prompt solves of ``(seed, step)`` from every verl vLLM server (the Ray handles
    of verl's ``LLMServerManager.server_handles``: one per replica, whose engine reaches all its workers), as
    one list (a prompt whose sessions reached several replicas, or solved on every tensor-parallel rank,
    appears once per worker; :func:`~ncgrpo.integrations.verl.config.target_metrics` counts it once)."""
    refs = [
        h.__ray_call__.remote(_server_target_solves, TARGET_SOLVES_RPC, int(seed), int(step), float(timeout))
        for h in server_handles
    ]
    return [s for part in ray.get(refs, timeout=timeout) for s in part]


def _final_rows(keys: list[str]) -> list[int]:
    """Row of each session's last output (verl's keys are ``{uid}_{session_id}_{index}``)."""
    last: dict[str, tuple[int, int]] = {}
    for i, key in enumerate(keys):
        session, index = key.rsplit("_", 1)
        if session not in last or last[session][0] < int(index):
            last[session] = (int(index), i)
    return sorted(i for _, i in last.values())


class NCGRPOTrainerSync(PPOTrainerSync):
    """verl 0.9.1's sync trainer plus NC-GRPO's per-half metrics in its metrics dict.

    Same training as ``PPOTrainerSync`` (it is registered under verl's ``"sync"`` name by
    :data:`NCGRPOTaskRunner`, so verl's ``trainer_mode == "sync"`` branches all hold).
    """

    @property
    def _nc(self) -> NCGRPOVerlConfig:
        cfg = self.__dict__.get("_nc_cfg")
        if cfg is None:
            cfg = self.__dict__["_nc_cfg"] = NCGRPOVerlConfig.from_verl_config(self.config)
        return cfg

    def on_sample_end(self):
        """Read the step's per-prompt solves back before verl's ``on_sample_end`` puts the replicas to sleep
        (the rollouts sampled so far are done: ``replay_buffer.sample`` returned them)."""
        self._nc_read_solves(int(self.global_steps))
        super().on_sample_end()

    def _nc_read_solves(self, step: int) -> list[dict[str, Any]]:
        """The solves of ``step`` on every server, kept for the step's metrics (one step at a time)."""
        cfg = self._nc
        if cfg.target_marginal_tv is None or not cfg.method.two_pass or not cfg.target_at(step) > 0:
            return []
        solves = read_target_solves(self.llm_server_manager.server_handles, cfg.noise_seed, step)
        self.__dict__["_nc_solves"] = {step: solves}
        return solves

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        metrics.update(self._ncgrpo_metrics(batch))

    def _ncgrpo_metrics(self, batch) -> dict[str, float]:
        """:func:`~ncgrpo.integrations.verl.config.half_metrics` of this step's rows, one per session."""

        keep = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        keys = [batch.keys[i] for i in keep]
        if not keys:
            return {}
        data = tq.kv_batch_get(
            keys=keys, partition_id=batch.partition_id, select_fields=["uid", "rm_scores", "extra_fields"]
        )
        scores = data["rm_scores"]
        scores = torch.nested.to_padded_tensor(scores, 0.0) if scores.is_nested else scores
        rewards = scores.float().sum(-1)  # [N]: verl's sequence score (token_level_scores.sum(-1))
        uids = list(data["uid"].tolist() if hasattr(data["uid"], "tolist") else data["uid"])
        extra = list(
            data["extra_fields"].tolist() if hasattr(data["extra_fields"], "tolist") else data["extra_fields"]
        )
        rows = [i for i in _final_rows(keys) if isinstance(extra[i], Mapping) and "ncgrpo" in extra[i]]
        if not rows:
            return {}
        plans = [extra[i]["ncgrpo"] for i in rows]
        out = half_metrics(
            rewards[rows],
            [uids[i] for i in rows],
            [p["noisy"] for p in plans],
            [p["sigma"] for p in plans],
            norm_by_std=bool(self.config.algorithm.get("norm_adv_by_std_in_grpo", True)),
        )
        targeted = [p for p in plans if p["noisy"] and p.get("target") is not None]
        if targeted:
            out.update(self._nc_target_metrics(targeted))
        return out

    def _nc_target_metrics(self, plans: list[Mapping[str, Any]]) -> dict[str, float]:
        """:func:`~ncgrpo.integrations.verl.config.target_metrics` of the step's noisy prompts, from the
        solves read back from the servers (at ``on_sample_end``; read again here if a prompt is missing)."""
        step, target = int(plans[0]["step"]), float(plans[0]["target"])
        prompts = {int(p["prompt_id"]) for p in plans}
        solves: list[dict[str, Any]] = []
        if target > 0:
            solves = self.__dict__.get("_nc_solves", {}).get(step)
            if solves is None or not prompts <= {int(s["prompt_id"]) for s in solves}:
                solves = self._nc_read_solves(step)
        return target_metrics(solves, target=target, step=step, prompt_ids=sorted(prompts))


class _NCGRPOTaskRunner(TaskRunnerV1.__ray_actor_class__):
    """verl 0.9.1's ``TaskRunnerV1`` training with :class:`NCGRPOTrainerSync` and :class:`NCGRPOAgentLoopManager`."""

    def run(self, config) -> None:
        check_verl_config(config)
        registry = trainer_base.TRAINER_REGISTRY
        previous = registry.get("sync")
        registry["sync"] = NCGRPOTrainerSync  # verl's trainer_mode string stays "sync" (its branches test it)
        try:
            super().run(config)
        finally:
            registry["sync"] = previous

    def init_agent_loop_manager(self) -> None:
        agent = self.config.actor_rollout_ref.rollout.agent
        fqn = agent.get("agent_loop_manager_class")
        if not fqn:
            with open_dict(agent):
                agent.agent_loop_manager_class = MANAGER_FQN
        else:
            cls = load_class_from_fqn(fqn, "AgentLoopManager")
            if not (isinstance(cls, type) and issubclass(cls, NCGRPOAgentLoopManager)):
                raise ValueError(
                    f"actor_rollout_ref.rollout.agent.agent_loop_manager_class={fqn!r} is not NC-GRPO's: its rollouts "
                    f"would be clean. Use {MANAGER_FQN} (or a subclass)"
                )
        super().init_agent_loop_manager()


NCGRPOTaskRunner = ray.remote(_NCGRPOTaskRunner)
