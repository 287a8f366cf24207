"""``ncgrpo eval`` wall time, transformers engine vs vLLM engine, on the same tiny model and questions.
Run in .venv-vllm (scripts/setup_vllm.sh), which has both engines:

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_eval_engines.py --questions 64 --max-new-tokens 128 \
        --batch-size 16 --rounds 3

The model is the vLLM test suite's tiny Qwen2 text model (``save_peaked_vllm_text_model``: hidden 128,
2 layers, head_dim 64, LM head scaled 20x), float32; the questions are image-free
(HallusionBench's ``non_image`` layout, as tests/eval/test_eval_vllm.py). Both engines give the same
greedy tokens (the script checks the records are identical), but not the same number of decode steps:
``generate`` runs each batch of ``--batch-size`` questions until its longest answer ends, while vLLM
fills a finished answer's slot with the next question. Each (engine, round) runs in a fresh process (as
``ncgrpo eval`` would), into a fresh folder; the rounds interleave the engines, alternating which goes
first, and the medians are reported: the process's wall time, the model load / engine start-up
(``load_for_eval``) and the evaluation itself (``evaluate``: prompts, decoding, scoring, records).
Prints one JSON object (``--json FILE`` writes it too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(engine: str, model: str, data: str, out: str, max_new: int, batch: int) -> None:
    t0 = time.perf_counter()
    from ncgrpo.eval.evaluate import DecodingSettings, evaluate, load_for_eval, model_id_of
    from ncgrpo.eval.questions import load_questions

    questions = load_questions(["hallusionbench"], {"hallusionbench": Path(data)}, "non_image", None)
    settings = DecodingSettings(max_new_tokens=max_new, batch_size=batch)
    t1 = time.perf_counter()
    m, proc = load_for_eval(
        model, engine=engine, dtype="float32", device="cpu", settings=settings, questions=questions
    )
    t2 = time.perf_counter()
    summary = evaluate(
        m, proc, questions, out, model_id=model_id_of(model), settings=settings, progress=False,
        split={"hallusionbench": "non_image"}, benchmarks=["hallusionbench"],
    )  # fmt: skip
    t3 = time.perf_counter()
    getattr(m, "close", lambda: None)()
    assert summary.newly_recorded == len(questions)
    print("RESULT " + json.dumps({"imports_s": t1 - t0, "load_s": t2 - t1, "eval_s": t3 - t2}), flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16, help="--batch_size of both engines")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        engine, model, data, out, max_new, batch = args.worker
        _worker(engine, model, data, out, int(max_new), int(batch))
        return {}

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import save_peaked_vllm_text_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_eval_"))
    model, _ = save_peaked_vllm_text_model(tmp / "model")
    data = tmp / "q.jsonl"
    rows = [
        {"question": f"Is {i} plus {3 * i + 1} equal to {4 * i + 1 + i % 2}?", "gt_answer": str(1 - i % 2),
         "category": "math", "subcategory": "add", "set_id": "0", "figure_id": str(i // 10),
         "question_id": str(i), "visual_input": "0"}
        for i in range(args.questions)
    ]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    runs: dict[str, list[dict]] = {"transformers": [], "vllm": []}
    outputs: dict[str, list[str]] = {}
    for r in range(args.rounds):
        order = ["transformers", "vllm"] if r % 2 == 0 else ["vllm", "transformers"]
        for engine in order:
            out = tmp / f"{engine}-{r}"
            t0 = time.perf_counter()
            p = subprocess.run(
                [sys.executable, __file__, "--worker", engine, str(model), str(data), str(out),
                 str(args.max_new_tokens), str(args.batch_size)],
                env=env, capture_output=True, text=True,
            )  # fmt: skip
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                raise SystemExit(f"{engine} round {r} failed:\n{p.stderr[-3000:]}")
            res = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
            runs[engine].append({"wall_s": wall, **res})
            print(f"round {r} {engine}: {runs[engine][-1]}", file=sys.stderr, flush=True)
            recs = [json.loads(ln) for ln in (out / "records.jsonl").read_text().splitlines()]
            outputs.setdefault(engine, sorted((x["question_id"], x["output"]) for x in recs))

    def med(engine: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[engine])

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "questions": args.questions,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "records_identical": outputs["transformers"] == outputs["vllm"],
        "median": {e: {k: round(med(e, k), 2) for k in ("wall_s", "load_s", "eval_s")} for e in runs},
        "eval_ratio_transformers_over_vllm": round(med("transformers", "eval_s") / med("vllm", "eval_s"), 2),
        "wall_ratio_transformers_over_vllm": round(med("transformers", "wall_s") / med("vllm", "wall_s"), 2),
        "per_round_eval_ratio": [
            round(t["eval_s"] / v["eval_s"], 2)
            for t, v in zip(runs["transformers"], runs["vllm"], strict=True)
        ],
        "runs": runs,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
