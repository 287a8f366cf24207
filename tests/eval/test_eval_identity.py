"""An evaluation folder holds the answers of one producer (issue 35): the model's weights by content,
the decoding settings, the grader and the benchmark data; a rerun of anything else is refused before
a byte is written, naming each differing field with both values, even when run.json is lost."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ncgrpo.cli import main
from ncgrpo.eval.evaluate import file_sha256, model_id_of, weight_files
from ncgrpo.runs.folder import RECORDS_FILE, RUN_FILE
from ncgrpo.toy.suite import build_suite, export_geo3k
from tiny_models import save_tiny_vl


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """runA/checkpoint-2 and runB/checkpoint-2: the same architecture and file sizes, other seeds."""
    root = tmp_path_factory.mktemp("runs")
    return save_tiny_vl(root / "runA" / "checkpoint-2", seed=0), save_tiny_vl(
        root / "runB" / "checkpoint-2", seed=1
    )


def _suite(out: Path, seed: int) -> Path:
    export_geo3k(build_suite(seed=seed, sizes={"train": 1, "validation": 1, "test": 3}), out)
    return out


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory) -> Path:
    return _suite(tmp_path_factory.mktemp("suite"), 0)


def _eval(model: Path, data: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "eval",
            "--model_name_or_path", str(model),
            "--benchmarks", "synthetic",
            "--data", f"synthetic={data}",
            "--split", "test",
            "--output_dir", str(out),
            "--max_new_tokens", "4",
            "--no_progress",
            "--device", "cpu",
            *extra,
        ]
    )  # fmt: skip


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != ".ncgrpo.lock"
    }


def test_model_id_is_the_weights_content_not_the_folder_name(models, tmp_path) -> None:
    a, b = models
    sizes = [[f.stat().st_size for f in weight_files(m)] for m in models]
    assert sizes[0] == sizes[1]  # what the old id hashed: names and sizes, equal here
    assert a.name == b.name
    assert model_id_of(a) != model_id_of(b)
    copy = shutil.copytree(a, tmp_path / "elsewhere" / "checkpoint-2")
    assert model_id_of(copy) == model_id_of(a)  # a copy is the same model
    w = weight_files(a)[0]
    assert file_sha256(w) == file_sha256(copy / w.name)


def test_how_a_model_was_loaded_is_not_part_of_its_id(models, tmp_path) -> None:
    """save_pretrained copies hub access options into tokenizer_config.json (``local_files_only`` is true
    where the model was saved with HF_HUB_OFFLINE set): the same weights and tokenizer saved in two
    processes must get one id. What changes answers (the chat template) still changes it."""
    a, _ = models
    copy = Path(shutil.copytree(a, tmp_path / "copy" / a.name))
    cfg_file = copy / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["local_files_only"] = not cfg.get("local_files_only", False)
    cfg_file.write_text(json.dumps(cfg, indent=4))
    assert model_id_of(copy) == model_id_of(a)
    cfg["chat_template"] = (cfg.get("chat_template") or "") + "{# another template #}"
    cfg_file.write_text(json.dumps(cfg))
    assert model_id_of(copy) != model_id_of(a)


def test_two_runs_checkpoints_of_one_name_do_not_share_a_folder(models, suite_dir, tmp_path, capsys) -> None:
    a, b = models
    out = tmp_path / "eval"
    assert _eval(a, suite_dir, out, "--limit", "1") == 0
    before = _snapshot(out)
    capsys.readouterr()
    assert _eval(b, suite_dir, out) == 2
    err = capsys.readouterr().err
    assert "ncgrpo eval: error:" in err and "model is " in err
    assert model_id_of(a) in err and model_id_of(b) in err
    assert _snapshot(out) == before  # nothing written


def test_a_retrained_run_is_not_appended_to_its_old_eval(tmp_path, suite_dir, capsys) -> None:
    run = save_tiny_vl(tmp_path / "run", seed=0)
    out = tmp_path / "eval"
    assert _eval(run, suite_dir, out, "--limit", "1") == 0
    old_id = model_id_of(run)
    save_tiny_vl(run, seed=2)  # what train --overwrite leaves: same folder, same file names and sizes
    before = _snapshot(out)
    capsys.readouterr()
    assert _eval(run, suite_dir, out) == 2
    err = capsys.readouterr().err
    assert old_id in err and model_id_of(run) in err and old_id != model_id_of(run)
    assert _snapshot(out) == before


def test_records_name_their_producer_when_run_json_is_lost(models, suite_dir, tmp_path, capsys) -> None:
    a, b = models
    out = tmp_path / "eval"
    assert _eval(a, suite_dir, out, "--limit", "1") == 0
    (out / RUN_FILE).unlink()
    records = (out / RECORDS_FILE).read_bytes()
    capsys.readouterr()
    assert _eval(b, suite_dir, out) == 2
    err = capsys.readouterr().err
    assert "records" in err and model_id_of(a) in err and model_id_of(b) in err
    assert (out / RECORDS_FILE).read_bytes() == records
    assert not (out / RUN_FILE).exists()
    # a grader change is named from the records too
    assert _eval(a, suite_dir, out, "--grader", "mathruler") == 2
    assert "decoding.grader is 'ncgrpo' in the records" in capsys.readouterr().err
    # the same producer completes the folder
    assert _eval(a, suite_dir, out) == 0
    keys = [
        (r["benchmark"], r["question_id"])
        for r in map(json.loads, (out / RECORDS_FILE).read_text().splitlines())
    ]
    assert len(keys) == len(set(keys)) == 18  # 6 families x 3 test questions, each once


def test_changed_benchmark_data_under_the_same_ids_is_refused(models, tmp_path, capsys) -> None:
    a, _ = models
    data = _suite(tmp_path / "data", 0)
    out = tmp_path / "eval"
    assert _eval(a, data, out, "--limit", "2") == 0
    ids = sorted(json.loads(line)["question_id"] for line in (out / RECORDS_FILE).read_text().splitlines())
    shutil.rmtree(data)
    _suite(data, 5)  # other questions, same ids
    before = _snapshot(out)
    capsys.readouterr()
    assert _eval(a, data, out) == 2
    err = capsys.readouterr().err
    assert "not the questions asked now" in err and "prompt_hash" in err and ids[0] in err
    assert _snapshot(out) == before


def test_a_folder_from_before_content_ids_is_not_appended_to(models, suite_dir, tmp_path, capsys) -> None:
    a, _ = models
    out = tmp_path / "eval"
    assert _eval(a, suite_dir, out, "--limit", "1") == 0
    info = json.loads((out / RUN_FILE).read_text())
    del info["model_id_rule"]  # as written before the rule existed
    (out / RUN_FILE).write_text(json.dumps(info))
    capsys.readouterr()
    assert _eval(a, suite_dir, out) == 2
    assert "before model ids hashed the weights' contents" in capsys.readouterr().err


def test_a_cached_hub_model_is_its_revision_s_contents(models, tmp_path, monkeypatch) -> None:
    """A hub id names no weights: its id hashes the cached snapshot, so another revision (the cache
    updated between two evaluations) is another model."""
    import huggingface_hub.constants

    a, b = models
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--tiny"
    assert model_id_of("org/tiny") == "org/tiny"  # not cached here: the id alone
    for rev, src in (("1" * 40, a), ("2" * 40, b)):
        shutil.copytree(src, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    first = model_id_of("org/tiny")
    assert first == f"org/tiny@{model_id_of(a).split('@')[1]}"
    (repo / "refs" / "main").write_text("2" * 40)
    assert model_id_of("org/tiny") not in (first, "org/tiny")


def test_an_adapter_s_id_includes_its_base_model(models, tmp_path) -> None:
    """A PEFT adapter folder holds the adapter only; the model it defines is its base's weights too."""
    a, b = models
    ids = []
    for base in (a, b):
        folder = tmp_path / f"adapter-on-{base.parent.name}" / "run"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
        (folder / "adapter_model.safetensors").write_bytes(b"the same adapter bytes")
        ids.append(model_id_of(folder))
    assert ids[0] != ids[1]
