"""Every example claims its ``--output_dir`` as the commands claim theirs (issue 43): the folder lock,
and a folder of another kind, or one holding anything but the script's own earlier output, is refused
with a usage error before anything is written (``python examples/lora.py --output_dir RUN`` used to
replace a finished training run's adapter; ``--output_dir ''`` and a file ended in a traceback)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ncgrpo.runs.folder import claim_script_folder, finish_script_folder

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def _main(script: str):
    spec = importlib.util.spec_from_file_location(f"example_{script[:-3]}", ROOT / "examples" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _refused(script: str, out: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        _main(script)(["--output_dir", out])
    assert e.value.code == 2
    return capsys.readouterr().err


def _finished_train_run(out: Path) -> dict[str, bytes]:
    out.mkdir()
    (out / "run.json").write_text(
        json.dumps({"kind": "train", "name": "mine", "finished": True, "global_step": 60})
    )
    (out / "adapter_model.safetensors").write_bytes(b"the run's adapter")
    (out / "config.yaml").write_text("sigma0: 0.2\n")
    return {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("script", EXAMPLES)
def test_an_example_refuses_a_finished_training_run_an_empty_path_and_a_file(
    tmp_path: Path, capsys, script: str
) -> None:
    run = tmp_path / "run"
    before = _finished_train_run(run)
    err = _refused(script, str(run), capsys)
    assert "error:" in err and str(run) in err and "pass " in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # not even a lock file
    assert "error: --output_dir is empty" in _refused(script, "", capsys)
    (tmp_path / "a-file").write_text("mine")
    assert "is a file, not a folder" in _refused(script, str(tmp_path / "a-file"), capsys)
    assert (tmp_path / "a-file").read_text() == "mine"


def test_an_example_refuses_a_folder_of_other_files(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("mine")
    with pytest.raises(
        ValueError, match="already holds files README.md, which examples/lora.py did not write"
    ):
        claim_script_folder(tmp_path, "examples/lora.py", kind="train")


def test_an_example_may_write_its_own_earlier_output_again(tmp_path: Path) -> None:
    out = tmp_path / "out"
    finish_script_folder(claim_script_folder(out, "examples/lora.py", kind="train"), global_step=4)
    info = json.loads((out / "run.json").read_text())
    assert info == {
        "kind": "train",
        "script": "examples/lora.py",
        "name": "examples/lora.py",
        "finished": True,
        "global_step": 4,
    }
    (out / "adapter_model.safetensors").write_bytes(b"x")
    lock = claim_script_folder(out, "examples/lora.py", kind="train")  # a rerun of the same script
    lock.release()
    with pytest.raises(ValueError, match="did not write"):  # another script is refused
        claim_script_folder(out, "examples/own_data_and_reward.py", kind="train")


def test_ncgrpo_train_refuses_a_finished_example_run(tmp_path: Path, capsys) -> None:
    from ncgrpo.cli import main
    from test_train_cli import MODEL, TINY_RECIPE

    out = tmp_path / "out"
    finish_script_folder(claim_script_folder(out, "examples/lora.py", kind="train"), global_step=4)
    argv = ["train", "--config", str(TINY_RECIPE), "--model_name_or_path", MODEL, "--output_dir", str(out)]
    assert main([*argv, "--dry-run"]) == 2
    assert "holds a finished run ('examples/lora.py', 4 steps)" in capsys.readouterr().err


def test_an_example_refuses_a_folder_another_process_writes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from ncgrpo.runs.folder import FolderLock; "
            f"FolderLock({str(out)!r}, 'ncgrpo train', kind='train').acquire(); print('held', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="being written by another process"):
            claim_script_folder(out, "examples/lora.py", kind="train")
    finally:
        holder.kill()
        holder.wait()
