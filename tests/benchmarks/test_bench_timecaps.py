"""The benchmarks' time caps and the GPU figures they add (benchmarks/bench_rollout.py, bench_train.py,
bench_loss_share.py): a cap cuts the repeats short and the summary still prints with what ran, and the
decode roofline's byte count. Tiny models on the CPU, a few seconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_loss_share  # noqa: E402
import bench_rollout  # noqa: E402
import bench_train  # noqa: E402


def test_deadline_fractions_with_a_fake_clock() -> None:
    now = [100.0]
    d = bench_rollout.Deadline(10.0, clock=lambda: now[0])
    assert d.left(0.6) == pytest.approx(6.0) and d.fits(0.6, 5.9) and not d.fits(0.6, 6.1)
    now[0] = 108.0
    assert d.left() == pytest.approx(2.0) and not d.fits(0.8, 0.1)
    assert bench_rollout.Deadline(0.0).left() == float("inf")  # no cap


@pytest.mark.parametrize(
    "argv",
    [["--build-only"], ["--time-cap", "-1"], ["--repeats", "0"]],
)
def test_rollout_arguments_refused(argv) -> None:
    with pytest.raises(SystemExit):
        bench_rollout.parse_args(argv)


def test_decode_roofline_counts_language_weights_and_kv() -> None:
    from ncgrpo.toy.model import tiny_qwen2_5_vl

    model = tiny_qwen2_5_vl(seed=0)
    visual = sum(p.numel() for p in model.model.visual.parameters())
    total = sum(p.numel() for p in model.parameters())
    t = model.config.get_text_config()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    r = bench_rollout.decode_roofline(model, rows=6, prompt_tokens=100, new_tokens=20, bandwidth=1e9)
    assert r["weight_bytes"] == 4 * (total - visual)  # float32, the vision tower not read by decode
    assert r["kv_bytes_mean"] == 2 * t.num_hidden_layers * t.num_key_value_heads * head_dim * 4 * 6 * 110
    assert r["floor_s_per_step"] == pytest.approx((r["weight_bytes"] + r["kv_bytes_mean"]) / 1e9)
    assert bench_rollout.decode_roofline(model, 6, 100, 20, None)["floor_s_per_step"] is None
    assert bench_rollout.hbm_bandwidth(torch.device("cpu")) is None


def test_rollout_cap_cuts_the_repeats_and_the_summary_prints(tmp_path: Path, capsys) -> None:
    """A 1-second cap on 50 repeats: at least one repeat of every arm runs, the cut is recorded and said,
    the summary table and the per-arm throughput lines print, the JSON is written."""
    out = tmp_path / "r.json"
    r = bench_rollout.main(
        ["--size", "tiny", "--prompts", "1", "--n", "1", "--max-new-tokens", "2", "--repeats", "50",
         "--time-cap", "1", "--threads", "1", "--out", str(out)]
    )  # fmt: skip
    assert 1 <= r["repeats_done"] < 50 and r["cut_by_time_cap"]
    assert set(r["median_s"]) == {"vanilla", "ncgrpo", "ncgrpo_noshare"}
    printed = capsys.readouterr().out
    assert "# cut by --time-cap 1s: repeats:" in printed and "NC-GRPO, shared prefill" in printed
    assert "new tokens/s, decode" in printed
    assert json.loads(out.read_text())["new_tokens_per_s"]["vanilla"] > 0


def test_build_only_saves_the_model(tmp_path: Path) -> None:
    r = bench_rollout.main(["--size", "tiny", "--build-only", "--save-model", str(tmp_path / "m")])
    assert r["saved"] == str(tmp_path / "m") and (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "m" / "processor_config.json").exists()


def test_train_paired_ratio_skips_rounds_the_cap_cut() -> None:
    def run(method, rnd, walls):
        return {"method": method, "round": rnd, "steps": [{"wall": 9.0}] + [{"wall": w} for w in walls]}

    runs = [run("vanilla", 0, [2.0]), run("latent", 0, [2.2]), run("latent", 1, [5.0])]  # round 1 cut
    assert bench_train.paired_ratio(runs, "latent", "wall") == pytest.approx(1.1)
    args = bench_train.parse_args(["--time-cap", "30", "--size", "1.5b"])
    assert args.time_cap == 30 and args.size == "1.5b"
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--time-cap", "-2"])


def test_loss_share_inputs_move_to_the_device_in_the_dtype() -> None:
    x = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "adv": torch.ones(2),
        "C": 2,
        "mm": {"pixel_values": torch.ones(4, 5), "num_images": [1, 1]},
    }
    y = bench_loss_share.to_device(x, torch.device("cpu"), torch.bfloat16)
    assert y["input_ids"].dtype == torch.long and y["adv"].dtype == torch.bfloat16
    assert y["mm"]["pixel_values"].dtype == torch.bfloat16 and y["mm"]["num_images"] == [1, 1] and y["C"] == 2
    assert set(bench_loss_share._towers()) == {"proxy", "0.5b", "1.5b"}
