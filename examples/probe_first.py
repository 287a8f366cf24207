"""Probe your model before a run: does NC-GRPO's noise change the rollouts at all, and where to branch?

    python examples/probe_first.py --output_dir runs/probe                          # about 20 s on a CPU
    ncgrpo probe --model_name_or_path MODEL --benchmark geo3k --data DATA --prompts 128 --sigma0 0 0.2 0.5

At the paper's site the noise moves only the first sampled token's logits, and the noisy half of each
group samples that token from the noise-averaged distribution q_bar. A model whose first token is
nearly certain (a format token such as ``<think>``) makes the noise inert: NC-GRPO would sample exactly
vanilla GRPO's rollouts. ``branch_prefix`` appends text to the generation prompt so the prefill ends
where reasoning begins. This script probes the same prompts with and without a prefix and writes both
results (``probe-*.json``) and the settings to train with (``suggested.json``).

``ncgrpo.eval.probe.probe`` takes any model, processor and ``Question`` list (``ncgrpo.data.types``); here
the embedded tiny base on its synthetic geometry questions. Read ``marginal_tv`` (what the rollouts
are sampled from: inert < 0.002 <= weak < 0.02 <= live) and ``equivalent_temperature``, not the
per-draw figures.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from ncgrpo.data.types import Question
from ncgrpo.eval.probe import probe
from ncgrpo.eval.probe_result import format_probe
from ncgrpo.models import load_model_and_processor
from ncgrpo.runs.folder import claim_script_folder, finish_script_folder


def my_questions(n: int) -> list[Question]:
    """Your prompts as ``Question``s: the text (without the math prompt), the gold answer, the images."""
    from ncgrpo.toy.suite import build_suite

    suite = build_suite(seed=0, sizes={"train": n, "validation": 1, "test": 1})
    return suite["train"][:n]  # e.g. Question("mine", "q1", "What is 2 + 3?", "5") for a text model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model_name_or_path", help="hub id or folder (default: the embedded tiny base)")
    parser.add_argument("--prompts", type=int, default=8, help="128 for a decision on a real model")
    parser.add_argument("--sigma0", type=float, nargs="+", default=[0.0, 0.2, 0.5])
    parser.add_argument("--branch_prefixes", nargs="+", default=["", "<think>"])
    args = parser.parse_args(argv)
    try:  # a new folder (or this script's own earlier output), locked while the script writes it
        lock = claim_script_folder(args.output_dir, "examples/probe_first.py", kind="report")
    except ValueError as e:
        parser.error(str(e))
    args.output_dir = lock.folder

    path = args.model_name_or_path
    if path is None:
        from ncgrpo.toy.base_model import ensure_base_model

        path = ensure_base_model()
    model, processor = load_model_and_processor(path)
    questions = my_questions(args.prompts)

    results = {}
    for prefix in args.branch_prefixes:
        result = probe(
            model,
            processor,
            questions,
            sigmas=args.sigma0,
            rollouts=2,
            branch_prefix=prefix,
            max_new_tokens=16,
            marginal_draws=256,
            model_name=str(path),
            progress=False,
        )
        result.to_json(args.output_dir / f"probe-{prefix.strip('<>/') or 'none'}.json")
        Console().print(format_probe(result))  # the table `ncgrpo probe` prints
        results[prefix] = result

    # the prefix under which the noise moves the rollouts most (the noise-averaged TV, not one draw's)
    def moved(prefix: str) -> float:
        return max((r.marginal_tv for r in results[prefix].rows if r.sigma > 0), default=0.0)

    best = max(results, key=moved)
    suggested = {
        "branch_prefix": best,
        "marginal_tv": moved(best),
        "verdict": results[best].verdict,
        "train_with": f"ncgrpo train --config RECIPE --branch_prefix '{best}'",
    }
    (args.output_dir / "suggested.json").write_text(json.dumps(suggested, indent=1) + "\n")
    print(json.dumps(suggested, indent=1))
    finish_script_folder(lock)
    return suggested


if __name__ == "__main__":
    main()
