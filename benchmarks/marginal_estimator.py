"""Bias, spread and coverage of the noise-effect estimator (ncgrpo.core.marginal.MarginalCurve) on the
embedded base: the table in docs/concepts.md ("How the noise's effect is measured").

The clean branch-point states of ``--prompts`` synthetic training prompts (``branch_prefix '<think>'``,
as the probe sees them) and the LM head; a reference per sigma from ``--ref-draws`` draws (pairs with
the control variate, checked against ``--ref-draws / 4`` pairs without it); then ``--reps`` repeated
estimates at each draw count, each with its own keys, against it.

    python benchmarks/marginal_estimator.py --prompts 64 --draws 32 64 --reps 100
"""

from __future__ import annotations

import argparse
import math

import torch

from ncgrpo.core.marginal import MarginalCurve, marginal_keys

SIGMAS = (0.05, 0.1, 0.2, 0.5, 1.0)


def branch_states(prompts: int):
    from ncgrpo.eval.probe import _Pass
    from ncgrpo.methods import get_method
    from ncgrpo.models import load_model_and_processor, tokenizer_of
    from ncgrpo.toy.base_model import ensure_base_model
    from ncgrpo.toy.suite import build_suite
    from ncgrpo.trainer.prefix import with_branch_prefix

    qs = build_suite(0, {"train": prompts})["train"][:prompts]
    model, proc = load_model_and_processor(str(ensure_base_model()), dtype="float32", device="cpu")
    model.eval()
    sample = dict(site="final_norm", layer_decay=0.5, temperature=1.0, max_new_tokens=1,
                  pad_id=tokenizer_of(proc).pad_token_id, share_prompt_prefill=True)  # fmt: skip
    run = _Pass(model=model, processor=proc, proc=with_branch_prefix(proc, "<think>"), sigmas=[0.2], R=1, seed=0,
                method=get_method("latent"), branch_prefix="<think>", temperature=1.0, marginal_draws=2,
                final_norm=True, sample=sample)  # fmt: skip
    with torch.no_grad():
        for c in range(0, prompts, 8):
            run._clean(c // 8, qs[c : c + 8], torch.device("cpu"))
    h = torch.stack([c.hs[0] for c in run.curves]).detach()
    z = torch.cat([c.z for c in run.curves]).detach()
    return run.head, h, z


def estimate(head, h, z, sigma, draws, rep, cv=True):
    P = h.shape[0]
    keys = [k for pid in range(P) for k in marginal_keys(rep, 1, 1000 * rep + pid, draws // 2)]
    return MarginalCurve(head, h, z, keys, temperature=1.0, control_variate=cv)(sigma)


def reference(head, h, z, sigma, draws, cv=True, chunk=1024):
    """The batch-mean TV from ``draws`` draws per prompt: the mean of ``draws / chunk`` independent
    estimates of ``chunk`` draws each (each nearly unbiased at 1,024 draws), and its standard error."""
    vals = torch.tensor(
        [estimate(head, h, z, sigma, chunk, 10_000 + r, cv).mean for r in range(draws // chunk)]
    )
    return float(vals.mean()), float(vals.std() / math.sqrt(len(vals)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--draws", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--ref-draws", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    head, h, z = branch_states(a.prompts)
    print(f"{a.prompts} prompts, d {h.shape[1]}, V {z.shape[1]}")
    for s in SIGMAS:
        ref, ref_se = reference(head, h, z, s, a.ref_draws)
        check, _ = reference(head, h, z, s, a.ref_draws // 4, cv=False)
        print(
            f"sigma {s}: reference {ref:.6f} (se {ref_se:.2g}); pairs only, {a.ref_draws // 4} draws: {check:.6f}"
        )
        for draws in a.draws:
            for cv in (True, False):
                ests, cover = [], 0
                for rep in range(a.reps):
                    f = estimate(head, h, z, s, draws, rep, cv)
                    ests.append(f.mean)
                    cover += abs(f.mean - ref) <= math.hypot(f.half_width, 1.96 * ref_se)
                e = torch.tensor(ests)
                print(
                    f"  {draws} draws{'' if cv else ', pairs only'}: bias {100 * (e.mean() / ref - 1):+.2f}% "
                    f"sd {100 * e.std() / ref:.2f}% coverage {cover}/{a.reps}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
