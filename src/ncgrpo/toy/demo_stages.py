"""``ncgrpo demo``'s stages: the suite, the base model, each run's training and evaluation
(:class:`~ncgrpo.toy.demo_config.DemoRun`), the report and its notes; the protocol is described in :mod:`ncgrpo.toy.demo`."""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ncgrpo.data.geometry3k import to_trl_dataset
from ncgrpo.driver import MetricsCallback, train_run
from ncgrpo.eval.evaluate import (
    DecodingSettings,
    check_folder,
    eval_mode,
    evaluate,
    run_identity,
    score_greedy,
)
from ncgrpo.eval.plots import plot_dynamics, plot_gains, read_metrics
from ncgrpo.eval.records import iter_records
from ncgrpo.eval.report import compare, load_runs, print_rich, to_latex, to_markdown
from ncgrpo.methods import get_method
from ncgrpo.models import check_noise_site, find_vision_tower, freeze_vision_tower, load_model_and_processor
from ncgrpo.rewards import math_reward
from ncgrpo.runs.folder import (
    CONFIG_FILE,
    METRICS_FILE,
    RECORDS_FILE,
    FolderLock,
    atomic_write_json,
    atomic_write_text,
    changed_identity,
    read_run_json,
)
from ncgrpo.toy.base_model import ensure_base_model
from ncgrpo.toy.demo_config import (
    BASE_NAME,
    BASELINE,
    SUITE_MARKER,
    DemoConfig,
    DemoRun,
    RunResult,
    _dtype_for,
)
from ncgrpo.toy.suite import build_suite, export_geo3k
from ncgrpo.trainer.inert import reward_variance

__all__ = ["check_settings", "validation_accuracy"]


# ------------------------------------------------------------------------------------------ helpers
def _say(cfg: DemoConfig, msg: str) -> None:
    if cfg.progress:
        print(msg, flush=True)


def validation_accuracy(
    model: Any, processor: Any, questions: Sequence[Any], *, max_new_tokens: int, batch_size: int
) -> dict[str, float]:
    """Greedy, noise-free accuracy on ``questions``: ``val/accuracy`` (all of them) and
    ``val/accuracy/<role>`` per role present (in_domain, ood, general). Restores the model's mode."""
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
    _say(cfg, "getting the embedded base model (built on first use, then cached)")
    return ensure_base_model(cfg.cache_dir)


def check_settings(cfg: DemoConfig, base: Path) -> None:
    """Every setting, checked before anything is written (as ``ncgrpo train`` does): each configuration's
    ``NCGRPOConfig`` (e.g. SPSA only at the final-norm site), the noise site against the base model's
    decoder layers, read from its config, and the evaluation's settings. A ``ValueError`` says which
    configuration and what."""
    _ = cfg.decoding
    for spec in cfg.methods():
        try:
            args = DemoRun(cfg, spec, 0, base, "").training_args()
            if get_method(spec.rollout_method).hidden_noise:
                check_noise_site(args.noise_site, base)
        except ValueError as e:
            raise ValueError(f"{spec.name}: {e}") from None


def _check_same_run(train_dir: Path, settings: dict[str, Any]) -> None:
    """Refuse to reuse a finished run whose ``config.yaml`` holds other settings (or none)."""
    import yaml

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
    old = old if isinstance(old, dict) else {}
    # a folder written before a setting joined the identity (issue 35: every setting that changes the run)
    # has no value for it: those are not compared, as that older demo did not compare them either
    changed = changed_identity(old, settings, [k for k in settings if k in old])
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
    rows = {r.train_dir: read_metrics(r.train_dir) for r in runs}  # each run's metrics, read once
    vanilla = {r.seed: r for r in runs if not get_method(r.method).two_pass}  # the baseline, per seed
    same = []
    flat = []
    for r in runs:
        rv = reward_variance(rows[r.train_dir])
        if rv.none_at_all:
            flat.append(f"{r.name} (seed {r.seed}): {rv.describe()}")
            continue
        base = vanilla.get(r.seed)
        if not get_method(r.method).two_pass or base is None:
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
