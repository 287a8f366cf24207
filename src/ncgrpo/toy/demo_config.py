"""``ncgrpo demo``'s settings: :class:`DemoConfig` (one flag each), the configurations it trains
(:class:`MethodSpec`) and what it returns (:class:`RunResult`, :class:`DemoResult`).

The protocol itself is described in :mod:`ncgrpo.toy.demo`. The demo's training settings are
``NCGRPOConfig``'s fields (:func:`_trainer_field`): same name, passed to every run as they are
(:meth:`DemoConfig.trainer_settings`), the default ``NCGRPOConfig``'s where the demo does not set its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ncgrpo.core.noise import parse_noise_site
from ncgrpo.eval.evaluate import DecodingSettings, model_id_of
from ncgrpo.methods import baseline_method, get_method, method_names, methods
from ncgrpo.models import check_device
from ncgrpo.runs.identity import MAY_CHANGE_ON_RESUME, run_identity_keys
from ncgrpo.trainer import NCGRPOConfig
from ncgrpo.trainer.config import TARGET_SCOPES, sigma0_problem

__all__ = [
    "BASELINE",
    "DEFAULT_STEPS",
    "DemoConfig",
    "DemoResult",
    "DemoRun",
    "MethodSpec",
    "RunResult",
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
NOT_FOR_EVERY_RUN = frozenset(
    {"output_dir", "sigma0", "target_marginal_tv", "target_scope", "noise_site", "first_token_temperature"}
)
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
def _trainer_field(name: str, help: str, *, default: Any = dataclasses.MISSING, listed: bool = False) -> Any:
    """A :class:`DemoConfig` field that is ``NCGRPOConfig``'s field ``name`` (the demo's runs get it under
    that name, :meth:`DemoConfig.trainer_settings`): its default is ``NCGRPOConfig``'s unless the demo
    gives its own ``default`` (``listed``: a list holding it, one run per value), its help the demo's
    (written for the demo's command line). A name ``NCGRPOConfig`` does not have fails here, at import,
    instead of silently becoming a demo-only setting."""
    trainer = NCGRPOConfig.__dataclass_fields__[name]
    value = trainer.default if default is dataclasses.MISSING else default
    if listed:
        return field(default_factory=lambda: [value], metadata={"help": help})
    return field(default=value, metadata={"help": help})


#: The most training seeds a demo takes: ``seeds x configurations`` runs of minutes each on a CPU (1000 seeds
#: of the default three configurations are days of CPU time), all planned before the first starts.
MAX_SEEDS = 1000


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

    output_dir: Path = _trainer_field(
        "output_dir",
        "output folder; rerunning into the same folder skips finished runs",
        default=Path("runs/demo"),
    )
    max_steps: int = _trainer_field(
        "max_steps",
        "optimizer steps per run, K of eq. (3); k_mid = 40/60 K (the paper's K is 60)",
        default=DEFAULT_STEPS,
    )
    seeds: int = field(
        default=1, metadata={"help": "training seeds per configuration; 3 gives the 3-seed table"}
    )
    sigma0: list[float] = _trainer_field(
        "sigma0", "NC-GRPO noise scale(s), one run each, e.g. --sigma0 0.2 0.5 (the paper's two)", listed=True
    )
    target_marginal_tv: list[float] = field(
        default_factory=list,
        metadata={
            "help": "noise-averaged first-token TV target(s): the noise methods the target schedule can set train "
            "one run per target (sigma_k solved each generation so the batch's TV(q, q_bar) is the annealed "
            "target) instead of one per sigma0, e.g. --target_marginal_tv 0.0066 0.03; `ncgrpo probe` gives the "
            "TV a sigma0 has. Empty (default): one run per sigma0"
        },
    )
    target_scope: str = _trainer_field(
        "target_scope",
        "with --target_marginal_tv: 'batch' (one sigma_k per generation for the batch's mean TV) or 'prompt' "
        "(each prompt's own sigma for its own TV); the prompt-scope runs are named 'TV=... per prompt' "
        "(folders '-tv...-prompt'), so both can share one demo folder",
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
    num_generations: int = _trainer_field(
        "num_generations", "rollouts per prompt, G; two-pass methods use G/2 clean + G/2 noisy"
    )
    prompts_per_step: int = field(default=8, metadata={"help": "prompts per optimizer step"})
    max_completion_length: int = _trainer_field("max_completion_length", "rollout token budget", default=48)
    max_new_tokens: int = field(default=64, metadata={"help": "evaluation token budget"})
    learning_rate: float = _trainer_field("learning_rate", "peak learning rate", default=1e-3)
    lr_scheduler_type: str = _trainer_field(
        "lr_scheduler_type",
        "learning-rate schedule, by TRL's names: linear (TRL's default: decays to 0 at the last step) or "
        "constant (the paper's EasyR1 recipe); on the toy, constant gave vanilla +5.3/+7.2/+2.8 points "
        "at 120 steps against linear's +6.3/+6.0/+5.7",
    )
    noise_site: str = _trainer_field(
        "noise_site",
        "where the hidden-noise methods perturb the prefill: final_norm (the paper's site) or "
        "decoder-layer indices such as 1 or 0,2 (the propagating variant)",
    )
    branch_prefix: str = _trainer_field(
        "branch_prefix",
        "text appended to the training generation prompt so the prefill ends where reasoning begins "
        "(the final-norm noise then acts on the first reasoning token instead of the near-certain "
        "'<think>'); rewards see it in front of the completion; evaluation uses the plain prompt",
        default="<think>",
    )
    first_token_temperature: float = _trainer_field(
        "first_token_temperature",
        "starting temperature T0 of the first-token control (--all_methods), annealed with the noise; "
        "1.02 is matched to sigma0 = 0.2 on the embedded base with branch_prefix '<think>' on what generates the "
        "rollouts: `ncgrpo probe --prompts 128 --sigma0 0.2 --branch_prefix '<think>'` gives noise-averaged "
        "first-token TV 0.0066 and matched T0 1.0195 (the per-draw TV, 0.076, would give 1.23, which moves the "
        "sampled distribution about 11x more than the noise does)",
        default=1.02,
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
        for s in self.sigma0:  # the trainer's bound, before any run starts
            problem = sigma0_problem(s)
            if problem is not None:
                raise ValueError(f"sigma0: every noise scale {problem}")
        if len(set(self.sigma0)) != len(self.sigma0):
            raise ValueError(f"sigma0: {list(self.sigma0)} lists a scale twice")
        self.target_marginal_tv = tuple(float(t) for t in self.target_marginal_tv)
        for t in self.target_marginal_tv:
            if not (math.isfinite(t) and 0 < t <= 1):
                raise ValueError(f"target_marginal_tv: every target is a TV in (0, 1], got {t}")
        if len(set(self.target_marginal_tv)) != len(self.target_marginal_tv):
            raise ValueError(f"target_marginal_tv: {list(self.target_marginal_tv)} lists a target twice")
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
        if self.seeds > MAX_SEEDS:
            raise ValueError(
                f"seeds must be at most {MAX_SEEDS}, got {self.seeds}: the demo trains and evaluates every "
                f"configuration once per seed (seeds x configurations runs, each minutes on a CPU; the seed table "
                f"uses 3) and plans them all before the first starts (a billion seeds grew to 23.7 GB)"
            )
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
        unknown = [m for m in self.rollout_methods if m not in method_names()]
        if unknown:
            raise ValueError(f"rollout_methods: {unknown} unknown; choose from {', '.join(method_names())}")
        needs_all = sorted(
            {
                m
                for m in self.rollout_methods
                if get_method(m).two_pass and not get_method(m).in_demo_by_default
            }
        )
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
        self.noise_site = str(self.noise_site).replace(" ", "")
        parse_noise_site(self.noise_site)  # raises, saying what to write
        if self.target_scope not in TARGET_SCOPES:
            raise ValueError(
                f"target_scope must be one of {', '.join(TARGET_SCOPES)}, got {self.target_scope!r}"
            )
        if self.target_marginal_tv and self.noise_site != "final_norm":
            raise ValueError(
                f"target_marginal_tv solves sigma_k through the LM head alone, at the final-norm site; "
                f"noise_site={self.noise_site!r} is a layer site. Train the two in separate demos."
            )
        dev = self.device.split(":")[0]
        if dev not in _DEVICES:
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        check_device(self.device)  # before anything is written

    # -- derived ------------------------------------------------------------------------------------
    @property
    def decoding(self) -> Any:
        """The evaluation's settings (:class:`ncgrpo.eval.evaluate.DecodingSettings`: greedy,
        ``max_new_tokens`` per answer, ``eval_batch_size`` prompts per batch), for the test split and
        the validation during training; constructing it checks them."""
        return DecodingSettings(max_new_tokens=self.max_new_tokens, batch_size=self.eval_batch_size)

    def trainer_settings(self) -> dict[str, Any]:
        """The ``NCGRPOConfig`` settings every run of the demo is given as they are: each field of this
        config that ``NCGRPOConfig`` has too, by name (:func:`_trainer_field`: ``max_steps``,
        ``num_generations``, ``learning_rate``, ...), but :data:`NOT_FOR_EVERY_RUN`."""
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
        """The configurations trained, baseline first (the paper's row order): the registered methods
        (:mod:`ncgrpo.methods`) the demo trains by default, one per ``sigma0`` (or, with
        ``target_marginal_tv``, one per target where the method can take it), then with ``--all_methods``
        every other one at the first ``sigma0`` (or target), each named by :meth:`~ncgrpo.methods.RolloutMethod.demo_run`;
        ``rollout_methods`` keeps a subset (the baseline always trains)."""
        baseline = baseline_method()
        out = [MethodSpec(BASELINE, baseline.slug, baseline.name)]
        for rollout in methods():
            if (
                rollout.baseline
                or not rollout.two_pass
                or not (rollout.in_demo_by_default or self.all_methods)
            ):
                continue
            if self.rollout_methods and rollout.name not in self.rollout_methods:
                continue
            if self.target_marginal_tv and not rollout.target_refusal:  # one run per target instead
                targets = (
                    self.target_marginal_tv if rollout.in_demo_by_default else self.target_marginal_tv[:1]
                )
                runs = [rollout.demo_run(self, self.sigma0[0], target=t) for t in targets]
            else:
                sigmas = self.sigma0 if rollout.in_demo_by_default else self.sigma0[:1]
                runs = [rollout.demo_run(self, s) for s in sigmas]
            for run in runs:
                if run is not None:
                    name, slug, settings = run
                    out.append(MethodSpec(name, slug, rollout.name, settings))
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
        return dict(
            model_id=model_id_of(self.train_dir),
            seed=self.seed,
            name=self.spec.name,
            method=self.spec.rollout_method,
        )
