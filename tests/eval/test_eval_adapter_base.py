"""``ncgrpo eval`` of a PEFT adapter whose base model moved (issue 43): the missing base is named,
before the folder's identity is compared (the adapter's id hashes its base, so an existing evaluation
folder used to blame the model id)."""

from __future__ import annotations

import json
from pathlib import Path

from ncgrpo.cli import main


def _adapter(folder: Path, base: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    (folder / "adapter_model.safetensors").write_bytes(b"an adapter")
    return folder


def test_an_adapter_whose_base_moved_names_the_base_in_an_existing_eval_folder(
    tmp_path: Path, capsys
) -> None:
    from ncgrpo.toy.suite import build_suite, export_geo3k

    suite = tmp_path / "suite"
    export_geo3k(build_suite(seed=0, sizes={"train": 1, "validation": 1, "test": 2}), suite)
    run = _adapter(tmp_path / "run", tmp_path / "moved-base")
    out = tmp_path / "eval"
    out.mkdir()
    info = {"kind": "eval", "model": str(run), "model_id": "run@0123456789ab", "benchmarks": ["synthetic"]}
    (out / "run.json").write_text(json.dumps(info))
    (out / "records.jsonl").write_text("")
    before = (out / "run.json").read_bytes()
    argv = [
        "eval",
        "--model_name_or_path",
        str(run),
        "--benchmarks",
        "synthetic",
        "--data",
        f"synthetic={suite}",
    ]
    assert main([*argv, "--output_dir", str(out), "--no_progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "the adapter's base model" in err and "moved-base" in err and "base_model_name_or_path" in err, err
    assert "another evaluation" not in err
    assert (out / "run.json").read_bytes() == before
