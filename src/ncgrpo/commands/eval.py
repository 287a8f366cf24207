"""``ncgrpo eval``: greedy, noise-free evaluation with crash-safe per-question records.

Options are the fields of :class:`EvalArgs` (``--config FILE.yaml`` and/or one ``--flag`` per field,
see ``ncgrpo.commands._common``). Every option is checked before the model is loaded and
before anything is written: a bad value leaves no run folder behind.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ncgrpo.commands._common import UsageError, add_dataclass_command
from ncgrpo.data.prompts import MATH_PROMPT_HELP
from ncgrpo.data.types import MATH_PROMPT
from ncgrpo.runs.folder import CONFIG_FILE, FolderLock, folder_kind, read_run_json

HELP = "evaluate a model greedily on benchmarks; one JSONL record per question (resumable)"
DESCRIPTION = (
    HELP
    + ". Rerunning into the same --output_dir completes it: recorded questions are skipped. A folder holds "
    "one model (by its weights' contents), engine, checkpoint, seed, split, benchmark set and decoding setting "
    "(run.json, and each record); only the batch size may change between reruns, and a recorded question must "
    "be the one asked again. One writer per folder at a time (an advisory lock)."
)


def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class EvalArgs:
    """Options of ``ncgrpo eval`` (checked in ``__post_init__``)."""

    model_name_or_path: str = field(
        metadata=_h(
            "model folder (save_pretrained layout), cached hub id, or a training run's folder (ncgrpo train's or "
            "NCGRPOTrainer's, or one of its "
            "checkpoint-N folders): its name, method and seed are then the defaults of --name, "
            "--rollout_method and --seed"
        )
    )
    benchmarks: list[str] = field(
        default_factory=list,
        metadata=_h(
            "benchmark names, space-separated (geo3k hallusionbench mathvista mathverse mathvision wemath "
            "pope mmstar ai2d realworldqa chartqa; text-only: gsm8k math500), synthetic (an exported synthetic "
            "suite, see --data), or "
            "a name of your own that --data gives a file; none: the names --data gives"
        ),
    )
    output_dir: str | None = field(
        default=None,
        metadata=_h(
            "output folder: run.json + records.jsonl; none: evals/NAME-METHOD-seedSEED[-CHECKPOINT] for a "
            "training run's folder, evals/<model folder name> for any other model"
        ),
    )
    data_dir: str | None = field(
        default=None, metadata=_h("root folder holding one sub-folder per benchmark")
    )
    data: list[str] = field(
        default_factory=list,
        metadata=_h(
            "data per benchmark as NAME=PATH[:ROLE], space-separated (overrides --data_dir). A NAME that is "
            "not built in is a benchmark of your own, labelled NAME in records, tables and figures: PATH a "
            ".jsonl, .json or .parquet file (or a folder with <split>.jsonl ...) of rows with problem (or "
            "question, or TRL's prompt: text or one user message) and answer, and optionally images (a list) or image (file paths relative to the file, "
            "or image structs; none: text-only), choices, answer_type, id. ROLE: in-domain (the default for "
            "your own), ood or general, the table and pooled test it joins"
        ),
    )
    split: str | None = field(
        default=None, metadata=_h("split to evaluate; none: each benchmark's own, e.g. testmini")
    )
    limit: int | None = field(default=None, metadata=_h("first N questions of each benchmark (smoke runs)"))
    batch_size: int = field(default=8, metadata=_h("questions per generate call; may differ between reruns"))
    max_new_tokens: int = field(default=2048, metadata=_h("answer token budget"))
    system_prompt: str | None = field(default=None, metadata=_h("system message of every prompt"))
    math_prompt: str | None = field(default=None, metadata=_h(MATH_PROMPT_HELP))
    grader: str = field(
        default="ncgrpo",
        metadata=_h("answer grader: 'ncgrpo' (the shared exact scorer) or 'mathruler' (NoisyRollout's)"),
    )
    name: str | None = field(
        default=None,
        metadata=_h("display name in tables; none: a training run's name, else the model id"),
    )
    rollout_method: str | None = field(
        default=None,
        metadata=_h("training method of the model, recorded in run.json as `method`; none: a training run's"),
    )
    seed: int | None = field(
        default=None, metadata=_h("training seed of the model, recorded per question; none: a training run's")
    )
    checkpoint: str | None = field(
        default=None,
        metadata=_h(
            "checkpoint label recorded per question; none: checkpoint-N for a run's checkpoint folder"
        ),
    )
    engine: str = field(
        default="transformers",
        metadata=_h(
            "decoding engine: 'transformers' (model.generate, --batch_size questions per call) or 'vllm' "
            "(vLLM's offline engine, every question submitted at once, --batch_size sequences decoded at "
            "once; needs vLLM, see scripts/setup_vllm.sh). Part of the folder's identity"
        ),
    )
    device: str = field(default="auto", metadata=_h("cpu, cuda, cuda:N or auto"))
    dtype: str = field(default="auto", metadata=_h("torch dtype of the weights, e.g. bfloat16"))
    progress: bool = field(default=True, metadata=_h("progress bar (--no_progress: none)"))

    def __post_init__(self) -> None:
        from ncgrpo.data.benchmarks import BENCHMARKS, custom_benchmark
        from ncgrpo.models import check_model_source

        if not str(self.model_name_or_path).strip():
            raise UsageError("--model_name_or_path is empty; give a model folder or hub id")
        check_model_source(self.model_name_or_path, contents=False)
        self.train_run = training_run(self.model_name_or_path)
        if self.train_run is not None:  # an eval of a training run carries its name, method and seed
            run, checkpoint = self.train_run
            self.name = self.name if self.name is not None else run.get("name")
            if self.rollout_method is None:
                self.rollout_method = run.get("method")
            if self.seed is None and isinstance(run.get("seed"), int):
                self.seed = run["seed"]
            self.checkpoint = self.checkpoint if self.checkpoint is not None else checkpoint
        from ncgrpo.eval.evaluate import ENGINES

        if self.engine not in ENGINES:
            raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "vllm":
            if importlib.util.find_spec("vllm") is None:
                raise UsageError(
                    f"--engine vllm: vLLM is not installed for {sys.executable}; run ncgrpo from the "
                    "environment scripts/setup_vllm.sh builds (.venv-vllm), or use --engine transformers"
                )
        from ncgrpo.models import check_device

        try:
            check_device(self.device)  # before the model loads and anything is written
        except ValueError as e:
            raise UsageError(str(e)) from None
        names: list[str] = []
        for item in self.benchmarks:
            parts = [p.strip() for p in str(item).split(",")]
            if not all(parts):
                raise UsageError(
                    f"--benchmarks {item!r}: empty benchmark name; give names separated by spaces"
                )
            names += parts
        data = self._data_items()
        if not names:  # none listed: the benchmarks --data gives
            names = list(data)
        if not names:
            raise UsageError(
                "--benchmarks needs at least one benchmark name (or --data NAME=FILE.jsonl for one of your own)"
            )
        known = ("synthetic", *BENCHMARKS)
        unknown = [n for n in names if n not in known and n not in data]
        if unknown:
            raise UsageError(
                f"--benchmarks: unknown benchmark(s) {unknown}; known: {', '.join(known)}; a benchmark of your "
                f"own needs its file: --data {unknown[0]}=FILE.jsonl[:in-domain|ood|general]"
            )
        for n in names:
            if n not in known:
                try:
                    custom_benchmark(n)
                except ValueError as e:
                    raise UsageError(f"--benchmarks: {e}") from None
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UsageError(f"--benchmarks names {dup} more than once")
        self.benchmarks = names
        self.paths, self.roles = self._data_paths(data)
        if self.output_dir is None:
            self.output_dir = str(Path("evals") / default_folder_name(self))
        if self.split is not None and not self.split.strip():
            raise UsageError("--split is empty; leave it out for each benchmark's default split")
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be >= 1 (or left out for every question), got {self.limit}")
        for flag in ("batch_size", "max_new_tokens"):
            if getattr(self, flag) < 1:
                raise UsageError(f"--{flag} must be >= 1, got {getattr(self, flag)}")
        out = Path(self.output_dir)
        if not str(self.output_dir).strip():
            raise UsageError("--output_dir is empty")
        if out.exists() and not out.is_dir():
            raise UsageError(f"--output_dir {out} exists and is not a folder")

    def _data_items(self) -> dict[str, tuple[Path, str | None]]:
        """``--data NAME=PATH[:ROLE]`` items: name -> (path, role or None)."""
        from ncgrpo.data.benchmarks import ROLE_NAMES, parse_role

        items: dict[str, tuple[Path, str | None]] = {}
        for item in self.data:
            k, sep, v = str(item).partition("=")
            k, v = k.strip(), v.strip()
            if not sep or not k or not v:
                raise UsageError(f"--data expects NAME=PATH or NAME=PATH:ROLE, got {item!r}")
            role = None
            head, colon, tail = v.rpartition(":")
            if colon and tail.strip().lower() in ROLE_NAMES:
                v, role = head.strip(), parse_role(tail)
            elif colon and head and not Path(v).exists() and not Path(tail).exists() and "/" not in tail:
                raise UsageError(
                    f"--data {item!r}: {tail!r} is not a role (in-domain, ood or general) and {v} does not exist"
                )
            path = Path(v)
            if not path.exists():
                raise UsageError(f"--data {item!r}: {path} does not exist")
            if k in items:
                raise UsageError(f"--data names {k!r} twice")
            if role is not None and k == "synthetic":
                raise UsageError(f"--data {item!r}: the synthetic suite's rows carry their own roles")
            items[k] = (path, role)
        return items

    def _data_paths(
        self, items: dict[str, tuple[Path, str | None]]
    ) -> tuple[dict[str, Path | None], dict[str, str]]:
        for k in items:
            if k not in self.benchmarks:
                raise UsageError(f"--data {k}=...: {k!r} is not among --benchmarks {self.benchmarks}")
        explicit = {k: path for k, (path, _) in items.items()}
        roles = {k: role for k, (_, role) in items.items() if role is not None}
        data_dir = None if self.data_dir is None else Path(self.data_dir)
        if data_dir is not None and not data_dir.is_dir():
            raise UsageError(f"--data_dir {data_dir} is not a folder")
        out: dict[str, Path | None] = {}
        for n in self.benchmarks:
            if n in explicit:
                out[n] = explicit[n]
            elif data_dir is not None and (data_dir / n).exists():
                out[n] = data_dir / n
            else:
                out[n] = None
        if "synthetic" in self.benchmarks and out["synthetic"] is None:
            raise UsageError("benchmark 'synthetic' needs --data synthetic=FOLDER (an exported suite)")
        return out, roles

    def splits(self) -> dict[str, str]:
        """The split each benchmark is read from (recorded in run.json; ``test`` for one's own)."""
        from ncgrpo.data.benchmarks import BENCHMARKS

        return {
            n: self.split or (BENCHMARKS[n].default_split if n in BENCHMARKS else "test")
            for n in self.benchmarks
        }


_CHECKPOINT = re.compile(r"checkpoint-\d+")


def training_run(path: str | Path) -> tuple[dict[str, Any], str | None] | None:
    """``(run.json, checkpoint label)`` when ``path`` is an ``ncgrpo train`` run folder (label None) or
    one of its ``checkpoint-N`` folders (label ``checkpoint-N``); None for any other model."""

    folder = Path(path)
    if not folder.is_dir():
        return None
    try:
        for run_dir, label in ((folder, None), (folder.parent, folder.name)):
            if label is not None and not _CHECKPOINT.fullmatch(label):
                break
            if folder_kind(run_dir) == "train":
                return read_run_json(run_dir) or {}, label
    except ValueError as e:  # a broken run.json: named by its reader
        raise UsageError(str(e)) from None
    return None


def default_folder_name(args: EvalArgs) -> str:
    """The eval folder's name when --output_dir is left out: ``NAME-METHOD-seedSEED[-CHECKPOINT]`` for a
    training run (what it carries), the model folder's (or hub id's) last part for any other model."""
    if args.train_run is not None:
        parts = [
            args.name,
            args.rollout_method,
            None if args.seed is None else f"seed{args.seed}",
            args.checkpoint,
        ]
        text = "-".join(str(p) for p in parts if p not in (None, ""))
    else:
        text = Path(str(args.model_name_or_path).rstrip("/")).name
    return re.sub(r"[^\w.+=-]+", "_", text).strip("._") or "eval"


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_dataclass_command(sub, "eval", EvalArgs, run, help=HELP, description=DESCRIPTION)


def _say_training_run(args: EvalArgs, settings: Any, out: Path) -> None:
    """One line on stderr: whose eval this is and where it goes; and a note where the run trained with
    another prompt template than this eval uses (train and eval share --system_prompt/--math_prompt)."""

    run_dir = Path(args.model_name_or_path)
    run_dir = run_dir.parent if args.train_run and args.train_run[1] else run_dir
    print(
        f"ncgrpo eval: training run {args.name!r} (method {args.rollout_method}, seed {args.seed}"
        + (f", {args.checkpoint}" if args.checkpoint else "")
        + f") -> {out}",
        file=sys.stderr,
    )
    try:
        config = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return
    if not isinstance(config, dict):
        return
    trained = {"math_prompt": config.get("math_prompt"), "system_prompt": config.get("system_prompt")}
    trained["math_prompt"] = MATH_PROMPT if trained["math_prompt"] is None else trained["math_prompt"]
    used = {"math_prompt": settings.math_prompt, "system_prompt": settings.system_prompt}
    for key in trained:
        if trained[key] != used[key]:
            print(
                f"ncgrpo eval: note: the run trained with {key} {trained[key]!r}, this eval uses "
                f"{used[key]!r} (--{key} sets it; the same setting as ncgrpo train's)",
                file=sys.stderr,
            )


def run(args: EvalArgs) -> int:
    from rich.console import Console
    from rich.table import Table

    from ncgrpo.eval.evaluate import (
        DecodingSettings,
        check_adapter_base,
        check_folder,
        check_images,
        check_records,
        config_reads_images,
        evaluate,
        load_for_eval,
        model_id_of,
        run_identity,
    )
    from ncgrpo.eval.questions import load_questions

    out = Path(args.output_dir)
    settings = DecodingSettings(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        system_prompt=args.system_prompt,
        math_prompt=MATH_PROMPT if args.math_prompt is None else args.math_prompt,
        grader=args.grader,
    )
    check_adapter_base(args.model_name_or_path)  # its id hashes the base: a missing one is named first
    model_id = model_id_of(args.model_name_or_path)
    identity = dict(
        model_id=model_id, checkpoint=args.checkpoint, seed=args.seed, name=args.name, method=args.rollout_method,
        settings=settings, split=args.splits(), benchmarks=args.benchmarks, engine=args.engine,
    )  # fmt: skip
    run_info = run_identity(**identity)
    check_folder(out, run_info)  # a rerun of another identity: refused before loading
    FolderLock(out, what="ncgrpo eval").check()  # another writer: named now, before reading any question
    questions = load_questions(args.benchmarks, args.paths, args.split, args.limit, args.roles)
    if args.train_run is not None:
        _say_training_run(args, settings, out)
    try:  # image questions for a text-only model: refused from its config, before anything is written
        check_images(questions, config_reads_images(args.model_name_or_path), args.model_name_or_path)
        # records of another producer, other questions under the recorded ids, another role: before the
        # model loads (the records are checked whether or not run.json is there)
        check_records(out, run_info, questions, settings)
    except ValueError as e:
        raise UsageError(str(e)) from None
    # An existing folder is locked before the model loads, so a second eval into it fails at once;
    # a new one is created (and locked) by evaluate only once everything has been checked.
    with FolderLock(out, what="ncgrpo eval") if out.is_dir() else contextlib.nullcontext():
        try:
            model, processor = load_for_eval(
                args.model_name_or_path, engine=args.engine, dtype=args.dtype, device=args.device,
                settings=settings, questions=questions,
            )  # fmt: skip
        except (OSError, ValueError) as e:
            raise UsageError(f"--model_name_or_path {args.model_name_or_path}: cannot load it ({e})") from e
        try:
            summary = evaluate(model, processor, questions, out, progress=args.progress, **identity)
        finally:
            # the vLLM engine's processes stop now; a transformers model has nothing to close
            getattr(model, "close", lambda: None)()
    table = Table(title=f"{out} ({summary.newly_recorded} new of {summary.total})")
    table.add_column("benchmark")
    table.add_column("n", justify="right")
    table.add_column("accuracy %", justify="right")
    for b, a in summary.accuracy.items():
        table.add_row(b, str(summary.counts[b]), f"{100 * a:.1f}")
    Console().print(table)
    return 0
