"""The vLLM plugin's in-engine target solve (a spec's ``"target"``), without vLLM: the schema and its
refusals, and the worker's solve on a stand-in model with vLLM's layout (a vocabulary-padded LM head, a
``LogitsProcessor``-like ``org_vocab_size``). The real engine runs it in tests/engines/test_vllm.py and
tests/engines/test_vllm_vlm.py (marker ``vllm``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ncgrpo.core.marginal import MarginalCurve, marginal_keys
from ncgrpo.core.noise import NoiseKey, RowNoise, perturb_selected
from ncgrpo.core.prompt_solve import curve_tv_at
from ncgrpo.engines import vllm_solve
from ncgrpo.engines.vllm import (
    EXTRA_ARGS_KEY,
    check_spec_for_engine,
    noise_extra_args,
    parse_noise_spec,
    server_extra_args,
    target_solve_problem,
    target_spec,
)
from ncgrpo.engines.vllm_solve import _target_solves
from ncgrpo.engines.vllm_worker import _ArmedLogits

D, V, PAD = 16, 40, 24  # vLLM pads the head's rows to a multiple of 64


def spec(prompt_id=5, draw=0, sign=1.0, tv=0.05, **kw):
    t = target_spec(tv, draws=32, temperature=1.0, start=0.2, sigma_max=10.0, **kw)
    return noise_extra_args(RowNoise(0.0, NoiseKey(7, 3, prompt_id, draw), sign), target=t)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"tv": 0.0}, r"\['tv'\] must be a total-variation distance in \(0, 1\]"),
        ({"tv": 1.5}, r"\['tv'\]"),
        ({"draws": 3}, r"\['draws'\] must be an even int"),
        ({"draws": 1 << 20}, r"\['draws'\] must be an even int in \[2, 1024\]"),
        ({"temperature": -1.0}, r"\['temperature'\]"),
        ({"start": float("nan")}, r"\['start'\]"),
        ({"sigma_max": 0}, r"\['sigma_max'\]"),
        ({"mode": "gaussian"}, r"\['mode'\] must be one of"),
        ({"rtol": 1.0}, r"\['rtol'\]"),
        ({"tvv": 0.1}, "unknown fields"),
    ],
)
def test_bad_targets_are_refused_naming_the_field(bad, match):
    s = spec()[EXTRA_ARGS_KEY]
    s["target"] = {**s["target"], **bad}
    with pytest.raises(ValueError, match=match):
        parse_noise_spec({EXTRA_ARGS_KEY: s})


def test_target_schema_round_trip_and_what_it_needs():
    parsed = parse_noise_spec(spec())
    assert parsed.noisy and not parsed.row.noisy and parsed.target.tv == 0.05 and parsed.target.rtol == 0.02
    s = spec()[EXTRA_ARGS_KEY]
    del s["sigma"]  # ignored with a target: may be omitted
    assert parse_noise_spec({EXTRA_ARGS_KEY: s}).target.draws == 32
    missing = {k: v for k, v in s["target"].items() if k != "draws"}
    with pytest.raises(ValueError, match=r"lacks \['draws'\]"):
        parse_noise_spec({EXTRA_ARGS_KEY: {**s, "target": missing}})
    with pytest.raises(ValueError, match="must be a dict"):
        parse_noise_spec({EXTRA_ARGS_KEY: {**s, "target": 0.05}})
    with pytest.raises(ValueError, match="needs the noise key"):
        parse_noise_spec({EXTRA_ARGS_KEY: {"target": s["target"]}})
    with pytest.raises(ValueError, match="clean rows carry none"):
        noise_extra_args(RowNoise(), target=s["target"])
    # the server form is the same spec, JSON-encoded
    server = server_extra_args(RowNoise(0.0, NoiseKey(7, 3, 5, 0)), target=s["target"])
    assert parse_noise_spec(server).target.key() == parse_noise_spec(spec()).target.key()


def _config(tp=1, **text):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(
            quantization=None, hf_text_config=SimpleNamespace(**text), get_hidden_size=lambda: D
        ),
    )


def test_engines_that_cannot_solve_refuse_target_requests_where_admitted():
    assert target_solve_problem(_config()) is None
    check_spec_for_engine(parse_noise_spec(spec()), _config())
    for cfg, match in [
        (_config(tp=2), "tensor_parallel_size=2 shards the LM head's vocabulary"),
        (_config(final_logit_softcapping=30.0), "soft-caps"),
        (_config(logit_scale=0.5), "scales its logits"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_spec_for_engine(parse_noise_spec(spec()), cfg)
        check_spec_for_engine(parse_noise_spec(noise_extra_args(RowNoise(0.5, NoiseKey(7, 3, 5, 0)))), cfg)


class Model(nn.Module):
    """vLLM's layout: ``lm_head.weight`` padded past the vocabulary, ``logits_processor.org_vocab_size``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Module()
        self.lm_head.weight = nn.Parameter(torch.randn(V + PAD, D) * 2.0, requires_grad=False)
        self.lm_head.tp_size = 1
        self.logits_processor = SimpleNamespace(org_vocab_size=V, head_dtype=None, soft_cap=None, scale=1.0)

    def compute_logits(self, h):
        return (h @ self.lm_head.weight.T)[:, :V]


def test_the_worker_solves_each_prompt_once_per_step_and_perturbs_at_its_sigma(monkeypatch):
    monkeypatch.setattr(vllm_solve, "_SOLVES", type(vllm_solve._SOLVES)())
    model = Model()
    torch.manual_seed(1)
    hs = torch.randn(4, D) * 3
    W = model.lm_head.weight[:V]
    head = nn.Linear(D, V, bias=False)  # the transformers model's lm_head: the unpadded rows
    head.weight = nn.Parameter(W.clone(), requires_grad=False)
    a0, a1, b0, clean = (parse_noise_spec(x) for x in (spec(5, 0), spec(5, 1, -1.0), spec(9, 0), {}))
    clean_spec = parse_noise_spec(noise_extra_args(RowNoise(0.7, NoiseKey(7, 3, 11, 0))))  # a plain sigma
    # engine step 1: prompt 5's first request and prompt 9's; step 2: prompt 5's second request, on another
    # state (it must still get the sigma solved at step 1: one sigma per prompt and step)
    with _ArmedLogits(model, lambda h: [(0, a0), (1, b0), (3, clean_spec)]):
        out1 = model.compute_logits(hs)
    with _ArmedLogits(model, lambda h: [(2, a1)]):
        out2 = model.compute_logits(hs)
    solves = {s["prompt_id"]: s for s in _target_solves(None, "7", "3")}  # the HTTP RPC passes strings
    assert set(solves) == {5, 9} and _target_solves(None, 7, 4) == []
    assert all(s["error"] is None and s["target_tv"] == 0.05 and s["evals"] >= 1 for s in solves.values())
    for pid, row in [(5, 0), (9, 1)]:
        # the transformers-side estimate on the same clean state: the target within the solver's tolerance
        curve = MarginalCurve(
            head, hs[row : row + 1], head(hs[row : row + 1]),
            marginal_keys(7, 3, pid, 16), temperature=1.0, mode="independent",
        )  # fmt: skip
        tv = curve_tv_at(curve, {0: solves[pid]["sigma"]})[0]
        assert tv == pytest.approx(solves[pid]["tv"], rel=1e-5)
        assert abs(tv - 0.05) <= 0.02 * 0.05 + 1e-6, (pid, tv)
    assert solves[5]["sigma"] != solves[9]["sigma"]

    def expected(i, s, sigma):
        return perturb_selected(hs[i : i + 1], [(RowNoise(sigma, s.row.key, s.row.sign), [0])])[0] @ W.T

    assert torch.allclose(out1[0], expected(0, a0, solves[5]["sigma"]), atol=1e-5)
    assert torch.allclose(out1[1], expected(1, b0, solves[9]["sigma"]), atol=1e-5)
    assert torch.allclose(out1[3], expected(3, clean_spec, 0.7), atol=1e-5)  # a plain sigma row: its own
    assert torch.equal(out1[2], model.compute_logits(hs)[2])  # not in the plan: untouched
    assert torch.allclose(out2[2], expected(2, a1, solves[5]["sigma"]), atol=1e-5)  # cached: step 1's sigma
    assert clean is None


def test_a_solve_the_worker_cannot_do_is_recorded_and_its_row_left_clean(monkeypatch):
    monkeypatch.setattr(vllm_solve, "_SOLVES", type(vllm_solve._SOLVES)())
    model = Model()
    model.lm_head.tp_size = 2  # a sharded vocabulary (refused where admitted; here the worker's own guard)
    hs = torch.randn(1, D)
    with _ArmedLogits(model, lambda h: [(0, parse_noise_spec(spec()))]):
        out = model.compute_logits(hs)  # does not raise: an exception here would stop the engine
    assert torch.equal(out, model.compute_logits(hs))
    (entry,) = _target_solves(None, 7, 3)
    assert "sharded over 2 tensor-parallel ranks" in entry["error"] and entry["sigma"] == 0.0


def test_old_steps_are_dropped(monkeypatch):
    monkeypatch.setattr(vllm_solve, "_SOLVES", type(vllm_solve._SOLVES)())
    model = Model()
    hs = torch.randn(1, D)
    for step in range(vllm_solve.SOLVE_STEPS_KEPT + 3):
        s = spec()[EXTRA_ARGS_KEY]
        with _ArmedLogits(
            model, lambda h, s=s, step=step: [(0, parse_noise_spec({EXTRA_ARGS_KEY: {**s, "step": step}}))]
        ):
            model.compute_logits(hs)
    assert len(vllm_solve._SOLVES) == vllm_solve.SOLVE_STEPS_KEPT
    assert (
        _target_solves(None, 7, 0) == []
        and len(_target_solves(None, 7, vllm_solve.SOLVE_STEPS_KEPT + 2)) == 1
    )
