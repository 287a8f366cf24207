"""Text-only, from the command line: vanilla GRPO against NC-GRPO on your own JSONL and your own reward,
over several seeds, with the seed-level statistics.

    python examples/text_cli_vanilla_vs_ncgrpo.py --output_dir runs/text-cli          # about 1.5-3 min on a CPU
    python examples/text_cli_vanilla_vs_ncgrpo.py --output_dir runs/text-cli --seeds 5 --max_steps 24

What a new user of a text-only model does, at a size a CPU trains in minutes:

1. writes a data file of their own in TRL's form (``OUTPUT/data/train.jsonl``: a ``prompt`` column and
   the ``answer`` their reward reads) and a reward function of their own, TRL's convention
   (``OUTPUT/side_rewards.py``: ``def side(prompts, completions, answer, **kwargs)``);
2. ``ncgrpo train --dataset_name train.jsonl --reward_funcs side_rewards.side`` for each method and seed
   (vanilla, and NC-GRPO's latent noise with ``branch_prefix '<think>'``, its size held by
   ``--target_marginal_tv 0.02``: on this model and prompt the first reasoning token is near-certain, and
   ``ncgrpo probe --data sizes=OUTPUT/data/test.jsonl --branch_prefix '<think>' --sigma0 0 0.2 0.5 1
   --target_marginal_tv 0.02`` finds sigma0 0.2 inert (marginal TV 0.0003) and TV 0.02 at sigma ~0.6);
3. ``ncgrpo eval --data sizes=test.jsonl`` of every trained model (and of the base) on held-out prompts;
4. the seed-level comparison: per seed, NC-GRPO's accuracy minus vanilla's, and a paired t-test over
   seeds (``ncgrpo.eval.stats.seeds.paired_ttest``), the unit of replication being the training seed.

The task: which of two circles is bigger, given their sizes in the text ("left" or "right"). The
model is the embedded base's language model as a text-only Qwen2 (``ncgrpo.toy.text_base``; pass
``--model_name_or_path`` for yours): it starts near chance and learns the task in a dozen steps. With
two or three seeds and a task this small, expect both methods to learn and the difference between them
not to be significant: the point is the path and the statistics a claim needs, not a result.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from ncgrpo.cli import main as ncgrpo
from ncgrpo.data.types import MATH_PROMPT
from ncgrpo.runs.folder import claim_script_folder, finish_script_folder

REWARD_MODULE = '''
from ncgrpo.rewards import completion_text, extract_boxed


def side(prompts, completions, answer, **kwargs):
    """1.0 where the last \\\\boxed{} names the gold side ("left" / "right"), else 0.0 (TRL's convention)."""
    out = []
    for completion, gold in zip(completions, answer):
        boxed = extract_boxed(completion_text(completion))
        out.append(1.0 if boxed is not None and boxed.strip().lower() == gold else 0.0)
    return out
'''


def rows(n: int, seed: int) -> list[dict]:
    """``n`` prompts: two circle sizes 1-9, the question and NoisyRollout's instruction, the gold side."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.sample(range(1, 10), 2)
        question = (
            "Which circle is bigger, the left one or the right one? "
            f"The left circle has size {a} and the right circle has size {b}."
        )
        out.append({"prompt": f"{question} {MATH_PROMPT}", "answer": "left" if a > b else "right"})
    return out


def write_jsonl(path: Path, data: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


def accuracy(eval_dir: Path) -> float:
    records = [json.loads(line) for line in (eval_dir / "records.jsonl").read_text().splitlines()]
    return 100.0 * sum(r["correct"] for r in records) / len(records)


def run(cmd: list[str]) -> None:
    rc = ncgrpo(cmd)
    if rc != 0:
        raise SystemExit(f"ncgrpo {cmd[0]} failed ({rc}): {' '.join(cmd)}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument(
        "--model_name_or_path", help="a text model (default: the embedded base's language model)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per method")
    parser.add_argument(
        "--max_steps", type=int, default=12, help="optimizer steps per run (2 prompts x 8 each)"
    )
    parser.add_argument("--test_prompts", type=int, default=64)
    args = parser.parse_args(argv)
    try:  # a new folder (or this script's own earlier output), locked while the script writes it
        lock = claim_script_folder(
            str(args.output_dir), "examples/text_cli_vanilla_vs_ncgrpo.py", kind="report"
        )
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.output_dir).resolve()
    model = args.model_name_or_path
    if model is None:
        from ncgrpo.toy.text_base import ensure_text_base_model

        model = str(ensure_text_base_model())
    train = write_jsonl(out / "data" / "train.jsonl", rows(256, seed=0))
    test = write_jsonl(out / "data" / "test.jsonl", rows(args.test_prompts, seed=1))
    (out / "side_rewards.py").write_text(REWARD_MODULE)
    sys.path.insert(0, str(out))  # the reward module is importable, as from the current directory

    def evaluate(path: str, name: str, seed: int | None) -> float:
        folder = out / "evals" / name
        cmd = ["eval", "--model_name_or_path", path, "--data", f"sizes={test}", "--output_dir", str(folder),
               "--max_new_tokens", "40", "--device", "cpu", "--no_progress", "--name", name]  # fmt: skip
        if seed is not None:
            cmd += ["--seed", str(seed)]
        if not (folder / "records.jsonl").is_file():
            run(cmd)
        return accuracy(folder)

    results: dict = {"base": evaluate(model, "base", None), "runs": {}}
    methods = {"vanilla": [], "latent": ["--target_marginal_tv", "0.02", "--sigma0", "0.6"]}
    for seed in range(args.seeds):
        for method, extra in methods.items():
            folder = out / "runs" / f"{method}-seed{seed}"
            if not (folder / "run.json").is_file() or not json.loads((folder / "run.json").read_text()).get(
                "finished"
            ):
                run([
                    "train", "--model_name_or_path", model, "--dataset_name", str(train),
                    "--reward_funcs", "side_rewards.side", "--rollout_method", method, *extra,
                    "--branch_prefix", "<think>", "--schedule_k_mid", str(round(args.max_steps * 2 / 3, 4)),
                    "--num_generations", "8", "--per_device_train_batch_size", "16", "--max_steps", str(args.max_steps),
                    "--max_completion_length", "40", "--learning_rate", "1e-4", "--beta", "0", "--bf16", "false",
                    "--dtype", "float32", "--use_cpu", "--logging_steps", "1", "--save_strategy", "no",
                    "--report_to", "none", "--seed", str(seed), "--output_dir", str(folder), "--overwrite",
                ])  # fmt: skip
            acc = evaluate(str(folder), f"{method}-seed{seed}", seed)
            results["runs"].setdefault(method, []).append(acc)

    from ncgrpo.eval.stats.seeds import paired_ttest

    vanilla, latent = results["runs"]["vanilla"], results["runs"]["latent"]
    test_result = paired_ttest([b - a for a, b in zip(vanilla, latent, strict=True)])
    results["nc_minus_vanilla"] = test_result.to_dict()
    print(f"\nheld-out accuracy on {args.test_prompts} prompts (greedy), base model: {results['base']:.1f}%")
    for method, accs in results["runs"].items():
        per_seed = ", ".join(f"{a:.1f}" for a in accs)
        print(f"  {method:8s} seeds [{per_seed}]  mean {sum(accs) / len(accs):.1f}%")
    t = test_result
    ci = f"[{t.ci_low_pp:+.1f}, {t.ci_high_pp:+.1f}]"
    print(
        f"NC-GRPO - vanilla over {t.n_seeds} seeds: {t.mean_pp:+.1f} pp, 95% CI {ci}, paired t-test p = {t.p:.3g}"
        + (f" ({t.undefined})" if t.undefined else "")
    )
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    finish_script_folder(lock)
    return results


if __name__ == "__main__":
    main()
