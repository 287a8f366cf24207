"""``ncgrpo eval``: greedy, noise-free evaluation with crash-safe per-question records.

Options are the fields of :class:`EvalArgs` (``--config FILE.yaml`` and/or one ``--flag`` per field,
see ``ncgrpo.commands._common``). Every option is checked before the model is loaded and
before anything is written: a bad value leaves no run folder behind.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from ncgrpo.commands._common import UsageError, add_dataclass_command

HELP = "evaluate a model greedily on benchmarks; one JSONL record per question (resumable)"
DESCRIPTION = (
    HELP
    + ". Rerunning into the same --output_dir completes it: recorded questions are skipped. A folder holds "
    "one model, engine, checkpoint, seed, split, benchmark set and decoding setting (run.json); only the batch "
    "size may change between reruns. One writer per folder at a time (an advisory lock)."
)


def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class EvalArgs:
    """Options of ``ncgrpo eval`` (checked in ``__post_init__``)."""

    model_name_or_path: str = field(metadata=_h("model folder (save_pretrained layout) or cached hub id"))
    benchmarks: list[str] = field(
        metadata=_h(
            "benchmark names, space-separated (geo3k hallusionbench mathvista mathverse mathvision wemath "
            "pope mmstar ai2d realworldqa chartqa) or synthetic (an exported synthetic suite, see --data)"
        )
    )
    output_dir: str = field(metadata=_h("output folder: run.json + records.jsonl"))
    data_dir: str | None = field(
        default=None, metadata=_h("root folder holding one sub-folder per benchmark")
    )
    data: list[str] = field(
        default_factory=list,
        metadata=_h("data location per benchmark as NAME=PATH, space-separated (overrides --data_dir)"),
    )
    split: str | None = field(
        default=None, metadata=_h("split to evaluate; none: each benchmark's own, e.g. testmini")
    )
    limit: int | None = field(default=None, metadata=_h("first N questions of each benchmark (smoke runs)"))
    batch_size: int = field(default=8, metadata=_h("questions per generate call; may differ between reruns"))
    max_new_tokens: int = field(default=2048, metadata=_h("answer token budget"))
    system_prompt: str | None = field(default=None, metadata=_h("system message"))
    grader: str = field(
        default="ncgrpo",
        metadata=_h("answer grader: 'ncgrpo' (the shared exact scorer) or 'mathruler' (NoisyRollout's)"),
    )
    name: str | None = field(default=None, metadata=_h("display name in tables; none: the model id"))
    rollout_method: str | None = field(
        default=None, metadata=_h("training method of the model, recorded in run.json as `method`")
    )
    seed: int | None = field(default=None, metadata=_h("training seed of the model, recorded per question"))
    checkpoint: str | None = field(default=None, metadata=_h("checkpoint label recorded per question"))
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
        from ncgrpo.data.benchmarks import BENCHMARKS

        if not str(self.model_name_or_path).strip():
            raise UsageError("--model_name_or_path is empty; give a model folder or hub id")
        from ncgrpo.eval.evaluate import ENGINES

        if self.engine not in ENGINES:
            raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "vllm":
            import importlib.util
            import sys

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
        if not names:
            raise UsageError("--benchmarks needs at least one benchmark name")
        known = ("synthetic", *BENCHMARKS)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UsageError(f"--benchmarks: unknown benchmark(s) {unknown}; known: {', '.join(known)}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UsageError(f"--benchmarks names {dup} more than once")
        self.benchmarks = names
        self.paths = self._data_paths()
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

    def _data_paths(self) -> dict[str, Path | None]:
        explicit: dict[str, Path] = {}
        for item in self.data:
            k, sep, v = str(item).partition("=")
            if not sep or not k.strip() or not v.strip():
                raise UsageError(f"--data expects NAME=PATH, got {item!r}")
            if k.strip() not in self.benchmarks:
                raise UsageError(
                    f"--data {item!r}: {k.strip()!r} is not among --benchmarks {self.benchmarks}"
                )
            path = Path(v.strip())
            if not path.exists():
                raise UsageError(f"--data {item!r}: {path} does not exist")
            explicit[k.strip()] = path
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
        return out

    def splits(self) -> dict[str, str]:
        """The split each benchmark is read from (recorded in run.json)."""
        from ncgrpo.data.benchmarks import BENCHMARKS

        return {
            n: self.split or ("test" if n == "synthetic" else BENCHMARKS[n].default_split)
            for n in self.benchmarks
        }


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_dataclass_command(sub, "eval", EvalArgs, run, help=HELP, description=DESCRIPTION)


def load_questions(names: list[str], paths: dict[str, Path | None], split: str | None, limit: int | None):
    """The questions of ``names`` (benchmark -> data path or None for the ``datasets`` cache).

    A benchmark that yields no question is an error naming where it was read.
    """
    from ncgrpo.data.benchmarks import BENCHMARKS, load_benchmark

    questions = []
    for n in names:
        if n == "synthetic":
            if paths.get(n) is None:
                raise UsageError("benchmark 'synthetic' needs --data synthetic=FOLDER (an exported suite)")
            got = load_benchmark("geo3k", paths[n], split=split or "test", limit=limit)
        elif n in BENCHMARKS:
            got = load_benchmark(n, paths.get(n), split=split, limit=limit)
        else:
            raise UsageError(f"unknown benchmark {n!r}; known: synthetic, {', '.join(BENCHMARKS)}")
        if not got:
            where = paths.get(n) or "the datasets cache"
            raise UsageError(
                f"benchmark {n!r}: no questions in {where} (split {split or 'default'}); "
                "is the file empty or the split wrong?"
            )
        questions += got
    return questions


def run(args: EvalArgs) -> int:
    import contextlib

    from rich.console import Console
    from rich.table import Table

    from ncgrpo.eval.evaluate import (
        DecodingSettings,
        check_folder,
        check_images,
        config_reads_images,
        evaluate,
        load_for_eval,
        model_id_of,
        run_identity,
    )
    from ncgrpo.eval.records import FolderLock

    out = Path(args.output_dir)
    settings = DecodingSettings(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        system_prompt=args.system_prompt,
        grader=args.grader,
    )
    model_id = model_id_of(args.model_name_or_path)
    identity = dict(
        model_id=model_id, checkpoint=args.checkpoint, seed=args.seed, name=args.name, method=args.rollout_method,
        settings=settings, split=args.splits(), benchmarks=args.benchmarks, engine=args.engine,
    )  # fmt: skip
    check_folder(out, run_identity(**identity))  # a rerun of another identity: refused before loading
    FolderLock(out, what="ncgrpo eval").check()  # another writer: named now, before reading any question
    questions = load_questions(args.benchmarks, args.paths, args.split, args.limit)
    try:  # image questions for a text-only model: refused from its config, before anything is written
        check_images(questions, config_reads_images(args.model_name_or_path), args.model_name_or_path)
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
