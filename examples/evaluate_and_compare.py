"""Evaluate two training runs and compare them, with the command line: ``ncgrpo train``, ``eval``, ``compare``.

    python examples/evaluate_and_compare.py --output_dir runs/compare                  # about a minute on a CPU

The protocol of the paper in miniature: vanilla GRPO and NC-GRPO trained from the same base on the
same data with the same settings (one YAML file, the method as a flag), each evaluated greedily on the
same held-out questions (``ncgrpo eval`` writes one record per question), then ``ncgrpo compare``
pairs the records question by question and writes the paper-style table with exact McNemar p-values
against the baseline (``comparison.md``, ``.tex``, ``.json``). At this size (4 steps, a few
questions) the table shows the plumbing, not an effect. For a paper recipe, the same three commands
take ``--config recipes/...yaml`` and ``--data_dir`` (README.md, "Command line and tests").

The data: the embedded synthetic suite exported in Geometry3K's layout (``--data synthetic=FOLDER``);
your own benchmark folder works the same way. Each command is run as ``python -m ncgrpo``, which is the
``ncgrpo`` executable.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from ncgrpo.runs.folder import claim_script_folder, finish_script_folder

TRAIN_SETTINGS = """\
# shared by both runs; the method comes on the command line
model_name_or_path: {base}
dtype: float32
freeze_vision_tower: true
dataset_name: synthetic
dataset_path: {suite}
reward_funcs: [math_reward]
branch_prefix: "<think>"        # the embedded base opens with <think>: branch where reasoning starts
sigma0: 0.5
sigma_schedule: constant        # the paper anneals over 60 rollout batches; 4 steps would not
num_generations: 4              # 2 clean + 2 noisy rollouts per prompt (vanilla: 4 clean)
per_device_train_batch_size: 8  # 2 prompts x G per step
max_completion_length: 48
max_steps: 4
learning_rate: 1.0e-5
gradient_checkpointing: false
use_cpu: {use_cpu}
bf16: {bf16}
save_strategy: "no"
report_to: none
seed: 0
"""


def ncgrpo(*args: str) -> None:
    print("$ ncgrpo", " ".join(args), flush=True)
    rc = subprocess.run([sys.executable, "-m", "ncgrpo", *args]).returncode
    if rc != 0:  # its own message is above; no traceback of this script under it
        sys.exit(f"examples/evaluate_and_compare.py: ncgrpo {args[0]} failed (exit code {rc}), see above")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--questions", type=int, default=6, help="test questions per family (6 families)")
    args = parser.parse_args(argv)
    try:  # a new folder (or this script's own earlier output), locked while the script writes it
        lock = claim_script_folder(args.output_dir, "examples/evaluate_and_compare.py", kind="demo")
    except ValueError as e:
        parser.error(str(e))
    out = lock.folder.resolve()

    import torch

    from ncgrpo.toy.base_model import ensure_base_model
    from ncgrpo.toy.suite import build_suite, export_geo3k

    suite = out / "suite"
    if not (suite / "data").is_dir():
        export_geo3k(build_suite(seed=0, sizes={"train": 32, "validation": 2, "test": args.questions}), suite)
    gpu = torch.cuda.is_available()
    config = out / "train.yaml"
    config.write_text(
        TRAIN_SETTINGS.format(
            base=ensure_base_model(), suite=suite, use_cpu=str(not gpu).lower(), bf16=str(gpu).lower()
        )
    )

    for method in ("vanilla", "latent"):
        ncgrpo(
            "train",
            "--config", str(config),
            "--rollout_method", method,  # vanilla: 4 clean rollouts; latent: NC-GRPO
            "--output_dir", str(out / "runs" / method),
        )  # fmt: skip
        ncgrpo(
            "eval",
            "--model_name_or_path", str(out / "runs" / method),
            "--benchmarks", "synthetic",
            "--data", f"synthetic={suite}",
            "--name", method,
            "--rollout_method", method,
            "--seed", "0",
            "--max_new_tokens", "64",
            "--output_dir", str(out / "evals" / method),
            "--no_progress",
        )  # fmt: skip
    ncgrpo(
        "compare",
        "--runs", str(out / "evals" / "vanilla"), str(out / "evals" / "latent"),
        "--baseline", "vanilla",
        "--output_dir", str(out / "tables"),
    )  # fmt: skip
    finish_script_folder(lock)
    return out / "tables" / "comparison.json"  # comparison.md / .tex: the same table, printed above


if __name__ == "__main__":
    main()
