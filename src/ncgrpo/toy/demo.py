"""``ncgrpo demo``: the paper's whole protocol in miniature, offline, on a CPU.

The paper (section 4.1) trains Qwen2.5-VL-7B with vanilla GRPO and with NC-GRPO on Geometry3K for 60
steps under the same hyperparameters, evaluates every checkpoint greedily with one rule-based scorer
on the in-domain test set, on OOD benchmarks and on a general-capability battery, and compares each
method with vanilla GRPO by per-question exact McNemar tests (Tables 1-2, Figure 1). The demo runs
exactly that pipeline at toy scale, with the same code the full-scale runs use:

1. the synthetic suite (:func:`ncgrpo.toy.synthetic.build_suite`) exported once in Geometry3K's
   schema (:func:`~ncgrpo.toy.synthetic.export_geo3k`) into ``OUT/suite`` and read back through the
   Geometry3K loader (:func:`ncgrpo.data.geometry3k.load_geometry3k`), so training data takes the
   real-data path;
2. the embedded base model (:func:`ncgrpo.toy.pretrain.ensure_base_model`: a tiny Qwen2.5-VL fine-tuned on
   the suite's reasoning traces), or ``--model_name_or_path PATH``;
3. one training run per configuration and seed with :class:`ncgrpo.trainer.NCGRPOTrainer` (TRL 1.16
   GRPO underneath), reward :data:`ncgrpo.rewards.math_reward`, frozen vision tower, ``K = steps``
   and the schedule's midpoint scaled as ``k_mid = 40/60 * K`` so eq. (3)'s anneal has the paper's
   shape (``gamma = 30``, ``k_mid = 40`` of ``K = 60``); metrics go to ``RUN/metrics.jsonl``, with a
   greedy validation accuracy (``val/accuracy`` and per role) every ``val_every`` steps;
4. greedy, noise-free evaluation of every trained model on the test split (:func:`ncgrpo.eval.evaluate.evaluate`;
   per-question records in ``OUT/eval/RUN``);
5. the paper's tables with exact McNemar p-values per family and pooled OOD
   (:func:`ncgrpo.eval.report.compare`), printed and written as Markdown, LaTeX and JSON, and the figures
   (:func:`ncgrpo.eval.plots.plot_dynamics`, :func:`ncgrpo.eval.plots.plot_gains`).

Reruns are cheap, and one run is one set of settings, checked as ``ncgrpo train`` and ``ncgrpo eval``
check theirs. Each training run is :class:`DemoConfig` composed into an ``NCGRPOConfig``
(:meth:`DemoConfig.trainer_settings`: the demo's fields that are ``NCGRPOConfig`` fields, by name) and
trained by :func:`ncgrpo.driver.train_run`; its ``config.yaml`` holds its identity (the
``NCGRPOConfig``'s, :mod:`ncgrpo.runs.identity`, plus the demo's suite, batch and validation settings).
Each evaluation is :func:`ncgrpo.eval.evaluate.evaluate` into a folder whose ``run.json`` holds eval's
identity. A rerun skips a finished run whose identity is unchanged and an evaluation that holds a
record of every test question; a run whose settings changed is refused, naming them (records of
different runs must not mix). The suite's seed and sizes are in ``OUT/suite/suite.json``.

Noise site: the default is the paper's (``final_norm``), where the noise reaches only the first-token
logits (section 3.1). The embedded base model starts every answer with ``<think>`` (p >= 0.9999), so
without a prefix that site changes no rollout (measured: NC-GRPO's logged steps equalled vanilla's and
the test records were identical). The demo therefore trains with ``branch_prefix="<think>"``
(:mod:`ncgrpo.trainer.prefix`; evaluation keeps the plain prompt): the branch point is then the first
reasoning token, where the base chooses among five openings, four derivations and an image-blind shortcut
(:func:`ncgrpo.toy.synthetic.shortcut_trace`; ``ncgrpo probe``: first-token entropy 1.7 nats, 6.1% of
noisy rollouts differ from their common-random-number clean partner at sigma 0.2). What GRPO learns
here is that choice: the base's greedy answer is the shortcut, and the derivations earn more reward. The demo
still checks after training whether the two runs were identical and says so under the table
(:func:`_notes`); ``noise_site="1"`` (the propagating variant, reaching the KV cache) also changes
rollouts.

Threads and processes: on a small CPU the default is one torch thread per run and one run per core,
each run (training, then its evaluation) in its own worker process (``workers``; spawned, killed with
the demo process). Measured on this project's 2-core machine while other jobs ran, greedy generation
of 64 questions took 1.5 s with one thread and 29 s with two (spinning OpenMP workers), and a GRPO
step 1.7 s vs 8-32 s; two single-threaded training processes side by side stepped as fast as one
alone (2.58 vs 2.7 s). The runs share nothing but the read-only suite and base model, and each is
seeded by its own seed, so the records do not depend on ``workers``
(``tests/toy/test_demo.py::test_runs_in_worker_processes_equal_runs_in_one_process``). One demo
writes a folder at a time (an advisory lock on ``--output_dir``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ncgrpo.core.plan import HIDDEN_NOISE_METHODS
from ncgrpo.runs.folder import CONFIG_FILE, METRICS_FILE, RECORDS_FILE
from ncgrpo.toy.synthetic import first_per_family

__all__ = [
    "BASELINE",
    "DEFAULT_STEPS",
    "DemoConfig",
    "DemoResult",
    "DemoRun",
    "MethodSpec",
    "RunResult",
    "first_per_family",
    "run_demo",
    "validation_accuracy",
]

#: The demo's training length: twice the paper's 60 steps, because the toy's lesson (the derivations
#: over the image-blind shortcut) needs it. Measured, vanilla GRPO's in-domain gain over the embedded
#: base (600 test questions, seeds 0/1/2): +4.8/+1.1/+6.6 points at 60 steps, +6.3/+6.0/+5.7 (exact
#: McNemar p = 0.0021/0.0064/0.0054) at 120. k_mid scales with K, so eq. (3)'s anneal keeps the
#: paper's shape.
DEFAULT_STEPS = 120
#: The paper's anneal: k_mid = 40 of K = 60 steps (section 4.1, NoisyRollout's setting).
PAPER_K, PAPER_K_MID = 60, 40
#: Display name of the baseline every test is against (the paper's "Vanilla GRPO").
BASELINE = "Vanilla GRPO"
#: Display name of the untrained base model's row (evaluated once, seed 0: paired with vanilla's seed 0).
BASE_NAME = "Base model"

SUITE_MARKER = "suite.json"
_DEVICES = ("cpu", "cuda", "auto")

#: DemoConfig fields that are NCGRPOConfig fields but set only for the methods that use them
#: (:meth:`DemoConfig.methods` puts them in :attr:`MethodSpec.fields`), and ``output_dir``, the demo's
#: root (each run's folder is ``OUT/train/RUN``). Every other field NCGRPOConfig has too is passed to
#: every run as it is (:meth:`DemoConfig.trainer_settings`).
NOT_FOR_EVERY_RUN = frozenset({"output_dir", "sigma0", "noise_site", "first_token_temperature"})
#: NCGRPOConfig settings the demo fixes for every run: a log line per step (its progress bar and
#: metrics.jsonl), no checkpoints (a killed run restarts), its own progress display.
TRAINER_FIXED: dict[str, Any] = dict(
    logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0, disable_tqdm=True
)
#: DemoConfig fields that do not make one of its training runs what it is: which runs it trains (a
#: run's own method, sigma0 and noise site are in its NCGRPOConfig), where and how fast it runs, the
#: base model (recorded as the run's ``model_name_or_path``, its model id) and the test evaluation
#: (eval's own identity, in its folder's run.json). Every other field NCGRPOConfig has not (the suite,
#: the batch, the validation) is part of each run's identity beside the NCGRPOConfig's
#: (:meth:`DemoRun.settings`), so a new field of either is covered with no edit here.
NOT_RUN_SETTINGS = frozenset(
    {
        *NOT_FOR_EVERY_RUN,
        "seeds",
        "all_methods",
        "rollout_methods",
        "model_name_or_path",
        "cache_dir",
        "device",
        "num_threads",
        "workers",
        "progress",
        "eval_limit",
        "max_new_tokens",
        "eval_batch_size",
    }
)


# ------------------------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class MethodSpec:
    """One trained configuration: its table name, folder slug and the NCGRPOConfig fields it sets."""

    name: str
    slug: str
    rollout_method: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class DemoConfig:
    """Everything ``ncgrpo demo`` runs. At the defaults the whole demo takes 206.8 s on 2 idle CPU cores.

    Training: ``max_steps`` optimizer steps per run, each on ``prompts_per_step`` prompts with
    ``num_generations`` rollouts each (TRL's ``G``; the two-pass methods split it into ``G/2`` clean
    and ``G/2`` noisy rollouts, vanilla samples all ``G`` clean), so TRL's
    ``per_device_train_batch_size = prompts_per_step * num_generations``.
    Evaluation: ``eval_limit`` test questions per family (None: the whole test split), greedy,
    ``max_new_tokens`` each. Validation during training: the first ``val_limit`` validation
    questions per family every ``val_every`` steps (None: about six times per run; ``val_limit=0``
    turns it off).
    """

    output_dir: Path = field(
        default=Path("runs/demo"),
        metadata={"help": "output folder; rerunning into the same folder skips finished runs"},
    )
    max_steps: int = field(
        default=DEFAULT_STEPS,
        metadata={"help": "optimizer steps per run, K of eq. (3); k_mid = 40/60 K (the paper's K is 60)"},
    )
    seeds: int = field(
        default=1, metadata={"help": "training seeds per configuration; 3 gives the 3-seed table"}
    )
    sigma0: list[float] = field(
        default_factory=lambda: [0.2],
        metadata={"help": "NC-GRPO noise scale(s), one run each, e.g. --sigma0 0.2 0.5 (the paper's two)"},
    )
    all_methods: bool = field(
        default=False,
        metadata={
            "help": "also train NoisyRollout (image), antithetic, SPSA and the two first-token controls (temperature "
            "T0, and sampling from the noise-averaged distribution q̄ of sigma0)"
        },
    )
    rollout_methods: list[str] = field(
        default_factory=list,
        metadata={
            "help": "train only these of the configurations above, by rollout method (latent, image, antithetic, "
            "spsa, first_token_temperature, first_token_marginal); vanilla GRPO, the baseline of every test, always "
            "runs. Empty: all. "
            "E.g. to share a 3-seed table between processes, each with its own --output_dir"
        },
    )
    model_name_or_path: Path | None = field(
        default=None,
        metadata={"help": "base model folder, e.g. a bigger one (null: the embedded tiny base model)"},
    )
    cache_dir: Path | None = field(
        default=None,
        metadata={
            "help": "where the embedded base model is built and cached if not shipped (null: ~/.cache/ncgrpo)"
        },
    )
    device: str = field(default="cpu", metadata={"help": "cpu, cuda, cuda:N or auto"})
    eval_limit: int | None = field(
        default=None,
        metadata={"help": "test questions per family (null: the whole test split, 600 per family)"},
    )
    num_generations: int = field(
        default=8,
        metadata={"help": "rollouts per prompt, G; two-pass methods use G/2 clean + G/2 noisy"},
    )
    prompts_per_step: int = field(default=8, metadata={"help": "prompts per optimizer step"})
    max_completion_length: int = field(default=48, metadata={"help": "rollout token budget"})
    max_new_tokens: int = field(default=64, metadata={"help": "evaluation token budget"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    lr_scheduler_type: str = field(
        default="linear",
        metadata={
            "help": "learning-rate schedule, by TRL's names: linear (TRL's default: decays to 0 at the last step) or "
            "constant (the paper's EasyR1 recipe); on the toy, constant gave vanilla +5.3/+7.2/+2.8 points "
            "at 120 steps against linear's +6.3/+6.0/+5.7"
        },
    )
    noise_site: str = field(
        default="final_norm",
        metadata={
            "help": "where the hidden-noise methods perturb the prefill: final_norm (the paper's site) or "
            "decoder-layer indices such as 1 or 0,2 (the propagating variant)"
        },
    )
    branch_prefix: str = field(
        default="<think>",
        metadata={
            "help": "text appended to the training generation prompt so the prefill ends where reasoning begins "
            "(the final-norm noise then acts on the first reasoning token instead of the near-certain "
            "'<think>'); rewards see it in front of the completion; evaluation uses the plain prompt"
        },
    )
    first_token_temperature: float = field(
        default=1.02,
        metadata={
            "help": "starting temperature T0 of the first-token control (--all_methods), annealed with the noise; "
            "1.02 is matched to sigma0 = 0.2 on the embedded base with branch_prefix '<think>' on what generates the "
            "rollouts: `ncgrpo probe --prompts 128 --sigma0 0.2 --branch_prefix '<think>'` gives noise-averaged "
            "first-token TV 0.0066 and matched T0 1.0195 (the per-draw TV, 0.076, would give 1.23, which moves the "
            "sampled distribution about 11x more than the noise does)"
        },
    )
    val_limit: int = field(
        default=32,
        metadata={"help": "validation questions per family scored greedily during training; 0 turns it off"},
    )
    val_every: int | None = field(
        default=None, metadata={"help": "validate every N steps (null: about six times per run)"}
    )
    eval_batch_size: int = field(default=64, metadata={"help": "prompts per batch of greedy evaluation"})
    suite_seed: int = field(default=0, metadata={"help": "seed of the synthetic suite"})
    train_size: int = field(default=2000, metadata={"help": "training questions in the suite"})
    validation_size: int = field(default=64, metadata={"help": "validation questions per family"})
    test_size: int = field(
        default=600, metadata={"help": "test questions per family (600: about Geometry3K's 601 test rows)"}
    )
    num_threads: int | None = field(
        default=1,
        metadata={
            "help": "torch CPU threads (1: the fastest on a small busy CPU); 0 or null: torch's default",
        },
    )
    workers: int | None = field(
        default=None,
        metadata={
            "help": "runs trained and evaluated at once, one process each (null: on a CPU, the cores this process "
            "may use divided by --num_threads, at most one per run; on a GPU, 1). Every run is seeded on its own, so "
            "the records are the same for any value; more workers need one model's memory each"
        },
    )
    progress: bool = field(
        default=True, metadata={"help": "progress bars and tables on the terminal (--no_progress: none)"}
    )

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ValueError(
                f"output_dir: {self.output_dir} is a file, not a folder; the demo writes a folder there "
                "(suite/, train/, eval/, tables): pass a new folder path"
            )
        if self.model_name_or_path is not None:
            self.model_name_or_path = Path(self.model_name_or_path)
            if not (self.model_name_or_path / "config.json").is_file():
                raise ValueError(
                    f"model_name_or_path: {self.model_name_or_path} has no config.json; pass a folder written by save_pretrained "
                    "(config, weights, processor files)"
                )
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir)
        if isinstance(self.sigma0, int | float):
            self.sigma0 = (float(self.sigma0),)
        self.sigma0 = tuple(float(s) for s in self.sigma0)  # a list on the command line, kept as a tuple
        if not self.sigma0:
            raise ValueError("sigma0: give at least one noise scale, e.g. 0.2 or 0.2 0.5")
        bad = [s for s in self.sigma0 if not (math.isfinite(s) and s >= 0)]
        if bad:
            raise ValueError(f"sigma0: every noise scale must be a finite number >= 0, got {bad}")
        if len(set(self.sigma0)) != len(self.sigma0):
            raise ValueError(f"sigma0: {list(self.sigma0)} lists a scale twice")
        for name in (
            "max_steps",
            "seeds",
            "prompts_per_step",
            "max_completion_length",
            "train_size",
            "test_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name, what in (
            ("eval_limit", "questions per family (or None)"),
            ("val_every", "steps (or None)"),
            ("workers", "processes (or None: automatic)"),
        ):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive number of {what}, got {v!r}")
        _ = self.decoding  # the evaluation's settings: max_new_tokens and eval_batch_size checked there
        if not isinstance(self.validation_size, int) or self.validation_size < 0:
            raise ValueError(f"validation_size must be an integer >= 0, got {self.validation_size!r}")
        g = self.num_generations
        if not isinstance(g, int) or g < 2 or g % 2:
            raise ValueError(
                f"num_generations must be even and >= 2 (NC-GRPO splits each group into G/2 clean and G/2 "
                f"noisy rollouts), got {g!r}"
            )
        self.rollout_methods = tuple(self.rollout_methods)  # a list on the command line, kept as a tuple
        from ncgrpo.core.plan import ROLLOUT_METHODS

        unknown = [m for m in self.rollout_methods if m not in ROLLOUT_METHODS]
        if unknown:
            raise ValueError(f"rollout_methods: {unknown} unknown; choose from {', '.join(ROLLOUT_METHODS)}")
        needs_all = sorted(set(self.rollout_methods) - {"vanilla", "latent"})
        if needs_all and not self.all_methods:
            raise ValueError(f"rollout_methods: {needs_all} train only with --all_methods; add it")
        if self.all_methods and g % 4:
            raise ValueError(
                f"--all-methods includes the antithetic and SPSA probes, which pair the noisy half in "
                f"(+eps, -eps), so num_generations must be a multiple of 4; got {g}"
            )
        if not isinstance(self.val_limit, int) or self.val_limit < 0:
            raise ValueError(f"val_limit must be an integer >= 0 (0: no validation), got {self.val_limit!r}")
        if self.val_limit > self.validation_size:
            raise ValueError(
                f"val_limit={self.val_limit} asks for more validation questions per family than the suite's "
                f"validation_size={self.validation_size}"
            )
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        from transformers.trainer_utils import SchedulerType

        schedules = [s.value for s in SchedulerType]
        if self.lr_scheduler_type not in schedules:
            raise ValueError(
                f"lr_scheduler_type must be one of TRL's schedules ({', '.join(schedules)}), "
                f"got {self.lr_scheduler_type!r}"
            )
        if self.num_threads == 0:
            self.num_threads = None  # torch's default, as --num_threads 0 has always meant
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 (0 or None: torch's default), got {self.num_threads}")
        from ncgrpo.core.noise import parse_noise_site

        self.noise_site = str(self.noise_site).replace(" ", "")
        parse_noise_site(self.noise_site)  # raises, saying what to write
        dev = self.device.split(":")[0]
        if dev not in _DEVICES:
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        from ncgrpo.models import check_device

        check_device(self.device)  # before anything is written

    # -- derived ------------------------------------------------------------------------------------
    @property
    def decoding(self) -> Any:
        """The evaluation's settings (:class:`ncgrpo.eval.evaluate.DecodingSettings`: greedy,
        ``max_new_tokens`` per answer, ``eval_batch_size`` prompts per batch), for the test split and
        the validation during training; constructing it checks them."""
        from ncgrpo.eval.evaluate import DecodingSettings

        return DecodingSettings(max_new_tokens=self.max_new_tokens, batch_size=self.eval_batch_size)

    def trainer_settings(self) -> dict[str, Any]:
        """The ``NCGRPOConfig`` settings every run of the demo is given as they are: each field of this
        config that ``NCGRPOConfig`` has too, by name (``max_steps``, ``num_generations``,
        ``learning_rate``, ...), but :data:`NOT_FOR_EVERY_RUN`."""
        from ncgrpo.trainer import NCGRPOConfig

        trainer = {f.name for f in dataclasses.fields(NCGRPOConfig)}
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name in trainer and f.name not in NOT_FOR_EVERY_RUN
        }

    @property
    def batch_size(self) -> int:
        """TRL's per_device_train_batch_size: completions per step (prompts x G)."""
        return self.prompts_per_step * self.num_generations

    @property
    def k_mid(self) -> float:
        """eq. (3)'s midpoint scaled to this run's K, so the anneal has the paper's shape."""
        return PAPER_K_MID / PAPER_K * self.max_steps

    @property
    def validation_every(self) -> int:
        return self.val_every if self.val_every is not None else max(1, round(self.max_steps / 6))

    @property
    def suite_sizes(self) -> dict[str, int]:
        return {"train": self.train_size, "validation": self.validation_size, "test": self.test_size}

    def methods(self) -> list[MethodSpec]:
        """The configurations trained, baseline first (the paper's row order)."""
        # the paper's site is unmarked; the propagating variant says where it acts
        site = "" if self.noise_site == "final_norm" else f" @L{self.noise_site}"
        tag = "" if self.noise_site == "final_norm" else "-L" + self.noise_site.replace(",", "_")
        noise = {"noise_site": self.noise_site}  # where the noise acts: the hidden-noise methods' setting
        out = [MethodSpec(BASELINE, "grpo", "vanilla")]
        for s in self.sigma0:
            out.append(
                MethodSpec(
                    f"NC-GRPO σ0={s:g}{site}", f"ncgrpo-sigma{s:g}{tag}", "latent", {"sigma0": s, **noise}
                )
            )
        if self.all_methods:
            s = self.sigma0[0]
            out += [
                MethodSpec("NoisyRollout (image)", "image", "image"),
                MethodSpec(
                    f"Antithetic σ0={s:g}{site}",
                    f"antithetic-sigma{s:g}{tag}",
                    "antithetic",
                    {"sigma0": s, **noise},
                ),
                MethodSpec(f"SPSA σ0={s:g}{site}", f"spsa-sigma{s:g}{tag}", "spsa", {"sigma0": s, **noise}),
                MethodSpec(
                    f"First-token T0={self.first_token_temperature:g}",
                    f"first-token-t{self.first_token_temperature:g}",
                    "first_token_temperature",
                    {"first_token_temperature": self.first_token_temperature},
                ),
            ]
            if self.noise_site == "final_norm":  # q̄ of the final-norm site only (through the LM head)
                out.append(
                    MethodSpec(
                        f"First-token q̄ σ0={s:g}",
                        f"first-token-marginal-sigma{s:g}",
                        "first_token_marginal",
                        {"sigma0": s},
                    )
                )
        if self.rollout_methods:
            out = [m for m in out if m.rollout_method in ("vanilla", *self.rollout_methods)]
        return out

    def seed_values(self) -> list[int]:
        return list(range(self.seeds))

    def worker_count(self, runs: int) -> int:
        """Processes that train ``runs`` runs at once: ``workers`` if given, else (CPU) the usable cores
        divided by the threads each run takes, or 1 (a GPU, or torch's default threads: all cores)."""
        if runs < 1:
            return 1
        if self.workers is not None:
            return min(self.workers, runs)
        if self.device != "cpu" or self.num_threads is None:
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(runs, cores // self.num_threads))


@dataclass
class RunResult:
    """One (configuration, seed): where it trained and evaluated, and what this call did."""

    name: str
    method: str
    seed: int
    train_dir: Path
    eval_dir: Path
    trained: bool  # trained in this call (False: a finished run was found and skipped)
    evaluated: bool  # evaluated in this call
    train_time_s: float = 0.0
    eval_time_s: float = 0.0
    accuracy: dict[str, float] = field(default_factory=dict)  # benchmark -> accuracy on the test split
    #: mean ``noise/first_token_marginal_tv`` / ``noise/first_token_tv`` over the steps before the anneal's
    #: midpoint (None where not logged)
    marginal_tv: float | None = None
    per_draw_tv: float | None = None
    #: mean of ``noise/first_token_divergence`` over training (two-pass methods): how often a noisy
    #: rollout's first token differed from the clean branch point's argmax. 0 with the final-norm site
    #: means the noise never changed a rollout, i.e. the run was token-for-token vanilla GRPO.
    first_token_divergence: float | None = None


@dataclass
class DemoResult:
    out: Path
    base_model: Path
    runs: list[RunResult]
    table: Any  # ncgrpo.eval.report.ComparisonTable
    files: dict[str, Path]
    stage_times_s: dict[str, float]
    wall_time_s: float
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "base_model": str(self.base_model),
            "wall_time_s": round(self.wall_time_s, 2),
            "notes": list(self.notes),
            "stage_times_s": {k: round(v, 2) for k, v in self.stage_times_s.items()},
            "files": {k: str(v) for k, v in self.files.items()},
            "runs": [
                {
                    **{k: v for k, v in asdict(r).items() if k not in ("train_dir", "eval_dir")},
                    "train_dir": str(r.train_dir),
                    "eval_dir": str(r.eval_dir),
                }
                for r in self.runs
            ],
        }


# ------------------------------------------------------------------------------------------ helpers
def _say(cfg: DemoConfig, msg: str) -> None:
    if cfg.progress:
        print(msg, flush=True)


def validation_accuracy(
    model: Any, processor: Any, questions: Sequence[Any], *, max_new_tokens: int, batch_size: int
) -> dict[str, float]:
    """Greedy, noise-free accuracy on ``questions``: ``val/accuracy`` (all of them) and
    ``val/accuracy/<role>`` per role present (in_domain, ood, general). Restores the model's mode."""
    from ncgrpo.eval.evaluate import DecodingSettings, eval_mode, score_greedy

    settings = DecodingSettings(max_new_tokens=max_new_tokens, batch_size=batch_size)
    by_role: dict[str, list[bool]] = {}
    questions = list(questions)
    with eval_mode(model):
        for start in range(0, len(questions), batch_size):
            batch = questions[start : start + batch_size]
            for q, (_, s) in zip(batch, score_greedy(model, processor, batch, settings), strict=True):
                by_role.setdefault(q.role, []).append(bool(s.correct))
    everything = [ok for oks in by_role.values() for ok in oks]
    out = {"val/accuracy": sum(everything) / len(everything)}
    for role in ("in_domain", "ood", "general"):
        if role in by_role:
            out[f"val/accuracy/{role}"] = sum(by_role[role]) / len(by_role[role])
    return out


def _callbacks(
    cfg: DemoConfig, name: str, model: Any, processor: Any, val_questions: list[Any], metrics_path: Path
) -> list[Any]:
    """MetricsCallback (``ncgrpo train``'s writer), periodic validation and a one-line progress bar."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    from ncgrpo.driver import MetricsCallback

    # A second writer of the file train_run's own MetricsCallback writes, for the validation lines only:
    # it is not a trainer callback itself (that would write every training log line twice).
    metrics = MetricsCallback(metrics_path)

    class Validation(TrainerCallback):
        """Greedy validation accuracy at step 0, every ``every`` steps and at the last step, written
        through the metrics callback as its own line (``{"step": k, "val/accuracy": ...}``)."""

        def __init__(self) -> None:
            self.last: dict[str, float] = {}

        def _run(self, args, state, control) -> None:
            self.last = validation_accuracy(
                model,
                processor,
                val_questions,
                max_new_tokens=cfg.max_new_tokens,
                batch_size=cfg.eval_batch_size,
            )
            metrics.on_log(args, state, control, logs=dict(self.last))

        def on_train_begin(self, args, state, control, **kwargs):
            if val_questions and state.global_step == 0:
                self._run(args, state, control)

        def on_step_end(self, args, state, control, **kwargs):
            k = state.global_step
            if val_questions and (k % cfg.validation_every == 0 or k == state.max_steps):
                self._run(args, state, control)

    val = Validation()

    class Progress(TrainerCallback):
        """One tqdm bar per run with the latest reward, noise scale and validation accuracy."""

        def __init__(self) -> None:
            self.bar = None
            self.post: dict[str, str] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(
                total=state.max_steps,
                initial=state.global_step,
                desc=f"train {name}",
                unit="step",
                disable=not cfg.progress,
            )

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "reward" in logs:
                self.post["reward"] = f"{logs['reward']:.3f}"
            if "noise/sigma_k" in logs:
                self.post["sigma"] = f"{logs['noise/sigma_k']:.3f}"
            if val.last:
                self.post["val"] = f"{val.last['val/accuracy']:.3f}"
            self.bar.set_postfix(self.post, refresh=False)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return [val, Progress()]


def _metric_means(cfg: DemoConfig, result: RunResult) -> None:
    """The run's logged noise measures, from one read of its metrics: ``noise/first_token_divergence``
    over training, and the first-token TVs over the steps before eq. (3)'s midpoint (the noise at
    full scale). None where never logged."""
    from ncgrpo.eval.plots import read_metrics

    rows = read_metrics(result.train_dir)

    def mean(key: str, last_step: float | None = None) -> float | None:
        vals = [
            row[key]
            for row in rows
            if isinstance(row.get(key), int | float)
            and (last_step is None or row.get("step", 0) <= last_step)
        ]
        vals = [float(v) for v in vals if math.isfinite(v)]
        return sum(vals) / len(vals) if vals else None

    result.first_token_divergence = mean("noise/first_token_divergence")
    result.marginal_tv = mean("noise/first_token_marginal_tv", cfg.k_mid)
    result.per_draw_tv = mean("noise/first_token_tv", cfg.k_mid)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- stages
def _ensure_suite(cfg: DemoConfig) -> Path:
    """Build and export the synthetic suite once into ``OUT/suite`` (Geometry3K's schema); its seed and
    sizes are kept in ``suite.json``, and a rerun with others is refused."""
    from ncgrpo.runs.folder import atomic_write_json, changed_identity
    from ncgrpo.toy.synthetic import build_suite, export_geo3k

    path = cfg.output_dir / "suite"
    marker = path / SUITE_MARKER
    settings = {"seed": cfg.suite_seed, "sizes": cfg.suite_sizes}
    try:
        found = json.loads(marker.read_text(encoding="utf-8")) if marker.is_file() else None
    except ValueError:
        found = None  # a torn file: the suite is exported again
    if isinstance(found, dict):
        changed = changed_identity(found.get("settings", {}), settings, settings)
        if changed:
            raise ValueError(
                f"{marker}: this folder's suite was built with other settings ({', '.join(changed)}); use "
                "another --output_dir or delete the folder to redo it"
            )
        return path
    _say(cfg, f"building the synthetic suite (seed {cfg.suite_seed}, {cfg.suite_sizes}) -> {path}")
    suite = build_suite(seed=cfg.suite_seed, sizes=cfg.suite_sizes)
    export_geo3k(suite, path)
    atomic_write_json(marker, {"settings": settings, "counts": {k: len(v) for k, v in suite.items()}})
    return path


def _base_model(cfg: DemoConfig) -> Path:
    if cfg.model_name_or_path is not None:
        return cfg.model_name_or_path
    from ncgrpo.toy.pretrain import ensure_base_model

    _say(cfg, "getting the embedded base model (built on first use, then cached)")
    return ensure_base_model(cfg.cache_dir)


def _dtype_for(device: str) -> str:
    return "float32" if device == "cpu" else "auto"


@dataclass(frozen=True)
class DemoRun:
    """One training run of the demo (a configuration and a seed) and its evaluation: what the stages
    that train and evaluate it are given (sent to a worker process as it is)."""

    cfg: DemoConfig
    spec: MethodSpec
    seed: int
    base: Path  # the base model's folder
    base_id: str  # its model id (ncgrpo.eval.evaluate.model_id_of)

    @property
    def folder_name(self) -> str:
        return f"{self.spec.slug}-seed{self.seed}"

    @property
    def train_dir(self) -> Path:
        return self.cfg.output_dir / "train" / self.folder_name

    @property
    def eval_dir(self) -> Path:
        return self.cfg.output_dir / "eval" / self.folder_name

    def training_args(self, *, bf16: bool = False) -> Any:
        """The run's ``NCGRPOConfig``, what ``ncgrpo train`` would be given: the demo's
        :meth:`DemoConfig.trainer_settings`, the method's own (:attr:`MethodSpec.fields`), the batch
        (``prompts_per_step * G``), eq. (3)'s ``k_mid`` scaled to ``max_steps`` and
        :data:`TRAINER_FIXED`."""
        from ncgrpo.trainer import NCGRPOConfig

        cfg = self.cfg
        return NCGRPOConfig(
            **cfg.trainer_settings(),
            **self.spec.fields,
            **TRAINER_FIXED,
            output_dir=str(self.train_dir),
            run_name=self.folder_name,
            rollout_method=self.spec.rollout_method,
            seed=self.seed,
            per_device_train_batch_size=cfg.batch_size,
            schedule_k_mid=cfg.k_mid,
            use_cpu=cfg.device == "cpu",
            bf16=bf16,
        )

    def settings(self) -> dict[str, Any]:
        """What makes the run what it is (its ``config.yaml``; a rerun with any of them changed is
        refused): its ``NCGRPOConfig``'s identity as ``ncgrpo train`` defines it
        (:func:`ncgrpo.runs.identity.run_identity_keys`; the base model's id as ``model_name_or_path``),
        every setting the demo gives its runs (:meth:`DemoConfig.trainer_settings`, TRL's fields too),
        then every :class:`DemoConfig` field ``NCGRPOConfig`` has not, but :data:`NOT_RUN_SETTINGS`
        (``val_every`` resolved)."""
        from ncgrpo.runs.identity import MAY_CHANGE_ON_RESUME, run_identity_keys
        from ncgrpo.trainer import NCGRPOConfig

        args = self.training_args().to_dict()
        values = {**args, "model_name_or_path": self.base_id, "dtype": _dtype_for(self.cfg.device)}
        out = {k: values.get(k) for k in run_identity_keys((NCGRPOConfig,))}
        for k in self.cfg.trainer_settings():  # what the demo sets, TRL's own fields too (max_grad_norm, ...)
            if k not in MAY_CHANGE_ON_RESUME:
                out.setdefault(k, values.get(k))
        for f in dataclasses.fields(self.cfg):
            if f.name not in args and f.name not in NOT_RUN_SETTINGS:
                out[f.name] = getattr(self.cfg, f.name)
        out["val_every"] = self.cfg.validation_every
        return out

    def eval_identity(self) -> dict[str, Any]:
        """The arguments of :func:`ncgrpo.eval.evaluate.evaluate` that say whose records its folder
        holds (the trained model's id: its folder must hold the finished run)."""
        from ncgrpo.eval.evaluate import model_id_of

        return dict(
            model_id=model_id_of(self.train_dir),
            seed=self.seed,
            name=self.spec.name,
            method=self.spec.rollout_method,
        )


def check_settings(cfg: DemoConfig, base: Path) -> None:
    """Every setting, checked before anything is written (as ``ncgrpo train`` does): each configuration's
    ``NCGRPOConfig`` (e.g. SPSA only at the final-norm site), the noise site against the base model's
    decoder layers, read from its config, and the evaluation's settings. A ``ValueError`` says which
    configuration and what."""
    from ncgrpo.models import check_noise_site

    _ = cfg.decoding
    for spec in cfg.methods():
        try:
            args = DemoRun(cfg, spec, 0, base, "").training_args()
            if spec.rollout_method in HIDDEN_NOISE_METHODS:
                check_noise_site(args.noise_site, base)
        except ValueError as e:
            raise ValueError(f"{spec.name}: {e}") from None


def _check_same_run(train_dir: Path, settings: dict[str, Any]) -> None:
    """Refuse to reuse a finished run whose ``config.yaml`` holds other settings (or none)."""
    import yaml

    from ncgrpo.runs.folder import changed_identity

    path = train_dir / CONFIG_FILE
    redo = "use another --output_dir or delete the folder to redo it"
    try:
        old = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ValueError(
            f"{train_dir} holds a finished run without {CONFIG_FILE} (written by an older ncgrpo demo), so "
            f"its settings cannot be compared with this run's; {redo}"
        ) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the run's settings to compare ({e}); {redo}") from None
    changed = changed_identity(old if isinstance(old, dict) else {}, settings, settings)
    if changed:
        raise ValueError(
            f"{path}: this folder holds a finished run with other settings ({', '.join(changed)}); {redo}"
        )


def _recorded_accuracy(
    eval_dir: Path, identity: dict[str, Any], decoding: Any, questions: list[Any]
) -> dict[str, float] | None:
    """Accuracy per benchmark (as :func:`ncgrpo.eval.evaluate.evaluate` gives it) when ``eval_dir``
    holds a record of every question, else None (not evaluated yet, or cut short: evaluate appends
    the rest). Refused: a folder of another identity (eval's own check,
    :func:`ncgrpo.eval.evaluate.check_folder`), or one holding records of questions not asked here."""
    from ncgrpo.eval.evaluate import check_folder, run_identity
    from ncgrpo.eval.records import iter_records

    records = eval_dir / RECORDS_FILE
    if check_folder(eval_dir, run_identity(settings=decoding, **identity)) is None or not records.is_file():
        return None
    wanted = {(q.benchmark, q.question_id) for q in questions}
    correct: dict[str, list[int]] = {}
    other = []
    for r in iter_records(records):
        if r.key in wanted:
            correct.setdefault(r.benchmark, []).append(int(r.correct))
        else:
            other.append(r.key)
    if other:
        raise ValueError(
            f"{records}: holds records of {len(other)} questions this demo does not ask (e.g. "
            f"{'/'.join(map(str, other[0]))}: eval_limit or the suite changed); use another --output_dir or "
            "delete the folder to redo it"
        )
    if sum(map(len, correct.values())) < len(wanted):
        return None
    return {b: sum(v) / len(v) for b, v in sorted(correct.items())}


def _train(
    run: DemoRun, settings: dict[str, Any], train_questions: list[Any], val_questions: list[Any]
) -> tuple[Any, Any]:
    """One run through :func:`ncgrpo.driver.train_run` (``ncgrpo train``'s driver), its
    ``settings`` written to ``config.yaml`` first; returns the trained (model, processor), saved to
    the run's folder with ``run.json`` marked finished."""
    import torch
    import yaml

    from ncgrpo.data.geometry3k import to_trl_dataset
    from ncgrpo.driver import train_run
    from ncgrpo.models import find_vision_tower, freeze_vision_tower, load_model_and_processor
    from ncgrpo.rewards import math_reward
    from ncgrpo.runs.folder import FolderLock, atomic_write_text

    cfg, spec, seed, out = run.cfg, run.spec, run.seed, run.train_dir
    model, processor = load_model_and_processor(run.base, dtype=_dtype_for(cfg.device), device=cfg.device)
    if find_vision_tower(model) is not None:
        freeze_vision_tower(model)  # section 4.1: frozen vision tower
    args = run.training_args(bf16=next(model.parameters()).dtype == torch.bfloat16)
    with FolderLock(out, "ncgrpo demo", kind="train"):  # before the first write; train_run re-enters it
        (out / METRICS_FILE).unlink(missing_ok=True)  # an unfinished earlier attempt restarts from step 0
        atomic_write_text(out / CONFIG_FILE, yaml.safe_dump(settings, sort_keys=False, allow_unicode=True))
        trainer = train_run(
            args,
            model,
            processor,
            to_trl_dataset(train_questions),
            reward_funcs=[math_reward],
            run_info={
                "name": spec.name if cfg.seeds == 1 else f"{spec.name} (seed {seed})",
                "method": spec.rollout_method,
                "seed": seed,
                "model": str(run.base),
            },
            callbacks=_callbacks(
                cfg, f"{spec.slug} s{seed}", model, processor, val_questions, out / METRICS_FILE
            ),
            console_logs=False,
        )
    model = trainer.model
    del trainer
    return model, processor


def _run_one(
    run: DemoRun, train_questions: list[Any], val_questions: list[Any], test_questions: list[Any]
) -> RunResult:
    from ncgrpo.eval.evaluate import evaluate
    from ncgrpo.runs.folder import read_run_json

    cfg, spec = run.cfg, run.spec
    settings = run.settings()
    result = RunResult(spec.name, spec.rollout_method, run.seed, run.train_dir, run.eval_dir, False, False)
    model = processor = None
    found = read_run_json(run.train_dir)
    if found is not None and found.get("finished"):
        _check_same_run(run.train_dir, settings)
        accuracy = _recorded_accuracy(run.eval_dir, run.eval_identity(), cfg.decoding, test_questions)
        if accuracy is not None:
            result.accuracy = accuracy
            _metric_means(cfg, result)
            _say(cfg, f"{run.folder_name}: trained and evaluated already (skipped)")
            return result
        _say(cfg, f"{run.folder_name}: trained already (skipped); evaluating")
    else:
        _say(cfg, f"{run.folder_name}: training {spec.name} (seed {run.seed}) for {cfg.max_steps} steps")
        t0 = time.perf_counter()
        model, processor = _train(run, settings, train_questions, val_questions)
        result.train_time_s = time.perf_counter() - t0
        result.trained = True

    _metric_means(cfg, result)
    t0 = time.perf_counter()
    if model is None:
        from ncgrpo.models import load_model_and_processor

        model, processor = load_model_and_processor(
            run.train_dir, dtype=_dtype_for(cfg.device), device=cfg.device
        )
    summary = evaluate(
        model,
        processor,
        test_questions,
        run.eval_dir,
        settings=cfg.decoding,
        progress=cfg.progress,
        **run.eval_identity(),
    )
    result.eval_time_s = time.perf_counter() - t0
    result.evaluated = True
    result.accuracy = dict(summary.accuracy)
    del model, processor
    _free(cfg.device)
    return result


def _evaluate_base(cfg: DemoConfig, base: Path, base_id: str, test_questions: list[Any]) -> Path:
    """Greedy test records of the untrained base model (the table's first row), once per folder."""
    from ncgrpo.eval.evaluate import evaluate
    from ncgrpo.models import load_model_and_processor

    eval_dir = cfg.output_dir / "eval" / "base"
    identity = dict(model_id=base_id, seed=0, name=BASE_NAME, method="base")
    if _recorded_accuracy(eval_dir, identity, cfg.decoding, test_questions) is not None:
        return eval_dir
    _say(cfg, "evaluating the base model")
    model, processor = load_model_and_processor(base, dtype=_dtype_for(cfg.device), device=cfg.device)
    evaluate(
        model, processor, test_questions, eval_dir, settings=cfg.decoding, progress=cfg.progress, **identity
    )
    del model, processor
    _free(cfg.device)
    return eval_dir


def _report(
    cfg: DemoConfig, runs: list[RunResult], console: Any = None, base_eval: Path | None = None
) -> tuple[Any, dict[str, Path]]:
    """The paper's tables (printed; Markdown/LaTeX/JSON files) and figures from the saved files; the
    base model's row first when ``base_eval`` is given."""
    from ncgrpo.eval.plots import plot_dynamics, plot_gains, read_metrics
    from ncgrpo.eval.report import compare, load_runs, print_rich, to_latex, to_markdown
    from ncgrpo.runs.folder import atomic_write_json, atomic_write_text

    dirs = ([base_eval] if base_eval is not None else []) + [r.eval_dir for r in runs]
    ct = compare(load_runs(dirs), BASELINE)
    if cfg.progress:
        print_rich(ct, console)
    files = {
        "table_md": cfg.output_dir / "table.md",
        "table_tex": cfg.output_dir / "table.tex",
        "table_json": cfg.output_dir / "table.json",
    }
    atomic_write_text(files["table_md"], to_markdown(ct))
    atomic_write_text(files["table_tex"], to_latex(ct))
    atomic_write_json(files["table_json"], json.loads(json.dumps(ct.to_json(), default=str)))

    plots = cfg.output_dir / "plots"
    if len({r.name for r in runs}) > 1:
        for p in plot_gains(
            ct, None, plots / "gains", title="Demo: gains over vanilla GRPO (* exact McNemar p<0.05)"
        ):
            files[f"gains{p.suffix}"] = p
    logged = {k for r in runs for row in read_metrics(r.train_dir) for k in row}
    val_keys = [
        k for k in ("val/accuracy/in_domain", "val/accuracy/ood", "val/accuracy/general") if k in logged
    ]
    if val_keys:
        for p in plot_dynamics(
            [r.train_dir for r in runs],
            plots / "dynamics",
            reward_key="reward",
            val_key=val_keys,
            title="Demo: training reward and greedy validation accuracy",
        ):
            files[f"dynamics{p.suffix}"] = p
    return ct, files


_TRACE_KEYS = ("reward", "reward_std", "loss", "completions/mean_length")


def _trace(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Per-step (step, reward, reward_std, loss, mean length) of a run's metrics rows: equal traces mean
    equal rollouts."""
    return [tuple(row.get(k) for k in ("step", *_TRACE_KEYS)) for row in rows if "reward" in row]


def _notes(cfg: DemoConfig, runs: list[RunResult]) -> list[str]:
    """What the reader of the table must know to read it right.

    A two-pass run whose every logged reward, reward spread, loss and completion length equals the
    vanilla run of the same seed sampled exactly vanilla's rollouts: its noise changed nothing. At the
    final-norm site this happens when the base model's first token is near-certain, because there the
    noise reaches only the first-token logits (section 3.1: a branch-point intervention).

    Unless no group had reward variance (:func:`ncgrpo.trainer.inert.reward_variance`: every logged
    step's ``frac_reward_zero_std`` is 1, e.g. every completion clipped at a short
    ``max_completion_length`` and scored 0): then every advantage was zero, nothing was learned, and
    equal traces say nothing about the noise. Such runs get that note instead, blaming the rewards.
    """
    from ncgrpo.eval.plots import read_metrics
    from ncgrpo.trainer.inert import reward_variance

    rows = {r.train_dir: read_metrics(r.train_dir) for r in runs}  # each run's metrics, read once
    vanilla = {r.seed: r for r in runs if r.method == "vanilla"}
    same = []
    flat = []
    for r in runs:
        rv = reward_variance(rows[r.train_dir])
        if rv.none_at_all:
            flat.append(f"{r.name} (seed {r.seed}): {rv.describe()}")
            continue
        base = vanilla.get(r.seed)
        if r.method == "vanilla" or base is None:
            continue
        if reward_variance(rows[base.train_dir]).none_at_all:
            continue  # vanilla learned nothing: equal traces say nothing about the noise
        if _trace(rows[r.train_dir]) == _trace(rows[base.train_dir]):
            div = "n/a" if r.first_token_divergence is None else f"{r.first_token_divergence:.4f}"
            same.append(f"{r.name} (seed {r.seed}; mean noise/first_token_divergence {div})")
    notes = []
    if flat:
        notes.append(
            "; ".join(flat)
            + ". With equal rewards in every group every advantage is zero, so these runs learned nothing, "
            "and their logged steps can equal another run's whatever the noise did: the noise is not what "
            "failed here. Give the model room to answer (raise --max_completion_length; see "
            "completions/clipped_ratio in metrics.jsonl) or use a base whose groups get mixed rewards."
        )
    measured = [r for r in runs if r.marginal_tv is not None]
    if measured:
        notes.append(
            "What the noise did to the rollouts (mean over steps 1-"
            f"{cfg.k_mid:g}, before the anneal): noise-averaged first-token TV "
            + "; ".join(
                f"{r.name} seed {r.seed} {r.marginal_tv:.4f}"
                + ("" if r.per_draw_tv is None else f" (per draw {r.per_draw_tv:.4f})")
                for r in measured
            )
            + ". The noise-averaged TV is what the noisy half samples its first token from; the per-draw TV "
            "describes one draw and overstates it."
        )
    if not same:
        return notes
    note = (
        f"{'; '.join(same)}: every logged step (reward, reward std, loss, completion length) equals {BASELINE}'s "
        "of the same seed, so the noisy half sampled exactly vanilla GRPO's rollouts and the two models are the "
        "same (McNemar p = 1)."
    )
    if cfg.noise_site == "final_norm":
        note += (
            " At the final-norm site the noise reaches only the first-token logits (section 3.1), and this base "
            "model's first token is a near-certain format token. The propagating variant, which reaches the KV "
            "cache, is --noise-site <decoder layer index> (e.g. 1)."
        )
    return [*notes, note]


# --------------------------------------------------------------------------------- parallel runs
def _load_questions(
    cfg: DemoConfig, suite: Path, *, training: bool = True
) -> tuple[list[Any], list[Any], list[Any]]:
    """(train, validation, test) questions of the exported suite, read back through the Geometry3K loader;
    ``training=False`` (a process that trains nothing) leaves the first two empty."""
    from ncgrpo.data.geometry3k import load_geometry3k

    test = first_per_family(load_geometry3k(suite, "test"), cfg.eval_limit)
    if not training:
        return [], [], test
    train = load_geometry3k(suite, "train")
    val = first_per_family(load_geometry3k(suite, "validation"), cfg.val_limit) if cfg.val_limit else []
    return train, val, test


#: A worker process's questions, loaded once per suite and limits (a worker may get several runs).
_WORKER_QUESTIONS: dict[tuple[Any, ...], tuple[list[Any], list[Any], list[Any]]] = {}


def quiet_libraries() -> None:
    """The demo prints its own progress: one bar per training run and per evaluation. Library chatter
    (weight-loading and parquet bars, info logs, TRL's deprecation notices for transformers v6) is
    silenced, in the demo's process and in each worker."""
    global _QUIET
    import warnings

    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)
    _QUIET = True


_QUIET = False  # quiet_libraries() was called in this process: workers are quieted too


def _worker_init(num_threads: int | None, parent_pid: int, quiet: bool = False) -> None:
    """Start of each worker process: die with the demo process, take its thread count and (``quiet``)
    the demo's silence about library chatter (:func:`quiet_libraries`)."""
    if sys.platform.startswith("linux"):
        # PR_SET_PDEATHSIG: the kernel SIGKILLs this worker when the demo process dies, even by SIGKILL,
        # so no orphan goes on writing a run folder that a rerun of the demo will write too.
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent_pid:  # the demo died before the line above took effect
            os._exit(1)
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if quiet:
        quiet_libraries()


def _run_in_worker(run: DemoRun, suite: Path) -> RunResult:
    key = (str(suite), run.cfg.val_limit, run.cfg.eval_limit)
    if key not in _WORKER_QUESTIONS:
        _WORKER_QUESTIONS[key] = _load_questions(run.cfg, suite)
    return _run_one(run, *_WORKER_QUESTIONS[key])


def _steps_done(train_dir: Path) -> int:
    """Optimizer steps logged so far in ``train_dir/metrics.jsonl`` (the progress bar's count)."""
    from ncgrpo.eval.plots import read_metrics

    try:
        rows = read_metrics(train_dir)  # a line still being written is a torn tail, dropped
    except (OSError, ValueError):  # not started yet, or unreadable: a progress bar never stops the runs
        return 0
    return max((row["step"] for row in rows if "reward" in row), default=0)


def _run_in_processes(cfg: DemoConfig, jobs: list[DemoRun], workers: int, suite: Path) -> list[RunResult]:
    """Each run in its own worker process, ``workers`` at once; results in ``jobs`` order.

    The runs share nothing but the read-only suite and base model: each is seeded by its own seed and
    writes only its own train and eval folders, so its records equal a one-process run's. A worker's
    error is raised here and stops the others (their folders stay unfinished; a rerun restarts them).
    """
    import multiprocessing

    from tqdm.auto import tqdm

    quiet = replace(cfg, progress=False)  # one progress bar, here, instead of one per process
    _say(
        cfg,
        f"training {len(jobs)} runs, {workers} at a time, one process each "
        f"({cfg.num_threads or 'all'} torch thread(s) per process)",
    )
    dirs = [run.train_dir for run in jobs]
    bar = tqdm(total=len(jobs) * cfg.max_steps, desc="train", unit="step", disable=not cfg.progress)
    results: dict[int, RunResult] = {}
    try:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch or thread state
        with ctx.Pool(
            workers, initializer=_worker_init, initargs=(cfg.num_threads, os.getpid(), _QUIET)
        ) as pool:
            pending = {
                i: pool.apply_async(_run_in_worker, (replace(run, cfg=quiet), suite))
                for i, run in enumerate(jobs)
            }
            while pending:
                next(iter(pending.values())).wait(1.0)
                for i in [i for i, r in pending.items() if r.ready()]:
                    r = results[i] = pending.pop(i).get()  # a worker's exception is raised here
                    if cfg.progress:
                        done = ("trained, " if r.trained else "") + (
                            "evaluated" if r.evaluated else "done already"
                        )
                        bar.write(
                            f"{dirs[i].name}: {done} (train {r.train_time_s:.0f} s, eval {r.eval_time_s:.0f} s)"
                        )
                bar.update(sum(min(_steps_done(d), cfg.max_steps) for d in dirs) - bar.n)
            # let the workers exit on their own: the with block's terminate() kills them, and a killed spawn
            # worker can leave a semaphore that the resource tracker warns about at shutdown
            pool.close()
            pool.join()
    finally:
        bar.close()
    return [results[i] for i in range(len(jobs))]


# ---------------------------------------------------------------------------------------------- run
def run_demo(
    cfg: DemoConfig, *, console: Any = None, on_stage: Callable[[str], None] | None = None
) -> DemoResult:
    """Run the whole protocol (see the module docstring) into ``cfg.output_dir``; returns what it did.

    ``on_stage(name)`` is called as each stage starts (suite, base_model, train_eval, report).
    """
    import torch

    from ncgrpo.eval.evaluate import model_id_of
    from ncgrpo.runs.folder import FolderLock, atomic_write_json, claim_folder

    t_start = time.perf_counter()
    stage_times: dict[str, float] = {}
    previous_threads = torch.get_num_threads()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)

    def stage(name: str, fn: Callable[[], Any]) -> Any:
        if on_stage is not None:
            on_stage(name)
        t0 = time.perf_counter()
        value = fn()
        stage_times[name] = stage_times.get(name, 0.0) + time.perf_counter() - t0
        return value

    # one demo per folder (a second fails at once, naming the first), and only into a new folder or a
    # demo's own: never into a training run, an evaluation or a saved model
    lock = FolderLock(cfg.output_dir, "ncgrpo demo", kind="demo")
    try:
        lock.check()
        # the base model (built into its cache on first use) and every setting, before the first byte
        # of the output folder is written
        base = stage("base_model", lambda: _base_model(cfg))
        check_settings(cfg, base)
        claim_folder(lock)  # held, and the folder's run.json says kind demo
        suite = stage("suite", lambda: _ensure_suite(cfg))
        base_id = model_id_of(base)
        specs, seeds = cfg.methods(), cfg.seed_values()
        jobs = [DemoRun(cfg, spec, seed, base, base_id) for spec in specs for seed in seeds]
        workers = cfg.worker_count(len(jobs))
        # with workers, each worker loads what it trains on; here only the test split (the base's evaluation)
        train_q, val_q, test_q = stage(
            "load_data", lambda: _load_questions(cfg, suite, training=workers <= 1)
        )
        _say(
            cfg,
            f"{len(specs)} configuration(s) x {len(seeds)} seed(s), {cfg.max_steps} steps each "
            f"({cfg.prompts_per_step} prompts x G={cfg.num_generations}); test: {len(test_q)} questions; "
            f"base model: {base}",
        )
        runs: list[RunResult] = []

        def train_all() -> None:
            if workers > 1:
                runs.extend(_run_in_processes(cfg, jobs, workers, suite))
            else:
                runs.extend(_run_one(run, train_q, val_q, test_q) for run in jobs)

        base_eval = stage("base_eval", lambda: _evaluate_base(cfg, base, base_id, test_q))
        stage("train_eval", train_all)
        table, files = stage("report", lambda: _report(cfg, runs, console, base_eval))
        wall = time.perf_counter() - t_start
        result = DemoResult(cfg.output_dir, base, runs, table, files, stage_times, wall, _notes(cfg, runs))
        files["summary"] = cfg.output_dir / "summary.json"
        summary = result.to_json()
        summary["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
        atomic_write_json(files["summary"], summary)
        return result
    finally:
        lock.release()
        torch.set_num_threads(previous_threads)
