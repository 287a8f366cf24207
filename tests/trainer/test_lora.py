"""PEFT/LoRA: NC-GRPO through the adapter wrapper, on the embedded base model (``ncgrpo.toy``).

- the noise acts at the same site through a ``PeftModel``: the noisy row's first-token logits are
  ``lm_head(h + sigma ||h|| / sqrt(d) eps)`` (eq. 2) with ``h`` the adapted model's final-norm state and
  ``eps`` the keyed draw, the clean row is bit-identical to the clean forward;
- a 2-step LoRA run (library and ``ncgrpo train --use_peft true``) changes only adapter weights: every
  base weight bit-identical, LoRA weights changed; TRL's reference pass (adapter disabled) runs with no
  noise hook active;
- the run folder is an adapter folder that ``PeftModel.from_pretrained`` and ``ncgrpo eval`` load;
- refused: an NC-GRPO method on vLLM with an adapter (before any engine starts), LoRA settings that
  cannot work (at config time).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel  # noqa: E402

from ncgrpo.cli import main  # noqa: E402
from ncgrpo.core.noise import NoiseKey, RowNoise, draw_eps  # noqa: E402
from ncgrpo.engines import transformers as engine  # noqa: E402
from ncgrpo.engines.branch_point import find_text_stack  # noqa: E402
from ncgrpo.engines.transformers import prefill_noise  # noqa: E402
from ncgrpo.models import load_model_and_processor, tokenizer_of  # noqa: E402
from ncgrpo.toy.base_model import ensure_base_model  # noqa: E402
from ncgrpo.trainer import NCGRPOConfig, NCGRPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu_latent.yaml"
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def base() -> Path:
    return ensure_base_model()


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    """A small synthetic suite in Geometry3K's layout (train 8, validation / test 1 per family)."""
    from ncgrpo.toy.suite import build_suite, export_geo3k

    out = tmp_path_factory.mktemp("suite")
    export_geo3k(build_suite(seed=0, sizes={"train": 8, "validation": 1, "test": 1}), out)
    return out


def load_base(base: Path):
    return load_model_and_processor(base, dtype="float32", device=None, freeze_vision=True)


def lora(**kw) -> LoraConfig:
    """LoRA on the language model's projections (the vision tower excluded, as ``ncgrpo train`` does)."""
    return LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
        exclude_modules=r"model\.visual(\..*)?", **kw,
    )  # fmt: skip


# ------------------------------------------------------------------------------- eq. (2) through the wrapper
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "peft"])
def test_noisy_first_token_logits_are_eq2_through_the_adapter(base, wrapped) -> None:
    model, processor = load_base(base)
    if wrapped:  # random B: the adapter really changes the model (LoRA's default init is the identity)
        torch.manual_seed(0)
        model = PeftModel(model, lora(init_lora_weights=False))
    model.eval()
    top, stack, _ = find_text_stack(model)
    assert (top is model) != wrapped  # through the wrapper: the transformers model inside
    tok = tokenizer_of(processor)
    tok.padding_side = "left"
    x = tok(
        ["What is 3 + 4? Answer:", "Count the red circles, then add 2."], return_tensors="pt", padding=True
    )
    sigma, key = 0.7, NoiseKey(seed=5, step=2, prompt_id=11, draw=1)
    rows = [RowNoise(), RowNoise(sigma=sigma, key=key)]

    states = []
    handle = stack.register_forward_hook(lambda m, a, out: states.append(out.last_hidden_state.detach()))
    with torch.no_grad():
        clean = model(**x).logits[:, -1]
        with prefill_noise(model, rows) as hook:
            noisy = model(**x).logits[:, -1]
    handle.remove()
    h = states[0][:, -1]  # the clean final-norm states at the last prompt token (left padding)
    d = h.shape[-1]
    eps = draw_eps(key, [0], d)[0]
    h_tilde = h[1] + sigma * h[1].norm() / math.sqrt(d) * eps
    with torch.no_grad():
        want = top.lm_head(h_tilde[None])[0]  # the (adapted) model's own head
    torch.testing.assert_close(noisy[1], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(noisy[0], clean[0])  # the clean row is untouched
    assert (noisy[1] - clean[1]).abs().max() > 1e-2  # and the noisy one moved
    # the hook's own record of the site: the same clean and perturbed states
    torch.testing.assert_close(hook.last.clean_last[1], h[1], rtol=0, atol=0)
    torch.testing.assert_close(hook.last.noisy_last[1], h_tilde, rtol=1e-6, atol=1e-6)
    assert top not in engine._HOOKED and not stack._forward_hooks  # removed on exit
    if wrapped:  # the states above are the adapted model's: without the adapter the logits differ
        with torch.no_grad(), model.disable_adapter():
            assert (model(**x).logits[:, -1] - clean).abs().max() > 1e-3


# ------------------------------------------------------------------------------- a LoRA run, library
def spread_reward(completions, **kwargs) -> list[float]:
    """A deterministic reward with spread (crc32 of the completion mod 3), so the advantages are not 0."""
    return [float(zlib.crc32(str(c).encode()) % 3) for c in completions]


class Recording(NCGRPOTrainer):
    """Records, for every log-probability pass, whether the adapter was disabled (TRL's reference pass)
    and whether a noise hook was active on the model."""

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        lora_layers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
        top = find_text_stack(model)[0]
        self.passes.append((all(m.disable_adapters for m in lora_layers), top in engine._HOOKED))
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)


def base_snapshot(model) -> tuple[dict, dict]:
    """The base model's parameters (the objects LoRA wraps in place) and copies of their values."""
    params = dict(model.named_parameters())
    return params, {n: p.detach().clone() for n, p in params.items()}


def assert_only_adapter_changed(params: dict, before: dict, lora_before: dict, lora_after: dict) -> None:
    same = [n for n, p in params.items() if torch.equal(p.detach(), before[n])]
    assert len(same) == len(params), f"base weights changed: {sorted(set(params) - set(same))[:5]}"
    assert lora_before and lora_before.keys() == lora_after.keys()
    changed = [n for n in lora_after if not torch.equal(lora_after[n], lora_before[n])]
    assert changed, "no LoRA weight changed"
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    assert not any("visual" in n for n in lora_after)  # the frozen vision tower has no adapter


@pytest.mark.parametrize(
    ("method", "extra"),
    [("latent", {}), ("latent", {"share_prompt_loss": True}), ("image", {})],
    ids=["latent", "latent-shared-loss", "image"],
)
def test_two_lora_steps_change_only_the_adapter(base, suite, tmp_path, method, extra) -> None:
    from ncgrpo.data.geometry3k import load_geometry3k, to_trl_dataset

    model, processor = load_base(base)
    params, before = base_snapshot(model)
    args = NCGRPOConfig(
        output_dir=str(tmp_path / "out"), rollout_method=method, sigma0=0.5, sigma_schedule="constant",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=12, max_steps=2,
        learning_rate=5e-2, beta=0.04, logging_steps=1, report_to="none", use_cpu=True, bf16=False, seed=0,
        save_strategy="no", dataloader_num_workers=0, **extra,
    )  # fmt: skip
    trainer = Recording(
        model=model,
        reward_funcs=[spread_reward],
        args=args,
        train_dataset=to_trl_dataset(load_geometry3k(str(suite), "train")),
        processing_class=processor,
        peft_config=lora(),
    )
    trainer.passes = []
    assert isinstance(trainer.model, PeftModel)
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    lora_after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert_only_adapter_changed(params, before, lora_before, lora_after)

    # the noise acted through the wrapper on every generation
    assert len(trainer.nc_history) == 2
    for rec in trainer.nc_history:
        if method == "latent":
            assert 0.3 < rec.metrics["noise/rel_perturbation"] < 0.8  # sigma 0.5
        else:
            assert rec.metrics["image_noise/t"] > 0
    if method == "latent":  # one prefill per prompt, through the PEFT model's generate
        assert trainer.nc_shared_prefill and all(r.shared for r in trainer.nc_shared_prefill)
    # TRL's reference pass ran with the adapter disabled, and no pass ran under a noise hook
    assert any(disabled for disabled, _ in trainer.passes)
    assert not any(hooked for _, hooked in trainer.passes)


def test_nc_grpo_on_vllm_with_an_adapter_is_refused_before_the_engine(base, tmp_path) -> None:
    model, processor = load_base(base)
    args = NCGRPOConfig(
        output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=4,
        num_generations=4, report_to="none", use_cpu=True, bf16=False,
    )  # fmt: skip
    for kw in ({"peft_config": lora()}, {}):
        m = model if kw else PeftModel(model, lora())  # a peft_config, or a PeftModel
        with pytest.raises(NotImplementedError, match="PEFT adapter on vLLM"):
            NCGRPOTrainer(model=m, reward_funcs=[spread_reward], args=args, processing_class=processor, **kw)


def test_active_lora_dropout_is_named(base, tmp_path) -> None:
    from datasets import Dataset

    model, processor = load_base(base)
    args = NCGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, report_to="none",
        use_cpu=True, bf16=False,
    )  # fmt: skip
    ds = Dataset.from_list([{"prompt": "What is 1 + 1?"}] * 4)
    with pytest.warns(UserWarning, match="LoRA dropout 0.05 is active in the rollouts"):
        NCGRPOTrainer(
            model=model, reward_funcs=[spread_reward], args=args, train_dataset=ds,
            processing_class=processor, peft_config=LoraConfig(task_type="CAUSAL_LM", r=2, lora_dropout=0.05,
                                                                target_modules=["q_proj"]),
        )  # fmt: skip


# ------------------------------------------------------------------------------- a LoRA run, the command line
def train_args(out: Path, base: Path, suite: Path, *extra: str) -> list[str]:
    return [
        "train", "--config", str(TINY_RECIPE), "--output_dir", str(out), "--model_name_or_path", str(base),
        "--dataset_name", "synthetic", "--dataset_path", str(suite), "--max_completion_length", "16",
        "--learning_rate", "5e-2", "--sigma0", "0.5", *extra,
    ]  # fmt: skip


LORA_FLAGS = ("--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0",
              "--lora_target_modules", *TARGETS)  # fmt: skip


def test_cli_lora_run_saves_an_adapter_that_eval_loads(base, suite, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(train_args(out, base, suite, *LORA_FLAGS)) == 0
    # an adapter folder: adapter weights and config, the processor, no full weights
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (
        adapter["r"] == 4
        and adapter["lora_alpha"] == 8
        and sorted(adapter["target_modules"]) == sorted(TARGETS)
    )
    assert Path(adapter["base_model_name_or_path"]) == base.resolve()
    assert json.loads((out / "run.json").read_text())["finished"] is True
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(
        0.1 < m.get("noise/rel_perturbation", 0) < 0.9 for m in metrics
    )  # sigma 0.5, through the adapter

    # PeftModel.from_pretrained on the base: base weights as saved, LoRA weights trained (B starts at 0)
    model, _ = load_base(base)
    params, before = base_snapshot(model)
    loaded = PeftModel.from_pretrained(model, str(out))
    lora_after = {n: p.detach().clone() for n, p in loaded.named_parameters() if "lora_" in n}
    lora_init = {n: (torch.zeros_like(p) if "lora_B" in n else p) for n, p in lora_after.items()}
    assert all(torch.equal(p.detach(), before[n]) for n, p in params.items())
    assert any(not torch.equal(lora_after[n], lora_init[n]) for n in lora_after if "lora_B" in n)
    assert not any("visual" in n for n in lora_after)

    # ncgrpo eval loads the folder (the adapter merged into its base)
    ev = tmp_path / "eval"
    rc = main(["eval", "--model_name_or_path", str(out), "--benchmarks", "synthetic", "--data",
               f"synthetic={suite}", "--split", "test", "--limit", "1", "--max_new_tokens", "8", "--output_dir",
               str(ev), "--device", "cpu", "--dtype", "float32", "--no_progress"])  # fmt: skip
    assert rc == 0 and (ev / "records.jsonl").is_file()


def test_eval_loads_the_adapter_merged(base, tmp_path) -> None:
    """``load_for_eval`` of an adapter folder is the base with the adapter merged in (same logits as the
    PeftModel); --engine vllm refuses the folder with the reason."""
    from ncgrpo.eval.evaluate import adapter_base, config_reads_images, load_for_eval

    model, processor = load_base(base)
    torch.manual_seed(1)
    pm = PeftModel(model, lora(init_lora_weights=False)).eval()
    folder = tmp_path / "adapter"
    pm.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    assert adapter_base(folder) == str(base) and adapter_base(base) is None
    assert config_reads_images(folder) is True  # the base's config: a vision-language model
    merged, proc = load_for_eval(folder, dtype="float32", device="cpu")
    assert not isinstance(merged, PeftModel)
    x = tokenizer_of(proc)(["What is 2 + 2?"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**x).logits, pm(**x).logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="PEFT adapter folder"):
        load_for_eval(folder, engine="vllm")


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (("--lora_r", "0"), "lora_r must be a positive integer"),
        (("--lora_dropout", "1.5"), r"lora_dropout must be in \[0, 1\)"),
        (("--lora_task_type", "SEQ_CLS"), "use CAUSAL_LM"),
    ],
)
def test_cli_bad_lora_settings_exit_2(base, suite, tmp_path, capsys, flags, match) -> None:
    out = tmp_path / "run"
    assert main(train_args(out, base, suite, "--use_peft", "true", *flags)) == 2
    err = capsys.readouterr().err
    assert "ncgrpo train: error:" in err
    import re

    assert re.search(match, err), err
    assert not out.exists()


def test_cli_lora_without_target_modules_on_a_qwen_vl_names_the_flag(base, suite, tmp_path, capsys) -> None:
    assert main(train_args(tmp_path / "run", base, suite, "--use_peft", "true")) == 2
    assert "--lora_target_modules" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ((), "--lora_target_modules"),
        (("--lora_target_modules", "all-linear", "--use_vllm", "true"), "on vLLM with an adapter"),
    ],
    ids=["no-targets", "vllm"],
)
def test_dry_run_refuses_what_the_lora_run_refuses(base, suite, tmp_path, capsys, flags, match) -> None:
    """--dry-run makes the LoRA run's refusals from the model's config alone (issue 32 item 6), and a
    refused run writes nothing (the target check used to run after the run folder was written)."""
    out = tmp_path / "run"
    assert main(train_args(out, base, suite, "--use_peft", "true", *flags, "--dry-run")) == 2
    assert match in capsys.readouterr().err
    assert not out.exists()
    assert main(train_args(out, base, suite, "--use_peft", "true", *flags)) == 2
    assert not out.exists()


def test_the_lora_example_runs(tmp_path, capsys) -> None:
    """examples/lora.py as a user runs it (CI runs it too), two steps."""
    import runpy

    example = runpy.run_path(str(ROOT / "examples" / "lora.py"))
    out = tmp_path / "adapter"
    got = example["main"](["--output_dir", str(out), "--max_steps", "2"])
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert 0 < got["trainable"] < got["total"] / 10  # the adapter only
    assert 0.3 < got["noise/rel_perturbation"] < 0.8 and got["noise/first_token_marginal_tv"] > 1e-3
    assert "reloaded: PeftModelForCausalLM" in capsys.readouterr().out


def test_cli_lora_run_resumes_from_its_adapter_checkpoint(base, suite, tmp_path, capsys) -> None:
    """--resume continues a LoRA run from its newest complete checkpoint (adapter weights, optimizer,
    NC-GRPO state): an adapter checkpoint counts as complete, and the resumed run starts from its adapter."""
    import safetensors.torch

    from ncgrpo.runs.folder import checkpoint_problem

    out = tmp_path / "run"
    common = (*LORA_FLAGS, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1")
    assert main(train_args(out, base, suite, *common)) == 0
    ckpt = out / "checkpoint-1"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "ncgrpo_state.pt").is_file()
    assert checkpoint_problem(ckpt, nc_state=True) is None
    saved = safetensors.torch.load_file(str(ckpt / "adapter_model.safetensors"))
    assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # a trained adapter
    # as if killed before checkpoint-2 was complete: resume from checkpoint-1
    import shutil

    shutil.rmtree(out / "checkpoint-2")
    run = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**run, "finished": False}))
    loaded = {}
    original = NCGRPOTrainer._load_from_checkpoint

    def remember(trainer_self, checkpoint, model=None):
        result = original(trainer_self, checkpoint, model)
        loaded.update(
            {
                n.replace(".default", ""): p.detach().clone()
                for n, p in trainer_self.model.named_parameters()
                if "lora_" in n
            }
        )
        return result

    capsys.readouterr()
    try:
        NCGRPOTrainer._load_from_checkpoint = remember
        assert main(train_args(out, base, suite, *common, "--resume")) == 0
    finally:
        NCGRPOTrainer._load_from_checkpoint = original
    assert "no complete checkpoint" not in capsys.readouterr().err
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)  # checkpoint-1's adapter, not a fresh one
    steps = [
        r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert steps == [1, 2]
    assert json.loads((out / "run.json").read_text())["global_step"] == 2


@pytest.mark.parametrize("freeze", [True, False])
def test_cli_lora_config_keeps_a_frozen_vision_tower_out_of_the_adapter(base, freeze) -> None:
    """``ncgrpo train``'s LoraConfig (trl.get_peft_config + ncgrpo's exclusion): all-linear adapts every
    language-model projection and, with freeze_vision_tower, nothing in the vision tower."""
    from peft import get_peft_model

    from ncgrpo.commands.train_settings import ModelArguments
    from ncgrpo.driver import peft_config_for

    args = ModelArguments(
        model_name_or_path=str(base), use_peft=True, lora_target_modules=["all-linear"], dtype="float32",
        freeze_vision_tower=freeze,
    )  # fmt: skip
    model, _ = load_model_and_processor(base, dtype="float32", device=None, freeze_vision=freeze)
    adapted = [
        n
        for n, _ in get_peft_model(model, peft_config_for(args, model)).named_modules()
        if n.endswith("lora_A")
    ]
    text = [n for n in adapted if "language_model" in n]
    assert len(text) == 3 * 7  # 3 layers x q, k, v, o, gate, up, down
    assert any("visual" in n for n in adapted) != freeze
    assert not any("lm_head" in n for n in adapted)


@pytest.mark.parametrize(
    ("targets", "expected"), [(["q_proj"], 3), ([r".*language_model.*\.q_proj"], 3), (["all-linear"], 21)]
)
def test_one_lora_target_module_name_adapts_those_modules(base, targets, expected) -> None:
    """TRL's ModelConfig turns a one-item lora_target_modules into a string, which peft reads as a regex
    over whole module names: `--lora_target_modules q_proj` adapted nothing ("No modules were targeted").
    A plain name is kept as the one-name list; a pattern and all-linear are as given."""
    from peft import get_peft_model

    from ncgrpo.commands.train_settings import ModelArguments
    from ncgrpo.driver import peft_config_for

    args = ModelArguments(
        model_name_or_path=str(base), use_peft=True, lora_target_modules=targets, dtype="float32"
    )
    model, _ = load_model_and_processor(base, dtype="float32", device=None, freeze_vision=True)
    adapted = [
        n
        for n, _ in get_peft_model(model, peft_config_for(args, model)).named_modules()
        if n.endswith("lora_A")
    ]
    assert len(adapted) == expected, adapted
    assert not any("visual" in n for n in adapted)
