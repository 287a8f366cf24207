"""NC-GRPO through vLLM's OpenAI-compatible server, as TRL's server mode runs it (marker ``vllm``; run in
.venv-vllm): one real server process for the module, started with ``trl vllm-serve``'s own command line
(``trl.scripts.vllm_serve.build_command``: its flags and ``VLLM_SERVER_DEV_MODE=1``) except the entry
point: ``python -m vllm.entrypoints.cli.main serve`` dies on vllm-cpu before parsing its arguments
(``importlib.metadata.version("vllm")``: the distribution is called ``vllm-cpu``), so the same arguments
go to ``python -m vllm.entrypoints.openai.api_server``.

- the per-spec requests (``generate_rows_on_server`` through TRL's own ``VLLMClient``) give every row
  the first-token logprobs and greedy tokens an offline ``LLM`` gives the same rows (same keys);
- an ``NCGRPOTrainer`` step in ``vllm_mode="server"``: the server perturbs exactly the noisy rows, the
  trainer logs the branch point and excludes the noisy rows from TRL's importance-sampling correction.
  TRL's weight sync in server mode goes through NCCL (``VLLMClient.init_communicator`` wants a CUDA
  device), which cannot run on a CPU: the test replaces ``init_communicator`` and ``sync_weights`` by
  no-ops and trains ONE step, generated before any update, when the server still holds the very
  checkpoint the trainer loaded (so nothing needed syncing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


from ncgrpo.core.plan import plan_rows  # noqa: E402
from ncgrpo.engines.vllm import (  # noqa: E402
    check_server_plugin_active,
    generate_rows_on_server,
    sampling_params_for_rows,
)
from ncgrpo.methods import get_method  # noqa: E402
from ncgrpo.trainer import NCGRPOTrainer  # noqa: E402
from tiny_models import (  # noqa: E402
    free_port,
    save_peaked_vllm_text_model,
    vllm_trainer,
    vllm_trainer_config,
)

G = 4
TOPK = 8
ENGINE = dict(dtype="float32", max_model_len=256, enforce_eager=True)


def _server_command(model_dir: str, port: int) -> list[str]:
    """``trl vllm-serve``'s command line for this model, with the api_server entry point (see the docstring)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(
        ScriptArguments(
            model=model_dir,
            host="127.0.0.1",
            port=port,
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
        )
    )
    i = cmd.index("serve")
    assert cmd[i - 1] == "vllm.entrypoints.cli.main", cmd
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cmd[i + 1], *cmd[i + 2 :]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_peaked_vllm_text_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    path, _ = model_dir
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _server_command(path, port), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not come up in 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield base_url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _perturbed(base_url) -> int:
    return sum(s["perturbed_rows"] for s in check_server_plugin_active(base_url))


def test_per_spec_server_requests_equal_the_offline_engine(model_dir, server):
    """Antithetic rows with SPSA's steering vector: the first-token distribution (top-k logprobs) the server
    returns for every row equals an offline LLM's for the same specs, and the noisy rows are perturbed (they
    leave their clean partners). Sampled at T = 1 as in training (vLLM refuses greedy with n > 1, which TRL's
    and the clean half's grouped requests use); the tokens then come from different RNG streams."""
    from trl.generation.vllm_client import VLLMClient
    from vllm import LLM, SamplingParams

    path, _ = model_dir
    prompts = [list(range(40, 52)), list(range(100, 130))]
    plans = plan_rows(
        range(2 * G), [5] * G + [6] * G, num_generations=G, method=get_method("antithetic"), seed=3, step=2
    )
    rows = [get_method("antithetic").row_noise(p, 2.0) for p in plans]
    from transformers import AutoConfig

    mu = torch.linspace(-0.5, 0.5, AutoConfig.from_pretrained(path).hidden_size)  # SPSA's steering vector
    client = VLLMClient(base_url=server, connection_timeout=30)
    before = _perturbed(server)
    got = generate_rows_on_server(
        client.generate, prompts, G, rows, steer=mu, temperature=1.0, max_tokens=3, logprobs=TOPK
    )
    assert _perturbed(server) - before == sum(r.noisy for r in rows) == 4

    llm = LLM(model=path, seed=0, logprobs_mode="processed_logprobs", kv_cache_memory_bytes=1 << 20, **ENGINE)
    try:
        params = sampling_params_for_rows(
            SamplingParams(temperature=1.0, max_tokens=3, logprobs=TOPK), rows, steer=mu
        )
        ref = llm.generate(
            [{"prompt_token_ids": prompts[i // G]} for i in range(2 * G)], params, use_tqdm=False
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    first = []
    for i, out in enumerate(ref):
        o = out.outputs[0]
        assert 1 <= len(got["completion_ids"][i]) <= 3, i
        server_lp = dict(zip(got["logprob_token_ids"][i][0], got["logprobs"][i][0], strict=True))
        offline_lp = {t: lp.logprob for t, lp in o.logprobs[0].items()}
        common = server_lp.keys() & offline_lp.keys()
        assert len(common) >= TOPK, (server_lp, offline_lp)
        assert max(abs(server_lp[t] - offline_lp[t]) for t in common) < 1e-4, i
        first.append(offline_lp)
    for i, p in enumerate(plans):  # the noise moved every noisy row's first-token distribution
        if p.noisy:
            clean = first[(i // G) * G]
            assert max(abs(first[i].get(t, -1e9) - lp) for t, lp in clean.items()) > 1e-2, i


def test_a_bad_request_is_a_400_and_the_server_serves_on(model_dir, server):
    """A spec the workers could not apply (a steer of the wrong length for the hidden size) is refused by
    the server's own process, a 400 for that request; before, it reached the worker, which raised: the
    engine died and the server with it."""
    import json

    from ncgrpo.core.noise import NoiseKey, RowNoise
    from ncgrpo.engines.vllm import _post_json, server_extra_args

    path, _ = model_dir
    row = RowNoise(2.0, NoiseKey(1, 2, 3, 0))

    def complete(xargs):
        body = {
            "model": path,
            "prompt": list(range(40, 52)),
            "max_tokens": 2,
            "temperature": 0.0,
            "logprobs": 1,
        }
        return _post_json(f"{server}/v1/completions", {**body, "vllm_xargs": xargs}, timeout=120)

    code, text = complete(server_extra_args(row, steer=torch.zeros(7)))
    assert code == 400 and "has 7 values, but the model's hidden size is 128" in text, (code, text[:500])
    before = _perturbed(server)
    code, text = complete(server_extra_args(row))
    assert code == 200 and json.loads(text)["choices"][0]["text"] is not None, (code, text[:500])
    assert _perturbed(server) - before == 1


class _Recording(NCGRPOTrainer):
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


def _one_server_step(model_dir, server, tmp_path, monkeypatch, **settings):
    """A trainer of one step in server mode (latent, constant schedule, ``settings`` on top); NCCL weight
    transfer cannot run on a CPU, and one step generated before any update needs no sync."""
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    path, tok = model_dir
    monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, device=0: None)
    monkeypatch.setattr(VLLMGeneration, "sync_weights", lambda self: None)
    args = vllm_trainer_config(
        tmp_path, num_generations=G, max_steps=1, vllm_mode="server", vllm_server_base_url=server,
        rollout_method="latent", sigma_schedule="constant", **settings,
    )  # fmt: skip
    return vllm_trainer(_Recording, path, tok, args, n_prompts=2)


def test_trainer_step_in_server_mode(model_dir, server, tmp_path, monkeypatch):
    tr = _one_server_step(model_dir, server, tmp_path, monkeypatch, sigma0=8.0)
    tr.records = []
    assert tr.nc_vllm_status and all(s["patched"] for s in tr.nc_vllm_status)
    before = _perturbed(server)
    tr.train()
    assert _perturbed(server) - before == G // 2  # exactly the noisy half of the one group
    (rec,), (hist,) = tr.records, tr.nc_history
    noisy = torch.tensor([r[2] for r in hist.rows])
    assert noisy.tolist() == [False, False, True, True]
    diff = (rec["old_logps"] - rec["sampling_logps"]) * rec["mask"]  # trainer (clean) - server, per token
    # |trainer - server| on unperturbed tokens, float32 on both sides (oneDNN vs torch kernels, logits scaled
    # x20): measured <= 0.036; the noisy rows' first tokens are off by > 16 nats
    tol = 0.1
    assert diff[~noisy, 0].abs().max() < tol, diff[:, 0]
    assert diff[noisy, 0].abs().min() > 1.0, diff[:, 0]  # sampled from the perturbed logits
    assert diff[:, 1:].abs().max() < tol, diff  # later tokens decode from a clean KV cache
    assert torch.equal(rec["ratio"][noisy], torch.ones_like(rec["ratio"][noisy]))
    assert hist.metrics["noise/first_token_tv"] > 0.3 and hist.metrics["noise/sigma_k"] == pytest.approx(8.0)


@pytest.mark.parametrize("scope", ["batch", "prompt"])
def test_target_schedule_in_server_mode_sends_the_solved_sigma(
    model_dir, server, tmp_path, monkeypatch, scope
):
    """target_marginal_tv with a vLLM server. Batch scope: sigma_k is solved on the trainer's model (in its
    measurement pass) before the batch goes to the server, whose plugin perturbs the noisy half at it.
    Prompt scope: the server's workers solve the prompt's sigma and the trainer reads it back through
    ``/collective_rpc`` (``target_solves``). Either way the TV measured afterwards is the target's."""
    target = 0.05
    tr = _one_server_step(
        model_dir,
        server,
        tmp_path,
        monkeypatch,
        target_marginal_tv=target,
        sigma_max=10.0,
        target_scope=scope,
    )
    tr.records = []
    before = _perturbed(server)
    tr.train()
    assert _perturbed(server) - before == G // 2
    (hist,) = tr.nc_history
    m = hist.metrics
    assert m["noise/sigma_k"] == hist.sigma_k > 0
    assert abs(m["noise/target_achieved_tv"] - target) <= 0.02 * target, m
    assert abs(m["noise/first_token_marginal_tv"] - target) <= 0.1 * target, m
    if scope == "prompt":  # one prompt: its sigma is the mean, the min and the max
        assert m["noise/sigma_k_min"] == m["noise/sigma_k_max"] == pytest.approx(hist.sigma_k), m
