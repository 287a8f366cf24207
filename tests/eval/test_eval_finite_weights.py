"""``ncgrpo eval`` of a model whose weights hold a NaN (a diverged or damaged checkpoint) is refused
before a record is written (issue 43's hostile pass: it answered every question with one token and was
scored 0, with no word)."""

from __future__ import annotations

from pathlib import Path

import torch

from ncgrpo.cli import main


def test_a_model_with_nan_weights_is_refused_before_any_record(tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    from ncgrpo.toy.suite import build_suite, export_geo3k
    from tiny_models import save_tiny_vl

    suite = tmp_path / "suite"
    export_geo3k(build_suite(seed=0, sizes={"train": 1, "validation": 1, "test": 2}), suite)
    model = save_tiny_vl(tmp_path / "model")
    weights = model / "model.safetensors"
    state = load_file(str(weights))
    name = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, str(weights), metadata={"format": "pt"})
    out = tmp_path / "eval"
    argv = [
        "eval",
        "--model_name_or_path",
        str(model),
        "--benchmarks",
        "synthetic",
        "--data",
        f"synthetic={suite}",
    ]
    assert (
        main([*argv, "--output_dir", str(out), "--no_progress", "--device", "cpu", "--max_new_tokens", "2"])
        == 2
    )
    err = capsys.readouterr().err
    assert "non-finite values" in err and "evaluate an earlier one" in err, err
    assert not (out / "records.jsonl").exists()
