"""ncgrpo probe (first-token figures, common-random-number pairing, verdict), branch_prefix, and the
inert-noise warning, on constructed tiny models on the CPU."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from rich.console import Console

from ncgrpo.core.noise import RowNoise
from ncgrpo.data.types import Question
from ncgrpo.eval.probe import _inputs, _sample, probe
from ncgrpo.eval.probe_result import format_probe
from ncgrpo.rewards import format_ok, math_reward
from ncgrpo.trainer.inert import InertNoiseMonitor, InertNoiseWarning
from ncgrpo.trainer.prefix import prefix_completions, prefixed_chat_template, with_branch_prefix
from tiny_models import build_tokenizer, load_tiny_grpo, tiny_text_model

QUESTIONS = [
    Question("t", f"q{i}", f"What is {i} + {i}?", str(2 * i), answer_type="number", role="in_domain")
    for i in range(6)
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def live_model(tok):
    return tiny_text_model("qwen2", tokenizer=tok, hidden_size=64, num_attention_heads=4)


@pytest.fixture(scope="module")
def fixed_model(tok):
    """Every token, first included, is one fixed token with probability 1: logits = a constant bias."""
    m = tiny_text_model("qwen2", tokenizer=tok, hidden_size=64, num_attention_heads=4)
    V = m.lm_head.out_features
    head = torch.nn.Linear(m.lm_head.in_features, V, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-100.0)
        head.bias[tok.convert_tokens_to_ids("<think>")] = 100.0
    m.lm_head = head
    return m


def _probe(model, tok, sigmas, **kw):
    kw = {"rollouts": 4, "max_new_tokens": 6, "batch_size": 3, "progress": False, **kw}
    return probe(model, tok, QUESTIONS, sigmas, **kw)


def test_deterministic_first_token_is_inert(fixed_model, tok):
    r = _probe(fixed_model, tok, [0.2, 1.0])
    assert r.entropy < 1e-6 and r.top1 > 0.999999
    for row in r.rows:
        assert row.tv < 1e-6 and row.flip == 0.0 and row.changed == 0.0 and row.first_changed == 0.0
        assert row.marginal_tv < 1e-6 and row.marginal_kl < 1e-6
        assert row.rel > 0.1  # the noise was applied; it just has nothing to act on
        assert row.verdict.startswith("inert") and row.p_value == 1.0
    assert r.verdict.startswith("inert at sigma 0.2: noise-averaged first-token TV 0.0000")
    assert not r.live


def test_live_model_changes_rollouts_and_sigma_zero_changes_none(live_model, tok):
    r = _probe(live_model, tok, [0.0, 2.0])
    zero, big = r.rows
    # common random numbers: same sampler seed and layout, no noise -> every rollout identical
    assert zero.changed == 0.0 and zero.tv == 0.0 and zero.flip == 0.0 and zero.verdict.startswith("inert")
    assert zero.reward_clean == zero.reward_noisy
    assert r.entropy > 1.0  # a random model: a spread-out first token
    assert big.tv > 0.05 and big.changed > 0.02 and not big.verdict.startswith("inert")
    assert "sigma 2" in r.verdict and "sigma 0:" not in r.verdict
    assert big.n_rollouts == len(QUESTIONS) * 4
    # the mixture moves less than one draw does
    assert 0 < big.marginal_tv < big.tv and big.marginal_tv_se < 0.25 * big.marginal_tv
    assert len(big.per_prompt) == len(QUESTIONS) and big.per_prompt[0]["question_id"] == "q0"
    # the matched control: no noise -> the sampling temperature; noise -> a hotter first token, and the
    # per-draw calibration hotter still
    assert (
        zero.matched_temperature == 1.0 and 1.0 < big.matched_temperature < big.matched_temperature_per_draw
    )
    assert 0.5 < big.equivalent_temperature < 2.0  # model-dependent: a mixture need not be hotter


def test_common_random_numbers_are_row_aligned(live_model, tok):
    """Same seed, same rows: identical samples; another seed: different ones (so 0% is not vacuous)."""
    inputs = _inputs(tok, QUESTIONS[:2], 4, torch.device("cpu"))
    kw = dict(site="final_norm", layer_decay=0.5, temperature=1.0, max_new_tokens=6, pad_id=tok.pad_token_id)
    rows = [RowNoise()] * 8
    a, la, _, _ = _sample(live_model, inputs, rows, seed=1, **kw)
    b, lb, _, _ = _sample(live_model, inputs, rows, seed=1, **kw)
    c, _, _, _ = _sample(live_model, inputs, rows, seed=2, **kw)
    assert a == b and torch.equal(la, lb)
    assert a != c


def test_probe_json_and_table(live_model, tok, tmp_path):
    r = _probe(live_model, tok, [0.5], rollouts=2)
    d = json.loads(r.to_json(tmp_path / "p.json"))
    assert d["verdict"] == r.verdict and d["rows"][0]["sigma"] == 0.5 and d["rollouts"] == 2
    assert json.loads((tmp_path / "p.json").read_text()) == d
    from ncgrpo.runs.provenance import provenance

    assert d["provenance"] == provenance()  # issue 42: what made the numbers (commit, package versions)
    console = Console(record=True, width=220)
    console.print(format_probe(r))
    text = console.export_text()
    assert "marginal" in text and "TV per" in text and "verdict:" in text


def test_probe_reads_the_prompt_with_the_branch_prefix(live_model, tok):
    proc = with_branch_prefix(tok, "<think>")
    inputs = _inputs(proc, QUESTIONS[:1], 1, torch.device("cpu"))
    assert tok.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n<think>")
    r = _probe(live_model, tok, [0.0], branch_prefix="<think>", rollouts=1)
    assert r.branch_prefix == "<think>"


def test_probe_bad_arguments(live_model, tok):
    with pytest.raises(ValueError, match="no questions"):
        probe(live_model, tok, [], [0.2], progress=False)
    with pytest.raises(ValueError, match="sigma"):
        probe(live_model, tok, QUESTIONS, [-1.0], progress=False)
    with pytest.raises(ValueError, match="even"):
        probe(live_model, tok, QUESTIONS, [0.2], rollouts=3, method="antithetic", progress=False)
    with pytest.raises(ValueError, match="final-norm site"):
        probe(live_model, tok, QUESTIONS, [0.2], site=[1], target_marginal_tv=0.01, progress=False)
    with pytest.raises(ValueError, match="target_marginal_tv"):
        probe(live_model, tok, QUESTIONS, [0.2], target_marginal_tv=1.5, progress=False)


def test_probe_refuses_marginal_draws_the_memory_cannot_hold_before_allocating(live_model, tok, monkeypatch):
    """`probe --marginal_draws 50000000` grew to 23.7 GB and ended in the OOM killer or an internal error.
    Here the available memory is made 1 MB, so 20000 draws (~0.3 GB on the tiny model) are refused from
    the estimate, before any draw (before the fix this probe ran them: a small count, safe to run)."""
    import ncgrpo.models

    monkeypatch.setattr(ncgrpo.models, "available_memory", lambda: 10**6, raising=False)
    with pytest.raises(
        ValueError,
        match=r"^marginal_draws 20000: the noise-averaged first-token estimate would hold ~0\.\d GB \(6 prompts x "
        r"20000 draws x d=\d+ float32 eps and states, .* V=\d+ tokens .*\), more than the 0\.0 GB of memory available; lower "
        r"marginal_draws",
    ):
        _probe(live_model, tok, [0.2], marginal_draws=20000)
    monkeypatch.setattr(ncgrpo.models, "available_memory", lambda: None)  # unknown: not refused
    assert _probe(live_model, tok, [0.2], marginal_draws=4, max_new_tokens=1, rollouts=2).rows


def test_target_marginal_tv_finds_the_sigma_that_reaches_it(live_model, tok):
    r = _probe(live_model, tok, [1.0], rollouts=2, target_marginal_tv=0.002, max_new_tokens=2)
    assert r.target_sigma is not None and 0 < r.target_sigma < 4
    again = _probe(live_model, tok, [r.target_sigma], rollouts=2, max_new_tokens=2)
    assert again.rows[0].marginal_tv == pytest.approx(0.002, abs=3 * again.rows[0].marginal_tv_se + 2e-4)
    # this random model's mixture barely moves: 0.5 is not reached, and the probe says so
    far = _probe(live_model, tok, [1.0], rollouts=2, target_marginal_tv=0.5, max_new_tokens=2)
    assert far.target_sigma is None
    console = Console(record=True, width=220)
    console.print(format_probe(far))
    assert "not reached at any sigma <= 4" in console.export_text()


def test_layer_site_marginal_comes_from_the_rollouts_draws(live_model, tok):
    r = _probe(live_model, tok, [2.0], site=[1], rollouts=4, max_new_tokens=2)
    row = r.rows[0]
    assert row.marginal_draws == 4 and 0 < row.marginal_tv <= row.tv + 1e-6


@pytest.mark.parametrize("sigma", [0.2, 0.5])
def test_embedded_base_marginal_within_monte_carlo_error_of_an_independent_computation(sigma):
    """The probe's TV(q, q_bar) on the embedded base (the README's figure, branch_prefix '<think>') against
    a brute-force computation: fresh torch.randn draws through the LM head's weights, written out here."""
    import math

    from ncgrpo.models import load_model_and_processor
    from ncgrpo.toy.base_model import ensure_base_model
    from ncgrpo.toy.suite import build_suite

    model, processor = load_model_and_processor(str(ensure_base_model()), dtype="float32", device="cpu")
    qs = [q for q in build_suite(0, {"train": 40})["train"] if q.metadata["family"] == "geometry"][:3]
    r = probe(model, processor, qs, [sigma], rollouts=1, max_new_tokens=1, branch_prefix="<think>",
              marginal_draws=2048, progress=False)  # fmt: skip
    proc = with_branch_prefix(processor, "<think>")
    inputs = _inputs(proc, qs, 1, torch.device("cpu"))
    cap = {}

    def grab(module, args, output):
        cap.setdefault("h", args[0][:, -1].detach())

    handle = model.lm_head.register_forward_hook(grab)
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1]
    handle.remove()
    W = model.lm_head.weight.detach()
    g = torch.Generator().manual_seed(1234)
    for i, pp in enumerate(r.rows[0].per_prompt):
        h = cap["h"][i]
        d = h.numel()
        q_bar = torch.zeros(W.shape[0], dtype=torch.float64)
        for _ in range(10):
            eps = torch.randn(20_000, d, generator=g)
            q_bar += torch.softmax((h + sigma * h.norm() / math.sqrt(d) * eps) @ W.T, -1).double().sum(0)
        q_bar /= 200_000
        truth = 0.5 * float((q_bar - torch.softmax(logits[i].double(), -1)).abs().sum())
        assert abs(pp["marginal_tv"] - truth) < 4 * pp["marginal_tv_se"] + 5e-4, (pp, truth)
        assert pp["tv"] > 3 * truth  # the per-draw TV overstates what the rollouts see


# ------------------------------------------------------------------------------------ branch_prefix
def test_prefixed_chat_template_appends_after_the_generation_prompt(tok):
    msgs = [{"role": "user", "content": "hi"}]
    plain = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    proc = with_branch_prefix(tok, "<think>\n")
    assert proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == plain + "<think>\n"
    # no generation prompt: no prefix, and the rest of the template's output is untouched
    assert proc.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    assert "branch_prefix" not in (tok.chat_template or "")  # the original is not modified
    t = prefixed_chat_template(tok.chat_template, "<think>")
    assert prefixed_chat_template(t, "<think>") == t
    with pytest.raises(ValueError, match="different branch_prefix"):
        prefixed_chat_template(t, "<x>")
    assert with_branch_prefix(tok, "") is tok


def test_rewards_see_the_prefix():
    comp = "2 + 2 = 4</think> \\boxed{4}"
    assert not format_ok(comp)
    (text,) = prefix_completions([comp], "<think>")
    assert format_ok(text)
    conv = prefix_completions([[{"role": "assistant", "content": comp}]], "<think>")
    assert conv[0][0]["content"] == "<think>" + comp
    plain = math_reward([comp], answer=["4"])[0]
    pref = math_reward(prefix_completions([comp], "<think>"), answer=["4"])[0]
    assert pref > plain


# ------------------------------------------------------------------------------------ inert warning
def test_inert_monitor_fires_once_after_the_first_noisy_steps():
    m = InertNoiseMonitor(threshold=0.01, steps=3)
    assert m.update(1, 0.0, 0.0) is None  # sigma_k = 0: nothing to detect
    assert m.update(2, 0.2, 0.0) is None
    assert m.update(3, 0.2, 0.005) is None
    msg = m.update(4, 0.19, 0.0)
    assert msg is not None and "ncgrpo probe" in msg and "branch_prefix" in msg and "step 2" in msg
    assert m.update(5, 0.19, 0.0) is None  # once


def test_inert_monitor_stays_quiet_when_the_noise_acts():
    m = InertNoiseMonitor(threshold=0.01, steps=3)
    assert m.update(1, 0.2, 0.0) is None
    assert m.update(2, 0.2, 0.3) is None
    assert all(m.update(k, 0.2, 0.0) is None for k in range(3, 10))


# ------------------------------------------------------------------------------------ trainer wiring
@pytest.mark.parametrize("method", ["vanilla", "latent"])
def test_trainer_branch_prefix_reaches_the_prompt_and_the_reward(tmp_path, method):
    from ncgrpo.trainer import NCGRPOTrainer

    tiny = load_tiny_grpo()
    seen: dict[str, list] = {"prompts": [], "completions": []}

    class Recording(NCGRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            seen["prompts"] += [list(p) for p in prompt_ids]
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def reward(completions, **kwargs):
        seen["completions"] += list(completions)
        return [float(len(str(c)) % 3) for c in completions]

    args = tiny.config(tmp_path, rollout_method=method, max_steps=1, branch_prefix="<think>")
    proc = tiny.processor()
    tr = Recording(
        model=tiny.model(0), reward_funcs=[reward], args=args, train_dataset=tiny.dataset(8),
        processing_class=proc,
    )  # fmt: skip
    tr.train()
    tok = proc.tokenizer
    assert seen["prompts"] and all(
        tok.decode(p).endswith("<|im_start|>assistant\n<think>") for p in seen["prompts"]
    )
    assert seen["completions"] and all(c[0]["content"].startswith("<think>") for c in seen["completions"])
    # built once: the trainer holds one prefixed copy for the whole run; the caller's processor and
    # every checkpoint keep the plain template
    assert "branch_prefix" in tr.processing_class.chat_template and "branch_prefix" not in proc.chat_template
    tr.save_model(str(tmp_path / "saved"))
    saved = (tmp_path / "saved" / "chat_template.jinja").read_text()
    assert "branch_prefix" not in saved and saved.strip() == proc.chat_template.strip()


def test_trainer_warns_once_when_the_noise_is_inert(tmp_path):
    """Greedy decoding and a vanishing sigma: the noisy first tokens never leave the clean argmax."""
    tiny = load_tiny_grpo()
    tr = tiny.trainer(
        tmp_path, rollout_method="latent", sigma0=1e-7, sigma_schedule="constant", max_steps=3,
        generation_kwargs={"do_sample": False},
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.train()
    inert = [w for w in caught if issubclass(w.category, InertNoiseWarning)]
    assert len(inert) == 1, [str(w.message) for w in caught]
    assert "ncgrpo probe" in str(inert[0].message) and "step 3" in str(inert[0].message)


def test_trainer_warns_when_sampling_hides_inert_noise(tmp_path):
    """Temperature sampling with a vanishing sigma: sampled first tokens leave the clean argmax often
    (noise/first_token_divergence is high on both halves) yet the noise changes no distribution; the
    warning reads the first-token total variation, so it still fires."""
    tiny = load_tiny_grpo()
    tr = tiny.trainer(
        tmp_path,
        rollout_method="latent",
        sigma0=1e-7,
        sigma_schedule="constant",
        max_steps=3,
        temperature=5.0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.train()
    logged = [m for m in tr.nc_history]
    assert logged[0].metrics["noise/first_token_divergence"] >= 0.01  # the old signal: silent from step 1
    inert = [w for w in caught if issubclass(w.category, InertNoiseWarning)]
    assert len(inert) == 1 and "noise/first_token_marginal_tv" in str(inert[0].message)


def test_inert_monitor_reads_the_marginal_and_falls_back_to_the_per_draw_tv():
    """A per-draw TV of 0.05 can sit on a mixture that barely moves: the marginal decides; where it is
    not logged (layer sites, the image method) the per-draw TV does, at its own threshold."""
    m = InertNoiseMonitor(steps=2)
    metrics = {"noise/first_token_marginal_tv": 0.001, "noise/first_token_tv": 0.05}
    assert m.update_from(1, 0.2, metrics) is None
    msg = m.update_from(2, 0.2, metrics)
    assert msg is not None and "noise/first_token_marginal_tv stayed below 0.002" in msg
    m = InertNoiseMonitor(steps=2)
    assert m.update_from(1, 0.2, {"noise/first_token_tv": 0.05}) is None and m.done  # live by the fallback
    m = InertNoiseMonitor(steps=1)
    msg = m.update_from(1, 0.2, {"noise/first_token_tv": 0.001})
    assert msg is not None and "noise/first_token_tv stayed below 0.01" in msg
    assert InertNoiseMonitor().update_from(1, 0.2, {}) is None


def test_probe_cli_refuses_a_device_and_threads_it_cannot_use_before_loading_anything(capsys, monkeypatch):
    """--device cuda on a machine whose torch sees no GPU, and a negative thread count: exit 2 with the
    reason, before the model loads (they used to be internal errors after it)."""
    from ncgrpo.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["probe", "--device", "cuda", "--prompts", "2"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    assert main(["probe", "--num_threads", "-1", "--prompts", "2"]) == 2
    assert "--num_threads must be >= 0" in capsys.readouterr().err


# ------------------------------------------------------------ issue 26: everything checked before the model
def _no_model(monkeypatch):
    """Make loading a model (or the embedded base) fail loudly: a check that ran after it shows up."""
    import ncgrpo.models
    import ncgrpo.toy.base_model

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(ncgrpo.models, "load_model_and_processor", loaded)
    monkeypatch.setattr(ncgrpo.toy.base_model, "ensure_base_model", loaded)


def test_probe_cli_checks_its_settings_and_output_file_before_the_model(tmp_path, capsys, monkeypatch):
    """Items 3 and 11 and the cryptic messages: each exits 2 with a message naming what to fix,
    before any question is generated or the model loads, and leaves the files it names alone."""
    from ncgrpo.cli import main

    _no_model(monkeypatch)
    records = tmp_path / "eval" / "records.jsonl"  # an evaluation's records: never the probe's to replace
    records.parent.mkdir()
    records.write_text('{"benchmark": "geo3k"}\n')
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    (tmp_path / "existing.json").write_text("{}")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cases = [
        (["--prompts", "100000000"], "ask for at most 2000"),
        (["--sigma0", "nan"], "finite number >= 0"),
        (["--sigma0", "-0.1"], "finite number >= 0"),
        (["--rollout_method", "vanilla"], "--rollout_method must be one of antithetic, latent, spsa"),
        (["--rollout_method", "antithetic", "--rollouts", "3"], "give an even --rollouts"),
        (["--noise_site", "norm"], "noise_site"),
        (["--temperature", "inf"], "--temperature must be a finite number > 0"),
        (["--family", "nope"], "--family 'nope'"),
        (["--output_file", str(tmp_path)], f"--output_file {tmp_path} is a folder"),
        (
            ["--output_file", str(tmp_path / "existing.json" / "p.json")],
            "existing.json is a file, not a folder",
        ),
        (["--output_file", str(records)], "records.jsonl is a file of a command's run folder"),
        (["--output_file", str(other)], "exists and is not a probe result"),
        (["--model_name_or_path", "/nonexistent/model"], "/nonexistent/model does not exist"),
        (
            ["--model_name_or_path", str(tmp_path / "existing.json")],
            "existing.json: is a file; pass the folder",
        ),
        (["--model_name_or_path", str(tmp_path)], "the folder holds no config.json"),
    ]
    for flags, message in cases:
        assert main(["probe", "--no_progress", "--model_name_or_path", str(model), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err, (flags, err)
        assert "Errno" not in err and "repo id" not in err and "internal error" not in err, err
    assert records.read_text() == '{"benchmark": "geo3k"}\n' and other.read_text() == '{"mine": 1}'


def test_probe_refuses_image_questions_for_a_text_only_model_before_loading_it(tmp_path, capsys, monkeypatch):
    """Item 5: the images would be dropped and only placeholder tokens reach the model (eval and the
    demo refuse this); read from config.json (no vision_config), before the weights."""
    from transformers import Qwen2Config

    from ncgrpo.cli import main

    _no_model(monkeypatch)
    Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=32, vocab_size=64).save_pretrained(tmp_path / "text")  # fmt: skip
    assert (
        main(["probe", "--no_progress", "--prompts", "2", "--model_name_or_path", str(tmp_path / "text")])
        == 2
    )
    err = capsys.readouterr().err
    assert "is a text-only model (its config.json has no vision_config)" in err and "synthetic/" in err


def test_probe_writes_its_json_atomically_with_its_kind_and_replaces_only_its_own(tmp_path):
    from ncgrpo.commands._common import UsageError
    from ncgrpo.commands.probe import write_result

    class Result:
        def to_dict(self):
            return {"n_prompts": 2, "rows": [], "site": "final_norm"}

    out = tmp_path / "sub" / "p.json"
    write_result(Result(), out)  # a missing parent folder is made
    assert json.loads(out.read_text())["kind"] == "probe"
    write_result(Result(), out)  # its own result: replaced
    legacy = tmp_path / "old.json"  # written before kinds: recognised by the probe's keys
    legacy.write_text(json.dumps({"n_prompts": 1, "rows": [], "site": "1"}))
    write_result(Result(), legacy)
    assert json.loads(legacy.read_text())["kind"] == "probe"
    (tmp_path / "x.json").write_text("[1]")
    with pytest.raises(UsageError, match="not a probe result"):
        write_result(Result(), tmp_path / "x.json")
    assert not list(tmp_path.glob(".*.tmp"))


def test_probe_reads_gsm8k_and_math500_prompts_from_data(tmp_path):
    """Issue 44: --benchmark gsm8k / math500 with --data reads the built-in loaders (GSM8K's gold is the
    number after '#### '), text-only questions, as eval does."""
    import json

    from ncgrpo.commands.probe import ProbeArgs, _questions

    gsm8k = tmp_path / "test.jsonl"
    gsm8k.write_text(json.dumps({"question": "What is 1,000 + 1?", "answer": "1000 + 1\n#### 1,001"}) + "\n")
    math500 = tmp_path / "math500.jsonl"
    math500.write_text(json.dumps({"prompt": "Compute $1+1$.\nPlease reason step by step, and put your "
                                   "final answer within \\boxed{}.", "answer": "2"}) + "\n")  # fmt: skip
    for name, path, gold, problem in [
        ("gsm8k", gsm8k, "1001", "What is 1,000 + 1?"),
        ("math500", math500, "2", "Compute $1+1$."),
    ]:
        qs = _questions(ProbeArgs(benchmark=name, data=path, prompts=1, device="cpu"))
        assert [(q.benchmark, q.answer, q.problem, q.images, q.role) for q in qs] == [
            (name, gold, problem, [], "ood")
        ]
