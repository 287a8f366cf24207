"""A new user's text-only path from the command line (issue 44): a text-only causal LM, a JSONL file of
their own with TRL's ``prompt`` column, and a reward function of their own by import path, through
``ncgrpo train`` (``--dry-run`` checks included) and ``ncgrpo probe``. The model is a tiny Qwen3 made
here and saved as the hub lays a model out (config, weights, tokenizer with its chat template)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from ncgrpo.cli import main

#: A reward of the user's own, as TRL documents them: the data's column ``solution`` as a keyword. It
#: records the keywords it was called with, so the test sees what TRL passed.
REWARDS = """
import json, os

def exact(prompts, completions, solution, **kwargs):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"keys": sorted(kwargs), "prompt": prompts[0], "completion": completions[0],
                            "solution": solution}) + "\\n")
    # conversational data: each completion is one assistant message
    return [1.0 + float(len(str(s))) if c[0]["role"] == "assistant" else 0.0
            for c, s in zip(completions, solution)]

def no_kwargs(completions):
    return [0.0] * len(completions)

def needs_unknown(prompts, completions, reference, **kwargs):
    return [0.0] * len(completions)

not_a_function = 3

def broken():
    pass
"""


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny text-only Qwen3 causal LM saved like a hub checkpoint (no vision_config, a tokenizer)."""
    from tiny_models import build_tokenizer, save_tiny, tiny_text_model

    tok = build_tokenizer()
    folder = tmp_path_factory.mktemp("textlm") / "tiny-qwen3"
    save_tiny(tiny_text_model("qwen3", tokenizer=tok), tok, folder)
    assert "vision_config" not in json.loads((folder / "config.json").read_text())
    return folder


def _rows(n: int = 8) -> list[dict]:
    rows = []
    for i in range(n):
        prompt = f"What is {i} + {i + 1}?"
        if i % 2:  # TRL's two prompt forms in one file: a string and chat messages
            prompt = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}]
        rows.append({"prompt": prompt, "solution": str(2 * i + 1), "level": i % 3})
    return rows


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's folder: data.jsonl and a rewards module (a name unique to the test, imported from
    the current directory as TRL's script imports it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    (tmp_path / f"{_module(tmp_path)}.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "reward_log.jsonl"))
    return tmp_path


def _module(folder: Path) -> str:
    return "user_rewards_" + "".join(c for c in folder.name if c.isalnum())


def _train_argv(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--model_name_or_path", str(model), "--output_dir", str(out),
        "--num_generations", "4", "--per_device_train_batch_size", "4", "--max_steps", "2",
        "--max_completion_length", "8", "--bf16", "false", "--dtype", "float32", "--use_cpu",
        "--schedule_k_mid", "1", "--logging_steps", "1", "--report_to", "none", *extra,
    ]  # fmt: skip


def test_train_on_own_jsonl_with_own_reward_from_the_cli(text_model, workdir, capsys) -> None:
    out = workdir / "run"
    reward = f"{_module(workdir)}.exact"
    argv = _train_argv(text_model, out, "--dataset_name", "data.jsonl", "--reward_funcs", reward)
    assert main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    assert "8 training prompts" in capsys.readouterr().out
    assert not (workdir / "reward_log.jsonl").exists()  # the dry run imports the reward, never calls it
    assert main(argv) == 0, capsys.readouterr().err
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    means = [r["rewards/exact/mean"] for r in metrics if "rewards/exact/mean" in r]
    assert len(means) == 2 and min(means) >= 2.0  # 1 + len(solution) >= 2: the reward ran on the column
    calls = [json.loads(x) for x in (workdir / "reward_log.jsonl").read_text().splitlines()]
    assert calls
    for call in calls:
        # TRL's keywords and the file's other columns; the prompt column is the prompt, not a keyword
        assert {"level", "completion_ids", "trainer_state"} <= set(call["keys"]) and "prompt" not in call[
            "keys"
        ]
        assert call["prompt"][-1]["role"] == "user" and call["prompt"][-1]["content"].startswith("What is")
        assert call["completion"][0]["role"] == "assistant"
    run = json.loads((out / "run.json").read_text())
    assert run["finished"] and run["identity"]["dataset_name"] == "data.jsonl"
    from ncgrpo.data.files import file_sha256

    assert run["identity"]["dataset_sha256"] == file_sha256(workdir / "data.jsonl")


def test_data_file_settings_are_read_as_trl_reads_them(tmp_path: Path) -> None:
    """prompt_column / answer_column / system_prompt / math_prompt on a file's rows; .json and
    .parquet read like .jsonl."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ncgrpo.data.files import read_data_file

    rows = [{"question": "Q1?", "final": 7, "id": "a"}, {"question": "Q2?", "final": 9, "id": "b"}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.json", "d.parquet"):
        data = read_data_file(tmp_path / name, "question")
        ds = data.to_trl_dataset(system_prompt="Be brief.", math_prompt="Box it.", answer_column="final",
                                 answer_text=True)  # fmt: skip
        assert ds[0]["prompt"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Q1? Box it."},
        ]
        # the column the built-in rewards read, as text; every other column kept under its own name
        assert ds[1]["answer"] == "9" and ds[1]["final"] == 9 and "question" not in ds.column_names
    # as written, nothing appended, when no prompt setting is given (TRL)
    plain = read_data_file(tmp_path / "d.json", "question").to_trl_dataset()
    assert plain[0]["prompt"] == [{"role": "user", "content": "Q1?"}] and "answer" not in plain.column_names


@pytest.mark.parametrize(
    ("content", "flags", "message"),
    [
        ("", [], "data.jsonl: the file holds no rows"),
        ('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": 2\n', [], "data.jsonl line 3: not valid JSON"),
        ('{"question": "a", "answer": "1"}\n', [], "data.jsonl line 1 has no prompt column 'prompt' (its columns: question, answer); name the column holding the prompt with --prompt_column"),
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "  ", "answer": "1"}\n', [], "data.jsonl line 2: the prompt column 'prompt' is empty"),
        ('{"prompt": [{"content": "a"}], "answer": "1"}\n', [], "data.jsonl line 1: the prompt column 'prompt' has a message (0) that is not"),
        ('{"prompt": "a", "solution": "1"}\n', [], "data.jsonl line 1 has no column 'answer' (the gold answer that math_reward reads; name the column holding it with --answer_column)"),
        ('{"prompt": "a", "solution": "1"}\n', ["--answer_column", "final"], "data.jsonl line 1 has no column 'final'"),
        ('{"prompt": "a", "answer": "1", "images": []}\n', [], "column 'images' is the trainer's own"),
        ('[1, 2]', ["--dataset_name", "data.json"], "data.json row 0: a row must be a JSON object"),
        ('{"prompt": "a"}', ["--dataset_name", "data.json", "--dataset_train_split", "test"], "dataset_train_split 'test': dataset_name data.json is a data file"),
        ('{"prompt": "a"}', ["--dataset_name", "data.jsonl", "--dataset_path", "x"], "dataset_path 'x' is for geo3k / synthetic"),
        ('{"prompt": "a"}', ["--dataset_name", "nothere.jsonl"], "dataset_name nothere.jsonl: no such file"),
        ('{"prompt": "a"}', ["--dataset_name", "geo4k"], "dataset_name 'geo4k' (did you mean 'geo3k'?): not a built-in dataset (geo3k, synthetic, gsm8k, math500)"),
    ],
    ids=["empty", "bad-json-line", "no-prompt-column", "empty-prompt", "message-without-role", "no-answer",
         "no-answer-column", "reserved-column", "json-not-objects", "split", "dataset-path", "missing-file",
         "typo"],  # fmt: skip
)  # fmt: skip
def test_bad_data_file_is_refused_at_dry_run_naming_file_line_and_column(
    text_model, workdir, capsys, content, flags, message
) -> None:
    name = "data.json" if "data.json" in flags else "data.jsonl"
    (workdir / name).write_text(content)
    out = workdir / "run"
    flags = flags if "--dataset_name" in flags else ["--dataset_name", name, *flags]
    assert main([*_train_argv(text_model, out, *flags), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo train: error: ") and message in err, err
    assert "Traceback" not in err and not out.exists()  # nothing written


@pytest.mark.parametrize(
    ("func", "message"),
    [
        ("nowhere_module.exact", "cannot import module 'nowhere_module' (no module named 'nowhere_module'); it must be importable from the current directory"),
        ("{m}.exactt", "defines no 'exactt' (did you mean '{m}.exact'?)"),
        ("{m}.not_a_function", "is a int, not a function"),
        ("{m}.no_kwargs", "it takes no **kwargs, so TRL's keyword(s) prompts, completion_ids"),
        ("{m}.needs_unknown", "it requires 'reference', which is neither a column of the data (solution, level)"),
        ("{m}.broken", "it takes no **kwargs"),
        ("math_rewrd", "unknown reward function 'math_rewrd' (did you mean 'math_reward'?)"),
    ],
    ids=["not-importable", "no-such-function", "not-callable", "no-kwargs", "unknown-column", "no-args", "typo"],
)  # fmt: skip
def test_bad_reward_function_is_refused_at_dry_run(text_model, workdir, capsys, func, message) -> None:
    m = _module(workdir)
    out = workdir / "run"
    argv = _train_argv(text_model, out, "--dataset_name", "data.jsonl", "--reward_funcs", func.format(m=m))
    assert main([*argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo train: error: reward_funcs") and message.format(m=m) in err, err
    assert not out.exists()


def test_a_resume_on_a_changed_data_file_is_refused(text_model, workdir, capsys) -> None:
    out = workdir / "run"
    reward = f"{_module(workdir)}.exact"
    argv = _train_argv(text_model, out, "--dataset_name", "data.jsonl", "--reward_funcs", reward,
                       "--save_strategy", "steps", "--save_steps", "1")  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    info = json.loads((out / "run.json").read_text())  # as if killed after its checkpoint, before the end
    (out / "run.json").write_text(json.dumps({**info, "finished": False}))
    assert main([*argv, "--resume", "--dry-run"]) == 0, capsys.readouterr().err  # same file: resumes
    rows = _rows()
    rows[0]["solution"] = "2"  # one gold answer changed, same path
    (workdir / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([*argv, "--resume", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "settings that change the run" in err and "dataset_sha256" in err, err


def test_probe_on_own_jsonl_with_own_reward(text_model, workdir, capsys) -> None:
    out = workdir / "probe.json"
    reward = f"{_module(workdir)}.exact"
    argv = [
        "probe", "--model_name_or_path", str(text_model), "--data", "mine=data.jsonl", "--reward_funcs", reward,
        "--prompts", "4", "--rollouts", "2", "--sigma0", "0", "0.5", "--max_completion_length", "6",
        "--marginal_draws", "16", "--no_progress", "--device", "cpu", "--output_file", str(out),
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["n_prompts"] == 4 and [r["sigma"] for r in result["rows"]] == [0.0, 0.5]
    # the first 4 solutions are 1, 3, 5, 7: the reward is 1 + len = 2 on every rollout, clean and noisy
    assert all(r["reward_clean"] == 2.0 and r["reward_noisy"] == 2.0 for r in result["rows"])
    calls = [json.loads(x) for x in (workdir / "reward_log.jsonl").read_text().splitlines()]
    assert calls and all({"level", "trainer_state"} <= set(c["keys"]) for c in calls)
    # the prompts as the file gives them: a string as one user message, the messages as written
    assert {c["prompt"][0]["role"] for c in calls} <= {"user", "system"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--benchmark", "mine"], "--benchmark 'mine': unknown; known: synthetic, geo3k"),
        (["--data", "mine=data.jsonl", "--prompt_column", "question"], "data.jsonl line 1 has no prompt column 'question'"),
        (["--data", "mine=data.jsonl"], "data.jsonl line 1 has no column 'answer' (the gold answer that math_reward reads"),
        (["--data", "data.jsonl", "--reward_funcs", "{m}.no_kwargs"], "it takes no **kwargs"),
        (["--benchmark", "other", "--data", "mine=data.jsonl"], "two names for one benchmark"),
    ],
    ids=["unknown-benchmark", "prompt-column", "answer", "reward-signature", "two-names"],
)  # fmt: skip
def test_probe_refuses_bad_own_data_before_the_model_loads(
    text_model, workdir, capsys, monkeypatch, flags, message
):
    import ncgrpo.models

    def no_load(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(ncgrpo.models, "load_model_and_processor", no_load)
    m = _module(workdir)
    argv = [
        "probe",
        "--model_name_or_path",
        str(text_model),
        "--no_progress",
        *[f.format(m=m) for f in flags],
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo probe: error: ") and message in err, err


def test_eval_on_own_jsonl_with_trl_prompt_column(text_model, workdir, capsys) -> None:
    """ncgrpo eval reads the same file: TRL's prompt column (a string or messages) rendered as written,
    graded against its answer column; a bad prompt is refused naming the file, row and field."""
    from ncgrpo.data.prompts import prompt_hash

    rows = [{"prompt": "What is 1 + 1?", "answer": "2"},
            {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]  # fmt: skip
    (workdir / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = workdir / "eval"
    argv = ["eval", "--model_name_or_path", str(text_model), "--data", "mine=test.jsonl", "--output_dir", str(out),
            "--max_new_tokens", "4", "--device", "cpu", "--no_progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert [r["benchmark"] for r in records] == ["mine", "mine"] and [r["gold"] for r in records] == [
        "2",
        "4",
    ]
    # as written: one user message each, no math prompt appended
    assert [r["prompt_hash"] for r in records] == [
        prompt_hash([{"role": "user", "content": "What is 1 + 1?"}]),
        prompt_hash([{"role": "user", "content": "What is 2 + 2?"}]),
    ]
    (workdir / "bad.jsonl").write_text('{"prompt": "", "answer": "1"}\n')
    argv = ["eval", "--model_name_or_path", str(text_model), "--data", "bad=bad.jsonl", "--output_dir",
            str(workdir / "eval2"), "--device", "cpu", "--no_progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "row 0" in err and "field 'prompt' is empty" in err, err


def test_an_own_eval_file_is_one_evaluation_set(text_model, workdir, capsys) -> None:
    """--eval_dataset_name FILE: the whole file is evaluated during training (no splits); splits with it,
    or with a training data file, are refused naming what to do."""
    (workdir / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(3)))
    reward = f"{_module(workdir)}.exact"
    argv = _train_argv(text_model, workdir / "run", "--dataset_name", "data.jsonl", "--reward_funcs", reward,
                       "--eval_dataset_name", "val.jsonl", "--eval_strategy", "steps", "--eval_steps", "1",
                       "--per_device_eval_batch_size", "4")  # fmt: skip
    assert main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    assert "8 training prompts, 3 eval prompts" in capsys.readouterr().out
    assert main([*argv, "--eval_dataset_splits", "validation", "--dry-run"]) == 2
    assert "eval_dataset_name val.jsonl is a data file, evaluated whole" in capsys.readouterr().err
    argv = _train_argv(text_model, workdir / "run2", "--dataset_name", "data.jsonl", "--reward_funcs", reward)
    assert main([*argv, "--eval_dataset_splits", "validation", "--dry-run"]) == 2
    assert "evaluate on a file of your own with --eval_dataset_name FILE" in capsys.readouterr().err
