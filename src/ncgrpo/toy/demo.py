"""``ncgrpo demo``: the paper's whole protocol in miniature, offline, on a CPU.

The paper (section 4.1) trains Qwen2.5-VL-7B with vanilla GRPO and with NC-GRPO on Geometry3K for 60
steps under the same hyperparameters, evaluates every checkpoint greedily with one rule-based scorer
on the in-domain test set, on OOD benchmarks and on a general-capability battery, and compares each
method with vanilla GRPO by per-question exact McNemar tests (Tables 1-2, Figure 1). The demo runs
exactly that pipeline at toy scale, with the same code the full-scale runs use:

1. the synthetic suite (:func:`ncgrpo.toy.suite.build_suite`) exported once in Geometry3K's
   schema (:func:`~ncgrpo.toy.suite.export_geo3k`) into ``OUT/suite`` and read back through the
   Geometry3K loader (:func:`ncgrpo.data.geometry3k.load_geometry3k`), so training data takes the
   real-data path;
2. the embedded base model (:func:`ncgrpo.toy.base_model.ensure_base_model`: a tiny Qwen2.5-VL fine-tuned on
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
check theirs. Each training run is :class:`~ncgrpo.toy.demo_config.DemoConfig` composed into an
``NCGRPOConfig`` (:meth:`~ncgrpo.toy.demo_config.DemoConfig.trainer_settings`: the demo's fields that
are ``NCGRPOConfig`` fields, by name) and
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
(:mod:`ncgrpo.trainer.prefix`; evaluation keeps the plain prompt): the branch point is then the first reasoning
token, where the base chooses among five openings, four derivations and an image-blind shortcut
(:func:`ncgrpo.toy.traces.shortcut_trace`; ``ncgrpo probe``: first-token entropy 1.7 nats, 6.1% of
noisy rollouts differ from their common-random-number clean partner at sigma 0.2). What GRPO learns
here is that choice: the base's greedy answer is the shortcut, and the derivations earn more reward. The demo
still checks after training whether the two runs were identical and says so under the table
(:func:`ncgrpo.toy.demo_stages._notes`); ``noise_site="1"`` (the propagating variant, reaching the KV cache) also changes
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

import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ncgrpo.data.geometry3k import load_geometry3k
from ncgrpo.eval.evaluate import model_id_of
from ncgrpo.eval.plots import read_metrics
from ncgrpo.runs.folder import RUN_FILE, FolderLock, atomic_write_json, claim_folder, read_run_json
from ncgrpo.runs.provenance import continue_provenance, provenance
from ncgrpo.toy.demo_config import DemoConfig, DemoResult, DemoRun, RunResult
from ncgrpo.toy.demo_stages import (
    _base_model,
    _ensure_suite,
    _evaluate_base,
    _notes,
    _report,
    _run_one,
    _say,
    check_settings,
)
from ncgrpo.toy.suite import first_per_family

__all__ = ["quiet_libraries", "run_demo"]


# --------------------------------------------------------------------------------- parallel runs
def _load_questions(
    cfg: DemoConfig, suite: Path, *, training: bool = True
) -> tuple[list[Any], list[Any], list[Any]]:
    """(train, validation, test) questions of the exported suite, read back through the Geometry3K loader;
    ``training=False`` (a process that trains nothing) leaves the first two empty."""
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
def _record_provenance(folder: Path) -> None:
    """The demo root's run.json records what made the folder (``provenance``) and, when a demo
    continues a folder an earlier one wrote (its finished runs and records are kept), each later start
    under another commit or other package versions (``provenance_history``, with a
    ``ProvenanceWarning``: :func:`ncgrpo.runs.provenance.continue_provenance`). A root claimed just now
    (run.json only ``{"kind": "demo"}``) is new, unless it holds an earlier demo's files that do not
    record what made them: runs copied in from another demo (the documented way to share a baseline
    between folders) each carry their own provenance, so the root is new and says nothing about them."""
    info = read_run_json(folder) or {"kind": "demo"}
    subs = [folder / sub for sub in ("train", "eval") if (folder / sub).is_dir()]
    runs = [d for sub in subs for d in sub.iterdir() if d.is_dir()]
    unrecorded = any("provenance" not in (read_run_json(d) or {}) for d in runs)
    earlier = set(info) - {"kind"} or unrecorded or (subs and not runs)
    keys = continue_provenance(info if earlier else None, event="continue", where=folder)
    if {**info, **keys} != info:
        atomic_write_json(folder / RUN_FILE, {**info, **keys})


def run_demo(
    cfg: DemoConfig, *, console: Any = None, on_stage: Callable[[str], None] | None = None
) -> DemoResult:
    """Run the whole protocol (see the module docstring) into ``cfg.output_dir``; returns what it did.

    ``on_stage(name)`` is called as each stage starts (suite, base_model, train_eval, report).
    """
    import torch

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
        _record_provenance(cfg.output_dir)
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
        summary["provenance"] = provenance()  # what made this summary (each run's own: its run.json)
        atomic_write_json(files["summary"], summary)
        return result
    finally:
        lock.release()
        torch.set_num_threads(previous_threads)
