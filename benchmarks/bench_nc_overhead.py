"""Where NC-GRPO's fixed per-step cost goes on the transformers engine: process-CPU time per optimizer
step of the trainer's sections, NC-GRPO (``latent:noshare`` by default) next to TRL's vanilla path.

bench_train.py gives the step ratio; at its tiny size (a ~0.12 s step) the ratio is dominated by a few
milliseconds of fixed NC-GRPO work, which a ratio of step times measures poorly on a loaded machine.
Here the same runs (bench_train's model, data and ``one_run``, interleaved over ``--repeats`` rounds)
are timed section by section in CPU time (``time.process_time`` around each call; the first step of
every run is warm-up and not counted):

- ``prepare_inputs``: TRL's ``_prepare_inputs`` (generation, rewards, advantages, NC-GRPO's metrics);
- ``generate``: ``model.generate`` (the prefill noise hook and the branch-point metrics run inside it);
- ``seam``: ``NCGRPOTrainer._generate_single_turn`` minus ``generate`` (TRL's own bookkeeping plus
  NC-GRPO's row plans, prompt ids, hook set-up and branch-point statistics);
- ``after_rewards``: ``_nc_after_rewards`` (regrouping, logged metrics);
- ``marginal``: ``ncgrpo.trainer.metrics.branch_point_marginal`` (the first-token marginal metric; inside ``generate``);
- ``step``: the whole optimizer step (bench_train's ``on_step_begin`` -> ``on_step_end``).

Each is reported as the median over rounds of the mean per timed step, in milliseconds, and the
difference to vanilla. ``--detail`` also times the noise hook's bodies (``NoiseHook.top_pre``,
``stack_pre``, ``stack_post``: called on every forward, so their own timing adds ~2 us a call).

``--hook-ab N``: instead, the noise hook's cost inside one ``generate`` (the bench model, 2 text prompts x
8 rows, 4 noisy each, 32 sampled tokens), N interleaved rounds of three arms in one process: no hook;
the hook with its stack hooks kept on every decode step (``NoiseHook._disarm`` a no-op: the code before
they were removed after the prefill); the hook as it is. The two hooked arms must sample the same tokens.
A fraction of a millisecond that step timings do not resolve.

    python benchmarks/bench_nc_overhead.py --steps 8 --repeats 4
    python benchmarks/bench_nc_overhead.py --hook-ab 150
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train as bt  # noqa: E402  (a sibling script)

SECTIONS = ("step", "prepare_inputs", "generate", "seam", "after_rewards", "marginal")


def _timers(detail: bool):
    """Install the CPU-time wrappers (class or module attributes); returns (totals, on, restore)."""
    from transformers.generation.utils import GenerationMixin
    from trl import GRPOTrainer

    from ncgrpo.engines.transformers import NoiseHook
    from ncgrpo.trainer import grpo
    from ncgrpo.trainer.grpo import NCGRPOTrainer

    totals: dict[str, float] = collections.defaultdict(float)
    on = [False]
    targets = [
        (GRPOTrainer, "_prepare_inputs", "prepare_inputs"),
        (GenerationMixin, "generate", "generate"),
        (NCGRPOTrainer, "_generate_single_turn", "single_turn"),
        (NCGRPOTrainer, "_nc_after_rewards", "after_rewards"),
        (grpo, "branch_point_marginal", "marginal"),  # the name NCGRPOTrainer._nc_generate calls
    ]
    if detail:
        targets += [(NoiseHook, n, f"hook.{n}") for n in ("top_pre", "stack_pre", "stack_post")]
    saved = []
    for owner, name, label in targets:
        f = owner.__dict__[name]
        saved.append((owner, name, f))

        def wrapped(*a, _f=f, _label=label, **k):
            if not on[0]:
                return _f(*a, **k)
            t = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                totals[_label] += time.process_time() - t

        setattr(owner, name, functools.wraps(f)(wrapped))

    def restore():
        for owner, name, f in saved:
            setattr(owner, name, f)

    return totals, on, restore


def hook_ab(model, proc, rounds: int) -> dict:
    """``--hook-ab``: CPU ms per ``generate`` without the hook, with its stack hooks kept, as it is."""
    from ncgrpo.core.noise import NoiseKey, RowNoise
    from ncgrpo.engines import transformers as et

    tok = getattr(proc, "tokenizer", proc)
    tok.padding_side = "left"
    x = tok(
        ["Solve for x: 3x + 5 = 20."] * 8 + ["A circle has radius r = 5."] * 8,
        return_tensors="pt",
        padding=True,
    )
    rows = [RowNoise(0.2, NoiseKey(7, 3, i // 8, i % 8)) if i % 8 >= 4 else RowNoise() for i in range(16)]
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=True, pad_token_id=tok.pad_token_id)
    disarm = et.NoiseHook.__dict__["_disarm"]

    def run(arm: str):
        et.NoiseHook._disarm = disarm if arm == "as is" else (lambda self: None)
        torch.manual_seed(0)
        t = time.process_time()
        with torch.no_grad():
            if arm == "no hook":
                out = model.generate(**x, **kw)
            else:
                with et.prefill_noise(model, rows):
                    out = model.generate(**x, **kw)
        return time.process_time() - t, out

    arms = ("no hook", "stack hooks kept", "as is")
    ms: dict[str, list[float]] = {a: [] for a in arms}
    try:
        for _ in range(rounds):
            outs = {}
            for a in arms:
                dt, outs[a] = run(a)
                ms[a].append(dt * 1e3)
            if not torch.equal(outs["stack hooks kept"], outs["as is"]):
                raise AssertionError("the two hooked arms sampled different tokens")
    finally:
        et.NoiseHook._disarm = disarm
    print(
        f"# bench_nc_overhead --hook-ab {rounds}: CPU ms per generate (16 rows, 32 tokens), load {os.getloadavg()[0]:.2f}"
    )
    for a in arms:
        paired = statistics.median(v - w for v, w in zip(ms[a], ms["no hook"], strict=True))
        print(f"{a:<20} median {statistics.median(ms[a]):8.3f}   - no hook (paired median) {paired:7.3f}")
    kept = statistics.median(v - w for v, w in zip(ms["stack hooks kept"], ms["as is"], strict=True))
    print(f"stack hooks kept - as is (paired median) {kept:.3f}")
    return ms


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=sorted(bt.SIZES))
    p.add_argument("--methods", default="latent:noshare", help="compared with vanilla (bench_train's specs)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (the first is warm-up)")
    p.add_argument("--repeats", type=int, default=4, help="interleaved rounds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--detail", action="store_true", help="also time the noise hook's bodies")
    p.add_argument(
        "--hook-ab", type=int, default=0, metavar="N", help="time the hook inside generate instead"
    )
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    args = bt.parse_args(
        ["--size", a.size, "--steps", str(a.steps), "--repeats", str(a.repeats), "--threads", str(a.threads),
         "--methods", a.methods]
    )  # fmt: skip
    torch.set_num_threads(a.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    device = torch.device("cpu")
    base, proc, ds = bt.build(args, torch.float32)
    if a.hook_ab:
        return {"hook_ab_ms": hook_ab(base, proc, a.hook_ab)}
    rec = bt.Recorder(device)
    totals, on, restore = _timers(a.detail)
    timer = bt.step_timer

    def step_timer(r):  # count from the end of the warm-up step on
        cb = timer(r)
        end = cb.on_step_end

        def on_step_end(*x, **k):
            out = end(*x, **k)
            on[0] = True
            return out

        cb.on_step_end = on_step_end
        return cb

    bt.step_timer = step_timer
    per: dict[str, dict[str, list[float]]] = {m: collections.defaultdict(list) for m in args.methods}
    load = os.getloadavg()[0]
    try:
        with bt.trl_profiling(rec):
            for r in range(a.repeats):
                order = args.methods[r % len(args.methods) :] + args.methods[: r % len(args.methods)]
                for m in order:
                    totals.clear()
                    on[0] = False
                    run = bt.one_run(m, a.steps, base, proc, ds, args, device, rec)
                    on[0] = False
                    n = a.steps - 1
                    row = {k: v / n * 1e3 for k, v in totals.items()}
                    row["seam"] = row.pop("single_turn", 0.0) - row.get("generate", 0.0)
                    row["step"] = statistics.fmean(s["cpu"] for s in run["steps"][1:]) * 1e3
                    for k, v in row.items():
                        per[m][k].append(v)
    finally:
        bt.step_timer = timer
        restore()
    keys = list(SECTIONS) + sorted(
        k for k in per["vanilla"].keys() | per[args.methods[-1]].keys() if k not in SECTIONS
    )
    med = {m: {k: statistics.median(d[k]) if d.get(k) else 0.0 for k in keys} for m, d in per.items()}
    print(
        f"# bench_nc_overhead size={a.size} steps/run={a.steps} (first is warm-up) repeats={a.repeats} "
        f"threads={a.threads} load {load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(f"{'ms CPU per step (median of rounds)':<36}" + "".join(f"{m:>18}" for m in args.methods)
          + "".join(f"{m + ' - vanilla':>26}" for m in args.methods[1:]))  # fmt: skip
    for k in keys:
        v = med["vanilla"][k]
        print(f"{k:<36}" + "".join(f"{med[m][k]:>18.2f}" for m in args.methods)
              + "".join(f"{med[m][k] - v:>26.2f}" for m in args.methods[1:]))  # fmt: skip
    return {"median_ms": med, "per_round_ms": {m: dict(d) for m, d in per.items()}, "load": load}


if __name__ == "__main__":
    main()
