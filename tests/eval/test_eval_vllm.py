"""``ncgrpo eval --engine vllm`` against the transformers engine, and killed mid-run (marker ``vllm``;
run in .venv-vllm, see scripts/setup_vllm.sh)::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -m vllm -p no:cacheprovider tests/eval/test_eval_vllm.py

The model is the vLLM suite's tiny Qwen2 text model (head_dim 64, float32) with its LM head scaled
20x (``save_peaked_vllm_text_model``), so argmax margins are wide and both engines' greedy tokens are
well defined. The questions are image-free (HallusionBench's ``non_image`` layout). Three vLLM engines
start (one in this process, two ``ncgrpo eval`` processes): about 2-3 minutes on 2 CPU cores.

The image questions run on a tiny Qwen2.5-VL (tests/vlm_fixtures.py), one more engine (about 1-2
minutes); that test needs the torchvision scripts/setup_vllm.sh installs and is skipped without it.
The prompts the vLLM engine builds are also checked without vLLM in tests/eval/test_evaluate.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from ncgrpo import cli  # noqa: E402
from ncgrpo.eval.evaluate import DecodingSettings, evaluate, load_for_eval, model_id_of  # noqa: E402
from ncgrpo.eval.records import read_records  # noqa: E402
from ncgrpo.eval.vllm_engine import greedy_sampling_params, vllm_prompts  # noqa: E402
from ncgrpo.runs.folder import RECORDS_FILE  # noqa: E402
from tiny_models import save_peaked_vllm_text_model  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
MAX_NEW = 24


def write_questions(path: Path, n: int) -> Path:
    """``n`` distinct image-free questions in HallusionBench's layout (read with ``--split non_image``)."""
    rows = [
        {"question": f"Is {i} plus {3 * i + 1} equal to {4 * i + 1 + i % 2}?", "gt_answer": str(1 - i % 2),
         "category": "math", "subcategory": "add", "set_id": "0", "figure_id": str(i // 10),
         "question_id": str(i), "visual_input": "0"}
        for i in range(n)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def argv(model: Path, data: Path, out: Path, engine: str, *extra: str) -> list[str]:
    return [
        "eval", "--model_name_or_path", str(model), "--benchmarks", "hallusionbench",
        "--data", f"hallusionbench={data}", "--split", "non_image", "--output_dir", str(out),
        "--max_new_tokens", str(MAX_NEW), "--dtype", "float32", "--engine", engine, "--no_progress", *extra,
    ]  # fmt: skip


def questions_of(data: Path):
    from ncgrpo.eval.questions import load_questions

    return load_questions(["hallusionbench"], {"hallusionbench": data}, "non_image", None)


def comparable(path: Path) -> dict[tuple[str, str], dict]:
    """Each question's record as a dict, but for the engine and the batch size its decoding names (the
    fields that may differ between two evaluations of the same outputs)."""
    out = {}
    for r in read_records(path):
        d = dict(r.__dict__)
        d["decoding"] = {k: v for k, v in d["decoding"].items() if k not in ("engine", "batch_size")}
        out[r.key] = d
    return out


def assert_same_records(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    diff = [(k, f, got[k][f], want[k][f]) for k in want for f in want[k] if got[k][f] != want[k][f]]
    assert not diff, f"{len(diff)} field(s) differ, first: {diff[:3]}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path, _ = save_peaked_vllm_text_model(tmp_path_factory.mktemp("peaked_qwen2"))
    return Path(path)


@pytest.fixture(scope="module")
def engine(model_dir):
    # VLLM_CPU_KVCACHE_SPACE (set by the trainer test modules when pytest imports them) would override
    # the KV cache the loader sizes for these questions
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        eng, processor = load_for_eval(
            model_dir, engine="vllm", dtype="float32", settings=DecodingSettings(max_new_tokens=MAX_NEW, batch_size=4),
            questions=questions_of(write_questions(model_dir.parent / "q.jsonl", 40)),
        )  # fmt: skip
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved
    yield eng, processor
    eng.close()


def test_vllm_records_equal_transformers_records_question_by_question(
    engine, model_dir, tmp_path, capsys
) -> None:
    eng, processor = engine
    data = write_questions(tmp_path / "q.jsonl", 12)
    questions = questions_of(data)
    ident = dict(
        model_id=model_id_of(model_dir), split={"hallusionbench": "non_image"}, benchmarks=["hallusionbench"]
    )
    settings = DecodingSettings(max_new_tokens=MAX_NEW, batch_size=4)
    got = evaluate(eng, processor, questions, tmp_path / "vllm", settings=settings, progress=False, **ident)
    assert got.newly_recorded == 12
    assert json.loads((tmp_path / "vllm" / "run.json").read_text())["engine"] == "vllm"
    # the transformers engine, through the command line, in float32
    assert (
        cli.main(
            argv(model_dir, data, tmp_path / "tf", "transformers", "--batch_size", "4", "--device", "cpu")
        )
        == 0
    )
    v, t = comparable(tmp_path / "vllm" / RECORDS_FILE), comparable(tmp_path / "tf" / RECORDS_FILE)
    assert len(t) == 12
    assert_same_records(v, t)
    # the comparison has teeth: outputs are long and not all alike
    outputs = [r["output"] for r in t.values()]
    assert len(set(outputs)) > 1 and min(map(len, outputs)) > 0
    assert {r.decoding["engine"] for r in read_records(tmp_path / "vllm" / RECORDS_FILE)} == {"vllm"}
    # a rerun on the other engine into the vLLM folder is refused before the model loads
    capsys.readouterr()
    assert cli.main(argv(model_dir, data, tmp_path / "vllm", "transformers", "--device", "cpu")) == 2
    assert "engine is 'vllm' there, 'transformers' now" in capsys.readouterr().err
    assert comparable(tmp_path / "vllm" / RECORDS_FILE) == v


def test_greedy_tokens_are_identical_to_transformers_generate(engine, model_dir) -> None:
    """Token for token, unbatched transformers ``generate`` (no padding) against the vLLM engine."""
    from transformers import AutoModelForCausalLM

    eng, processor = engine
    questions = questions_of(write_questions(model_dir.parent / "q6.jsonl", 6))
    settings = DecodingSettings(max_new_tokens=MAX_NEW)
    prompts = vllm_prompts(processor, questions, settings, vision_language=False)
    params = greedy_sampling_params(eng.generation_config, processor, settings)
    outs = eng.llm.generate(prompts, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, o in zip(prompts, outs, strict=True):
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():
            ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                              max_new_tokens=MAX_NEW, temperature=None, top_p=None, top_k=None)  # fmt: skip
        assert list(o.outputs[0].token_ids) == ref[0, ids.shape[1] :].tolist()


def _complete_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


def test_killed_then_rerun_on_vllm_records_every_question_once(model_dir, tmp_path) -> None:
    """SIGKILL (the whole process group: the eval and vLLM's engine processes) once N records are on
    disk, then rerun: every question recorded exactly once, with the transformers engine's outcome."""
    n, kill_after = 40, 3
    data = write_questions(tmp_path / "q.jsonl", n)
    out = tmp_path / "killed"
    records = out / RECORDS_FILE
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    cmd = [sys.executable, "-m", "ncgrpo", *argv(model_dir, data, out, "vllm", "--batch_size", "2")]
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.time() + 400
    try:
        while len(_complete_lines(records)) < kill_after:
            assert p.poll() is None, f"eval ended before the kill: {p.stderr.read().decode()[-3000:]}"
            assert time.time() < deadline, "no records after 400 s"
            time.sleep(0.02)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
    at_kill = _complete_lines(records)
    assert kill_after <= len(at_kill) < n, f"{len(at_kill)} of {n} recorded: the kill did not land mid-run"
    keys = [(r["benchmark"], r["question_id"]) for r in at_kill]
    assert len(keys) == len(set(keys))

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    new = re.search(r"\((\d+) new of (\d+)\)", " ".join(rerun.stdout.split()))
    assert new and (int(new[1]), int(new[2])) == (n - len(at_kill), n), rerun.stdout
    rows = _complete_lines(records)
    keys = [(r["benchmark"], r["question_id"]) for r in rows]
    assert len(rows) == n and len(set(keys)) == n
    assert records.read_bytes().endswith(b"\n")
    # the records of the killed-and-rerun vLLM eval are the uninterrupted transformers eval's
    assert (
        cli.main(
            argv(model_dir, data, tmp_path / "tf", "transformers", "--batch_size", "8", "--device", "cpu")
        )
        == 0
    )
    assert_same_records(comparable(records), comparable(tmp_path / "tf" / RECORDS_FILE))


def test_vlm_records_equal_transformers_records(tmp_path, capsys) -> None:
    """Image questions on a tiny Qwen2.5-VL (LM head scaled 20x), both engines through the command
    line: vLLM gets the rendered chat text with one placeholder per image and the images as
    ``multi_modal_data`` and must answer as transformers does, record for record. Needs torchvision,
    which scripts/setup_vllm.sh installs (on a CPU-only torch without its C++ operators)."""
    pytest.importorskip("torchvision")
    from ncgrpo.toy.suite import build_suite, export_geo3k
    from tiny_models import save_tiny, tiny_qwen2_5_vl
    from vlm_fixtures import VLLM_VL_SIZES, WINDOW_SIZE, vllm_vl_processor

    proc = vllm_vl_processor()
    model = tiny_qwen2_5_vl(processor=proc, seed=0, window_size=WINDOW_SIZE, **VLLM_VL_SIZES)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model_dir = save_tiny(model, proc, tmp_path / "vl")
    suite = tmp_path / "suite"
    export_geo3k(build_suite(seed=0, sizes={"train": 1, "validation": 1, "test": 6}), suite)
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        for engine in ("vllm", "transformers"):
            args = ["eval", "--model_name_or_path", str(model_dir), "--benchmarks", "synthetic", "--data",
                    f"synthetic={suite}", "--split", "test", "--output_dir", str(tmp_path / engine),
                    "--max_new_tokens", "12", "--dtype", "float32", "--engine", engine, "--batch_size", "3",
                    "--no_progress"]  # fmt: skip
            assert cli.main(args) == 0, capsys.readouterr().err[-3000:]
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved
    v, t = comparable(tmp_path / "vllm" / RECORDS_FILE), comparable(tmp_path / "transformers" / RECORDS_FILE)
    assert len(t) >= 6
    assert_same_records(v, t)
    assert len({r["output"] for r in t.values()}) > 1
