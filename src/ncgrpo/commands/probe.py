"""``ncgrpo probe``: does the prefill noise change first tokens and rollouts? (:mod:`ncgrpo.eval.probe`)"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from ncgrpo.commands._common import UsageError, add_dataclass_command

HELP = "measure whether NC-GRPO's prefill noise changes first tokens and rollouts, before training"


def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class ProbeArgs:
    """Options of ``ncgrpo probe`` (checked in ``__post_init__``)."""

    model_name_or_path: str | None = field(
        default=None, metadata=_h("model folder or cached hub id (null: the embedded base)")
    )
    benchmark: str = field(
        default="synthetic",
        metadata=_h(
            "where the prompts come from: 'synthetic' (the embedded suite, generated), a benchmark name "
            "`ncgrpo eval` knows (geo3k, mathvista, gsm8k, math500, ...) read from --data, or a name of your own "
            "for a data file --data gives"
        ),
    )
    data: str | None = field(
        default=None,
        metadata=_h(
            "data of --benchmark: a built-in benchmark's folder or file, or a data file of your own "
            "(.jsonl, .json, .parquet) whose --prompt_column holds each prompt, as ncgrpo train reads it; "
            "NAME=FILE names it (else --benchmark, else the file's stem). Not needed for synthetic"
        ),
    )
    prompt_column: str = field(
        default="prompt",
        metadata=_h("a data file of your own: the column holding each prompt (a string or chat messages)"),
    )
    answer_column: str | None = field(
        default=None,
        metadata=_h("a data file of your own: the column the built-in rewards read as answer (null: answer)"),
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math_reward"],
        metadata=_h(
            "reward functions of the reward columns (summed), as ncgrpo train's: built-in names or dotted "
            "import paths of your own (my_rewards.exact), called as TRL calls them, a data file's "
            "columns as keyword arguments"
        ),
    )
    split: str | None = field(
        default=None, metadata=_h("split (null: train for synthetic, the benchmark's own else)")
    )
    family: str = field(
        default="geometry", metadata=_h("synthetic only: the family to probe ('all': every one)")
    )
    prompts: int = field(default=32, metadata=_h("number of prompts N"))
    rollouts: int = field(
        default=4, metadata=_h("noisy rollouts per prompt and sigma (and as many clean partners)")
    )
    sigma0: list[float] = field(
        default_factory=lambda: [0.0, 0.2, 0.5],
        metadata=_h("noise scales in [0, 10] (as the trainer's sigma0), e.g. --sigma0 0 0.2 0.5"),
    )
    noise_site: str = field(
        default="final_norm", metadata=_h("noise site: final_norm or decoder-layer indices '1' / '0,2'")
    )
    noise_layer_decay: float = field(default=0.5, metadata=_h("depth decay across several layer sites"))
    rollout_method: str = field(
        default="latent",
        # no names typed here: the registry (ncgrpo.methods) imports torch, which would make this command's
        # --help 6x slower (measured 0.4 s -> 2.4 s); a method the probe cannot measure is refused with the list
        metadata=_h(
            "whose draws: a rollout method with hidden-state noise (a wrong one is refused with the list)"
        ),
    )
    branch_prefix: str = field(
        default="", metadata=_h("text appended to the generation prompt (e.g. '<think>')")
    )
    temperature: float = field(default=1.0, metadata=_h("sampling temperature (1, as GRPO)"))
    max_completion_length: int = field(default=48, metadata=_h("rollout token budget"))
    batch_size: int = field(default=8, metadata=_h("prompts per generate call"))
    seed: int = field(default=0, metadata=_h("seed of the noise keys and the sampler"))
    marginal_draws: int = field(
        default=1024,
        metadata=_h(
            "Monte Carlo draws of eps per prompt for the noise-averaged first-token distribution q̄ "
            "(final-norm site; through the LM head only; an even number: antithetic pairs eps, -eps)"
        ),
    )
    target_marginal_tv: float | None = field(
        default=None,
        metadata=_h("also find the sigma whose marginal first-token TV reaches this value (final-norm site)"),
    )
    output_file: Path | None = field(default=None, metadata=_h("also write the result as JSON here"))
    device: str = field(default="auto", metadata=_h("cpu, cuda, cuda:N or auto"))
    dtype: str = field(default="auto", metadata=_h("model dtype: auto, float32, bfloat16, float16"))
    num_threads: int = field(default=1, metadata=_h("torch CPU threads (0: torch's default)"))
    progress: bool = field(default=True, metadata=_h("progress bar (--no_progress: none)"))

    def __post_init__(self) -> None:
        """Every check that needs no model: a bad value exits 2 before the model loads, before any
        question is generated and before anything is written."""
        import math

        from ncgrpo.core.noise import parse_noise_site
        from ncgrpo.methods import get_method, methods

        for name in ("prompts", "rollouts", "max_completion_length", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if not self.sigma0:
            raise ValueError("--sigma0 needs at least one noise scale")
        from ncgrpo.trainer.config import sigma0_problem

        for s in self.sigma0:  # the trainer's bound, with its reason
            problem = sigma0_problem(s)
            if problem is not None:
                raise UsageError(f"--sigma0: every noise scale {problem}")
        repeated = sorted({s for s in self.sigma0 if self.sigma0.count(s) > 1})
        if repeated:
            raise UsageError(
                f"--sigma0 gives {repeated[0]:g} twice ({' '.join(f'{s:g}' for s in self.sigma0)}); each noise "
                "scale is probed once: give every value once, e.g. --sigma0 0 0.2 0.5"
            )
        site = parse_noise_site(self.noise_site)
        probed = ", ".join(sorted(m.name for m in methods() if not m.probe_refusal))
        try:
            method = get_method(self.rollout_method)
        except ValueError:
            method = None
        if method is None or method.probe_refusal:
            why = f": {method.probe_refusal}" if method is not None else ""
            raise UsageError(
                f"--rollout_method must be one of {probed} (the hidden-noise methods), got {self.rollout_method!r}{why}"
            )
        if method.paired and self.rollouts % 2:
            raise UsageError(
                f"--rollout_method {self.rollout_method} pairs (+eps, -eps); give an even --rollouts, "
                f"got {self.rollouts}"
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UsageError(f"--temperature must be a finite number > 0, got {self.temperature}")
        if not math.isfinite(self.noise_layer_decay):
            raise UsageError(f"--noise_layer_decay must be a finite number, got {self.noise_layer_decay}")
        if self.marginal_draws < 2 or self.marginal_draws % 2:
            raise UsageError(
                f"--marginal_draws must be an even number >= 2 (antithetic pairs eps, -eps), got {self.marginal_draws}"
            )
        if self.target_marginal_tv is not None:
            if not (math.isfinite(self.target_marginal_tv) and 0 < self.target_marginal_tv < 1):
                raise UsageError(f"--target_marginal_tv must be in (0, 1), got {self.target_marginal_tv}")
            if site != "final_norm":
                raise UsageError("--target_marginal_tv needs --noise_site final_norm")
        if self.num_threads < 0:
            raise ValueError(f"--num_threads must be >= 0 (0: torch's default), got {self.num_threads}")
        from ncgrpo.models import check_device

        check_device(self.device)  # before the model loads
        if self.model_name_or_path is not None:
            self.model_name_or_path = _model_path(self.model_name_or_path)
        self._own_file = None
        if self.data is not None:
            self._resolve_data(str(self.data))
        self._check_questions()
        self._check_rewards()
        if self.output_file is not None:
            self.output_file = Path(self.output_file)
            check_output_file(self.output_file)

    def _resolve_data(self, text: str) -> None:
        """``--data [NAME=]PATH``: a data file of one's own (not a built-in benchmark's) is read and
        checked now (:func:`ncgrpo.data.files.read_data_file`), and names the benchmark: NAME, else
        ``--benchmark`` if it is not synthetic, else the file's stem."""
        import os

        from ncgrpo.data.benchmarks import BENCHMARKS
        from ncgrpo.data.files import DataFileError, is_data_file, read_data_file

        name = None
        if "=" in text and not Path(os.path.expanduser(text)).exists():
            name, text = text.split("=", 1)
            if not name.strip():
                raise UsageError(f"--data {self.data!r}: NAME=FILE needs a name before '='")
            if self.benchmark not in ("synthetic", name):
                raise UsageError(
                    f"--benchmark {self.benchmark!r} and --data {name}=...: two names for one benchmark; give one"
                )
            self.benchmark = name
        path = Path(os.path.expanduser(text))
        self.data = str(path)
        if self.benchmark in BENCHMARKS or not is_data_file(text):
            return  # a built-in benchmark's data, or the synthetic suite's folder: their loaders read it
        if name is None and self.benchmark == "synthetic":
            self.benchmark = path.stem
        try:
            self._own_file = read_data_file(path, self.prompt_column, what="--data")
        except DataFileError as e:
            raise UsageError(str(e)) from None

    def _check_rewards(self) -> None:
        """Each reward function imports and takes TRL's call with the data's columns (a data file's
        columns; the built-in questions' answer, choices, answer_type); a built-in reward's answer column
        is in every row of a data file."""
        from ncgrpo.rewards.loading import BUILTIN_REWARDS, check_reward_signature, resolve_reward

        self.reward_funcs = list(self.reward_funcs or [])
        if not self.reward_funcs:
            raise UsageError("--reward_funcs is empty; name at least one, e.g. math_reward")
        own = self._own_file
        columns = ["answer", "choices", "answer_type"]
        if own is not None:
            columns = [c for c in own.columns if c != own.prompt_column]
            if self.answer_column:
                columns.append("answer")
            builtin = [r for r in self.reward_funcs if r in BUILTIN_REWARDS and r != "format_reward"]
            if builtin:
                col = self.answer_column or "answer"
                hint = "" if self.answer_column else "; name the column holding it with --answer_column"
                try:
                    own.check_column(col, what=f"the gold answer that {', '.join(builtin)} reads{hint}")
                except ValueError as e:
                    raise UsageError(str(e)) from None
        for name in self.reward_funcs:
            try:
                check_reward_signature(
                    resolve_reward(name, what="--reward_funcs"), name, columns, what="--reward_funcs"
                )
            except ValueError as e:
                raise UsageError(str(e)) from None

    def _check_questions(self) -> None:
        """The benchmark, split and family exist, and ``--prompts`` is no more than they hold (the
        synthetic suite is generated: a huge count would run for ever before any other check)."""
        from ncgrpo.data.benchmarks import BENCHMARKS
        from ncgrpo.toy.synthetic import DEFAULT_SIZES, FAMILIES, SPLITS

        if self._own_file is not None:
            return  # read and checked: _questions takes its first --prompts rows
        if self.benchmark != "synthetic" and self.benchmark not in BENCHMARKS:
            raise UsageError(
                f"--benchmark {self.benchmark!r}: unknown; known: synthetic, {', '.join(BENCHMARKS)}; a "
                f"benchmark of your own needs its data file: --data {self.benchmark}=FILE.jsonl (rows with a "
                "prompt column, as ncgrpo train reads them)"
            )
        if self.benchmark != "synthetic" or self.data is not None:
            return  # read from data: load_questions stops at --prompts rows
        split = self.split or "train"
        if split not in SPLITS:
            raise UsageError(f"--split {split!r}: the synthetic suite has splits {', '.join(SPLITS)}")
        fams = [f.name for f in FAMILIES if split != "train" or f.role == "in_domain"]
        if self.family != "all" and self.family not in fams:
            raise UsageError(
                f"--family {self.family!r}: the synthetic {split} split has families {', '.join(fams)} "
                "(or 'all')"
            )
        per_family = DEFAULT_SIZES[split]
        most = per_family * (len(fams) if self.family == "all" else 1)
        if self.prompts > most:
            raise UsageError(
                f"--prompts {self.prompts}: the synthetic suite's {split} split holds {per_family} questions "
                f"per family ({most} for --family {self.family}); ask for at most {most}"
            )


def _model_path(value: str) -> str:
    """``--model_name_or_path``: :func:`ncgrpo.models.check_model_source` (the check ``ncgrpo train`` and
    ``eval`` make: a path that does not exist, a file or a folder without config.json is an error
    saying so, not a hub-id lookup; a hub id must be cached or on the hub). A local folder is given
    back with ``~`` expanded."""
    import os

    from ncgrpo.models import check_model_source

    try:
        check_model_source(value)
    except ValueError as e:
        raise UsageError(str(e)) from None
    path = Path(os.path.expanduser(str(value)))
    return str(path) if path.exists() else str(value)


#: Files of a command's folder that the probe never writes over (:mod:`ncgrpo.runs.folder`).
def _reserved_names() -> set[str]:
    from ncgrpo.runs.folder import CONFIG_FILE, LOCK_FILE, METRICS_FILE, RECORDS_FILE, RUN_FILE

    return {RUN_FILE, RECORDS_FILE, METRICS_FILE, CONFIG_FILE, LOCK_FILE}


def _is_probe_result(path: Path) -> bool:
    """Whether ``path`` holds a probe's JSON (``kind: probe``, or, written before kinds, the probe's
    own keys), so the probe may replace it."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    return data.get("kind") == "probe" or (
        "kind" not in data and {"n_prompts", "rows", "site"} <= data.keys()
    )


def check_output_file(path: Path) -> None:
    """Refuse, before the model loads and writing nothing, an ``--output_file`` the probe cannot or must
    not write: a folder, a path under a file, a folder it may not write, a file of a command's folder
    (``run.json``, ``records.jsonl``, ...), an existing file that is not a probe result, or a folder
    another process is writing. Missing parent folders are created at the end."""
    import os

    from ncgrpo.runs.folder import FolderLock

    if path.is_dir():
        raise UsageError(f"--output_file {path} is a folder; give a file path such as {path / 'probe.json'}")
    if path.name in _reserved_names():
        raise UsageError(
            f"--output_file {path}: {path.name} is a file of a command's run folder, not the probe's; "
            "give another name such as probe.json"
        )
    if path.exists():
        if not path.is_file() or not _is_probe_result(path):
            raise UsageError(
                f"--output_file {path} exists and is not a probe result (the probe only replaces its own "
                "JSON); give a new file name or move it away"
            )
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(
            f"--output_file {path}: {ancestor} is a file, not a folder, so nothing can be written under it; "
            "give a path in a folder"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--output_file {path}: cannot write in {ancestor} (permission denied)")
    if path.parent.is_dir():
        holder = FolderLock(path.parent).holder()
        if holder is not None:
            raise UsageError(
                f"--output_file {path}: {path.parent} is being written by another process ({holder}); "
                "write the probe elsewhere or wait for it"
            )


def write_result(result, path: Path) -> None:
    """The probe's JSON (``kind: probe``), atomically; under the folder's lock where the folder is a
    command's (it has a lock file), so it never lands mid-write of another command's output."""
    import contextlib
    import json

    from ncgrpo.runs.folder import LOCK_FILE, FolderLock, atomic_write_text

    check_output_file(path)  # again: the probe may have run for hours
    text = json.dumps({**result.to_dict(), "kind": "probe"}, indent=1, sort_keys=True) + "\n"
    locked = (path.parent / LOCK_FILE).exists()
    with FolderLock(path.parent, "ncgrpo probe") if locked else contextlib.nullcontext():
        atomic_write_text(path, text)


def check_images(model: str, questions) -> None:
    """Refuse image questions for a text-only model (its config has no ``vision_config``), read from
    the config alone, before the weights load: the images would be dropped and only placeholder
    tokens reach the model (``eval`` and ``demo`` refuse this too)."""
    if not any(getattr(q, "images", None) for q in questions):
        return
    from ncgrpo.eval.evaluate import config_reads_images  # None: unreadable here, the loader says why

    if config_reads_images(model) is False:
        first = next(q for q in questions if getattr(q, "images", None))
        raise UsageError(
            f"--model_name_or_path {model} is a text-only model (its config.json has no vision_config) but "
            f"the questions have images (e.g. {first.uid}); probe a vision-language model, or a benchmark "
            "without images"
        )


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_dataclass_command(sub, "probe", ProbeArgs, run, help=HELP, description=HELP)


def _questions(args: ProbeArgs) -> list:
    own = getattr(args, "_own_file", None)
    if own is not None:
        import sys

        from ncgrpo.rewards.loading import BUILTIN_REWARDS

        builtin = any(r in BUILTIN_REWARDS for r in args.reward_funcs)
        qs = own.questions(
            args.benchmark, answer_column=args.answer_column, limit=args.prompts, answer_text=builtin
        )
        if len(qs) < args.prompts:
            print(
                f"ncgrpo probe: note: {args.data} has {len(qs)} rows; probing those, not --prompts {args.prompts}",
                file=sys.stderr,
            )
        return qs
    if args.benchmark == "synthetic" and args.data is None:
        from ncgrpo.toy.suite import build_suite

        split = args.split or "train"
        sizes = {split: max(args.prompts, 1)} if split == "train" else None
        qs = build_suite(0, sizes)[split]
        if args.family != "all":
            qs = [q for q in qs if q.metadata["family"] == args.family]
            if not qs:
                raise UsageError(f"no synthetic questions of family {args.family!r} in split {split!r}")
        return qs[: args.prompts]
    import sys

    from ncgrpo.eval.questions import load_questions

    data = Path(args.data) if args.data is not None else None
    qs = load_questions([args.benchmark], {args.benchmark: data}, args.split, args.prompts)
    if len(qs) < args.prompts:
        print(
            f"ncgrpo probe: note: {args.benchmark} has {len(qs)} questions in {args.data or 'the datasets cache'}"
            f" (split {args.split or 'default'}); probing those, not --prompts {args.prompts}",
            file=sys.stderr,
        )
    return qs


def run(args: ProbeArgs) -> int:
    import torch
    from rich.console import Console

    from ncgrpo.core.noise import parse_noise_site
    from ncgrpo.eval.probe import probe
    from ncgrpo.eval.probe_result import format_probe
    from ncgrpo.models import load_model_and_processor

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.model_name_or_path is None:
        from ncgrpo.toy.base_model import ensure_base_model

        path = str(ensure_base_model())
    else:
        path = args.model_name_or_path
    questions = _questions(args)
    check_images(path, questions)
    reward = None
    if args.reward_funcs != ["math_reward"] or getattr(args, "_own_file", None) is not None:
        from functools import partial

        from ncgrpo.rewards.loading import question_rewards, resolve_reward

        reward = partial(question_rewards, [resolve_reward(n) for n in args.reward_funcs])
    model, processor = load_model_and_processor(path, dtype=args.dtype, device=args.device)
    result = probe(
        model, processor, questions, args.sigma0, rollouts=args.rollouts,
        site=parse_noise_site(args.noise_site), layer_decay=args.noise_layer_decay,
        branch_prefix=args.branch_prefix, method=args.rollout_method, temperature=args.temperature,
        max_new_tokens=args.max_completion_length, batch_size=args.batch_size,
        seed=args.seed, model_name=path, progress=args.progress, marginal_draws=args.marginal_draws,
        target_marginal_tv=args.target_marginal_tv, reward=reward,
    )  # fmt: skip
    Console(width=max(Console().width, 160)).print(format_probe(result))
    if args.output_file is not None:
        write_result(result, args.output_file)
        print(f"wrote {args.output_file}")
    return 0
