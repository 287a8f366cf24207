"""scripts/gpu_check.sh (one command for a fresh GPU machine), its report (scripts/gpu_check_report.py)
and the Qwen2.5-VL-3B-sized model builder of benchmarks/bench_vllm_rollout.py, checked on a CPU: the
script's syntax and plan, its training command through the real CLI parser and NCGRPOConfig, failures
recorded in the report instead of aborting, the report from known inputs, and the builder against the
public config (full size on the meta device, a tiny one built, saved and reloaded)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
REPORT = ROOT / "scripts" / "gpu_check_report.py"
PARTS = ("tests", "model", "bench", "train")

sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
import bench_vllm_rollout as bench  # noqa: E402
import gpu_check_report as report  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# a model small enough for a CPU, built by the same builder as the 3B-sized one
TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vision_depth=2,
    vision_hidden_size=32,
    vision_intermediate_size=64,
    vision_num_heads=2,
)


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300, **kw)


def plan(tmp_path: Path, *args: str) -> dict[str, str]:
    """The dry run's plan: {'python': ..., 'tests': <command or 'skipped ...'>, ...}."""
    r = run(str(tmp_path / "out"), "--dry-run", "--work", str(tmp_path / "work"), *args)
    assert r.returncode == 0, r.stderr
    out = {}
    for line in r.stdout.splitlines():
        key, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            out.setdefault(key.strip(), value.strip())
    return out


# ----------------------------------------------------------------------------------------- script
def test_syntax() -> None:
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_dry_run_prints_every_part_and_writes_nothing(tmp_path: Path) -> None:
    p = plan(tmp_path, "--python", "/opt/py/bin/python3")
    for part in PARTS:
        assert p[part].startswith("/opt/py/bin/python3 "), part
    assert "-m pytest -m gpu -o addopts=" in p["tests"]
    assert "--config qwen2_5_vl_3b" in p["model"] and "--build-only" in p["model"]
    assert "--config qwen2_5_vl_3b" in p["bench"] and "--n 6" in p["bench"]  # G = 12, as the recipes
    assert "-m ncgrpo.cli train --config recipes/qwen2_5_vl_7b_latent_sigma0.2.yaml" in p["train"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_dry_run_skips_and_options(tmp_path: Path) -> None:
    p = plan(
        tmp_path, "--skip", "tests,bench", "--train-engine", "transformers", "--quick", "--", "--seed", "7"
    )
    assert p["tests"] == "skipped (--skip)" and p["bench"] == "skipped (--skip)"
    assert "--use_vllm false" in p["train"] and p["train"].endswith("--seed 7")
    assert "--max_completion_length 64" in p["train"]
    w = plan(tmp_path, "--wheels", str(tmp_path))
    assert "--no-index" in w["setup"] and f"--target {tmp_path / 'work' / 'site'}" in w["setup"]
    assert str(tmp_path / "work" / "site") in w["PYTHONPATH"]


def test_training_command_is_the_recipe_scaled_to_one_gpu(tmp_path: Path) -> None:
    """The train part's flags through `ncgrpo train`'s own parser: the 7B recipe with one rollout batch of
    4 prompts x 12 feeding 4 updates (its 192/48), vLLM colocated at TP 1 with its memory settings."""
    from ncgrpo.cli import build_parser
    from ncgrpo.commands.train import train_dataclasses

    argv = shlex.split(plan(tmp_path)["train"])
    argv = argv[argv.index("ncgrpo.cli") + 1 :] + ["--bf16", "false", "--use_cpu"]  # builds without a GPU
    parsed = build_parser().parse_args(argv).parsed_config
    c = parsed.build(train_dataclasses()[1])
    recipe = build_parser().parse_args(["train", "--config", argv[2]]).parsed_config
    assert (c.use_vllm, c.vllm_mode, c.vllm_tensor_parallel_size) == (True, "colocate", 1)
    for key in ("vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "num_generations", "rollout_method"):
        assert getattr(c, key) == recipe.get(key), key
    assert c.max_steps == 3 and c.num_generations == 12
    assert c.steps_per_generation // c.gradient_accumulation_steps == (
        recipe.get("steps_per_generation") // recipe.get("gradient_accumulation_steps")
    )
    assert c.per_device_train_batch_size * c.steps_per_generation // c.num_generations == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "missing OUT_DIR"),
        (["o", "--skip", "tests,nope"], "--skip: unknown part 'nope'"),
        (["o", "--train-engine", "jax"], "--train-engine must be vllm or transformers"),
        (["o", "--part-timeout", "1.5"], "--part-timeout must be a whole number"),
        (["o", "--frobnicate"], "unknown option --frobnicate"),
        (["o", "p"], "one OUT_DIR only"),
        (["o", "--wheels", "/nonexistent/wheels"], "--wheels: no folder"),
    ],
)
def test_usage_errors(args: list, message: str, tmp_path: Path) -> None:
    r = run(*args, cwd=tmp_path)
    assert r.returncode == 2 and f"gpu_check.sh: error: {message}" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_failures_are_recorded_and_the_rest_runs(tmp_path: Path) -> None:
    """A Python that fails every command: every part is run and recorded as failed, with its log's
    end, the skipped part as skipped; the report is written and the script exits 1."""
    stub = tmp_path / "py"
    stub.write_text('#!/bin/sh\necho "stub python called with: $*" >&2\nexit 3\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    r = run(str(out), "--python", str(stub), "--work", str(tmp_path / "work"), "--skip", "tests")
    assert r.returncode == 1, r.stdout + r.stderr
    data = json.loads((out / "report.json").read_text())
    status = {p["name"]: (p["status"], p["exit_code"]) for p in data["parts"]}
    assert status == {
        "env": ("failed", 3),
        "tests": ("skipped", None),
        "model": ("failed", 3),
        "bench": ("failed", 3),
        "train": ("failed", 3),
    }
    assert data["ok"] is False and data["environment"] is None
    train = next(p for p in data["parts"] if p["name"] == "train")
    assert any("stub python called with: -m ncgrpo.cli train" in line for line in train["log_tail"])
    md = (out / "report.md").read_text()
    assert "overall: **FAILED**" in md and "| tests | skipped (--skip) |" in md and "### bench (exit 3" in md


# ----------------------------------------------------------------------------------------- report
def test_report_from_known_inputs(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    logs = out / "logs"
    logs.mkdir(parents=True)
    (logs / "parts.tsv").write_text(
        "env\tpassed\t0\t3\t\ntests\tpassed\t0\t40\t\nbench\tfailed\t1\t90\t\ntrain\tpassed\t0\t120\t\n"
    )
    (logs / "bench.log").write_text("\n".join(f"line {i}" for i in range(100)) + "\n")
    (logs / "env.log").write_text(
        'noise\nENV_JSON {"python": "3.12.3", "gpus": ["NVIDIA H100 80GB HBM3"], "cuda_available": true, '
        '"torch": "2.11.0", "vllm": null, "ncgrpo_plugin_installed": false}\n'
    )
    (logs / "train.mem.csv").write_text("0, 1000, 81559\n0, 52000, 81559\n0, 40000, 81559\ngarbage\n")
    (logs / "tests.xml").write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.a" name="ok"/><testcase classname="tests.a" name="ok2"/>'
        '<testcase classname="tests.a" name="bad"><failure message="boom"/></testcase>'
        '<testcase classname="tests.b" name="sk"><skipped message="no vllm"/></testcase>'
        "</testsuite></testsuites>"
    )
    (work / "train").mkdir(parents=True)
    (work / "train" / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": 0.1 * s, "noise/first_token_tv": 0.2}) + "\n" for s in (1, 2, 3)
        )
        + json.dumps({"step": 3, "train_runtime": 42.0})
        + "\n"
    )
    assert report.main([str(out), "--work", str(work), "--command", "scripts/gpu_check.sh out"]) == 0
    data = json.loads((out / "report.json").read_text())
    parts = {p["name"]: p for p in data["parts"]}
    assert parts["train"]["memory"] == {"0": {"peak_used_mib": 52000, "total_mib": 81559, "samples": 3}}
    assert parts["bench"]["log_tail"] == [f"line {i}" for i in range(60, 100)]  # the last 40 lines
    assert "log_tail" not in parts["train"]
    t = data["tests"]
    assert (t["tests"], t["passed"], t["failures"], t["skipped"]) == (4, 2, 1, 1)
    assert t["failed"] == [{"test": "tests.a::bad", "message": "boom"}]
    assert data["train"]["steps_logged"] == 3 and data["train"]["train_runtime_s"] == 42.0
    assert data["ok"] is False and data["environment"]["gpus"] == ["NVIDIA H100 80GB HBM3"]
    md = (out / "report.md").read_text()
    assert "GPU 0: 52000 of 81559" in md and "FAILED `tests.a::bad`: boom" in md
    assert "| 0.3000 | 0.2000 | 3 |" in md  # the third step's loss, first-token TV, step
    assert "vllm absent" in md and "3 steps logged" in md


def test_report_with_the_bench_json(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "parts.tsv").write_text("bench\tpassed\t0\t200\t\n")
    (logs / "bench_vllm_rollout.json").write_text(
        json.dumps(
            {
                "config": {"prompts": 16, "n": 6, "prompt_tokens": 448, "max_new_tokens": 512, "repeats": 3},
                "rows": 192,
                "vllm_median_s": {"vanilla": 8.0, "ncgrpo": 8.08, "sigma0": 8.04},
                "ratio_ncgrpo_over_vanilla": 1.01,
                "paired_ratio_median": 1.005,
                "plugin_in_engine_median_s": {"vanilla": 0.0001, "ncgrpo": 0.004, "sigma0": 0.0002},
                "new_tokens_per_s": {"vanilla": 12288.0, "ncgrpo": 12166.3, "sigma0": 12200.0},
                "speedup_vllm_over_transformers": 9.5,
            }
        )
    )
    assert report.main([str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "192 rows (P = 16, G = 12)" in md and "| NC-GRPO | 8.080 | 12166 | 4.00 |" in md
    assert "NC-GRPO / vanilla: 1.0100 (ratio of medians), 1.0050" in md and "9.50x" in md
    assert json.loads((tmp_path / "report.json").read_text())["ok"] is True


def test_report_needs_the_logs_folder(tmp_path: Path, capsys) -> None:
    assert report.main([str(tmp_path / "nowhere")]) == 2
    assert "gpu_check_report: error:" in capsys.readouterr().err


# ------------------------------------------------------------------------------- model builder
def test_qwen2_5_vl_3b_config_is_the_public_one() -> None:
    """Every value written into the benchmark, and the parameter count of Qwen2.5-VL-3B-Instruct
    (3,754,622,976) from a full-size model on the meta device (no memory)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    c = bench.model_config("qwen2_5_vl_3b")
    t, v = c.text_config, c.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (
        2048,
        36,
        16,
        2,
    )
    assert (t.intermediate_size, t.vocab_size, t.tie_word_embeddings) == (11008, 151936, True)
    assert t.rope_parameters["mrope_section"] == [16, 24, 24] and t.rope_parameters["rope_theta"] == 1e6
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.out_hidden_size) == (
        32,
        1280,
        3420,
        16,
        2048,
    )
    assert (v.fullatt_block_indexes, v.window_size, v.tokens_per_second) == ([7, 15, 23, 31], 112, 2)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(c)
    assert sum(p.numel() for p in model.parameters()) == bench.QWEN2_5_VL_3B_PARAMETERS == 3_754_622_976


def test_builder_at_tiny_scale_saves_and_reloads(tmp_path: Path) -> None:
    """The same builder with tiny overrides: the rest of the 3B's values stay (2 KV heads, tied
    embeddings, windowed vision blocks), the saved folder reloads through the Auto classes with its
    processor at the recipes' pixel budget, and load_or_build reuses it (and refuses another config's)."""
    model, proc = bench.build_model("qwen2_5_vl_3b", **TINY)
    assert model.config.text_config.num_key_value_heads == 2 and model.config.tie_word_embeddings
    assert model.config.vision_config.fullatt_block_indexes == [1]  # the real indexes past depth 2: the last
    folder = tmp_path / "m"
    from ncgrpo.toy.model import save_tiny

    save_tiny(model, proc, folder)
    (folder / "bench_config.json").write_text(json.dumps({"config": "qwen2_5_vl_3b", "seed": 0}))
    again, proc2, where = bench.load_or_build(
        "qwen2_5_vl_3b", str(folder), seed=0, device="cpu", dtype=torch.float32
    )
    assert where == folder
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # the recipes' pixel budget, which vLLM reads from the folder (recipes/README.md, "Images")
    size = proc2.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (262144, 1_000_000)
    from PIL import Image

    grid = proc2.image_processor(images=[Image.new("RGB", (100, 80))], return_tensors="pt")["image_grid_thw"]
    assert (
        int(grid.prod()) * 14 * 14 >= 262144
    )  # a small image is scaled up to min_pixels, as the trainer does
    texts = bench.prompt_texts(proc2.tokenizer, 3, 40)
    assert all(len(proc2.tokenizer(t, add_special_tokens=False)["input_ids"]) >= 40 for t in texts)
    with pytest.raises(SystemExit, match="holds --config qwen2_5_vl_3b seed 0, not tiny seed 0"):
        bench.load_or_build("tiny", str(folder), seed=0, device="cpu", dtype=torch.float32)


def test_bench_arguments() -> None:
    assert bench.parse_args(["--config", "qwen2_5_vl_3b", "--hf-repeats", "0"]).hf_repeats == 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--build-only"])  # needs --model-dir
    with pytest.raises(SystemExit):
        bench.parse_args(["--config", "qwen2_5_vl_7b"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])


# ------------------------------------------------------------------------------- end to end (slow)
@pytest.mark.slow
def test_train_part_end_to_end_on_cpu(tmp_path: Path) -> None:
    """The script's training part for real, on a CPU: a tiny model from the builder where the model part
    would put the 3B one, the transformers engine, 3 steps; the report shows them (~1-2 min here)."""
    work, out = tmp_path / "work", tmp_path / "out"
    model, proc = bench.build_model("qwen2_5_vl_3b", **TINY)
    from ncgrpo.toy.model import save_tiny

    save_tiny(model, proc, work / "qwen2_5_vl_3b_random")
    r = run(
        str(out), "--work", str(work), "--python", sys.executable, "--skip", "tests,model,bench",
        "--train-engine", "transformers", "--quick",
        "--", "--use_cpu", "--bf16", "false", "--min_pixels", "3136", "--max_pixels", "12544",
    )  # fmt: skip
    assert r.returncode == 0, (out / "logs" / "train.log").read_text()[-3000:]
    data = json.loads((out / "report.json").read_text())
    assert data["ok"] and data["train"]["steps_logged"] == 3
    assert [s["step"] for s in data["train"]["steps"]] == [1, 2, 3]
    assert "## 3-step training run" in (out / "report.md").read_text()
