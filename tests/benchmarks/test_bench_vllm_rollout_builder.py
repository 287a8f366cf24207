"""benchmarks/bench_vllm_rollout.py's Qwen2.5-VL-3B-sized model builder, checked on a CPU: against the
public config (full size on the meta device) and at tiny scale (built, saved and reloaded). Moved here
from tests/test_gpu_check.py when the GPU check stopped using it (the lent machine has no vLLM)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vllm_rollout as bench  # noqa: E402

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
