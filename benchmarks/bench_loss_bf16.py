"""The shared-prompt loss in bf16: its error against a float32 reference, next to TRL's own pass's.

Issue 42, item 3. On an H200 in bf16 ``share_prompt_loss``'s log-probs differed from TRL's pass by up to
0.066 and its gradients by up to 4.1% (docs/gpu.md). Is that bf16 rounding of the size TRL's own pass
shows across batch layouts, or a fault? Each arm below is compared with a float32 reference: the same
weights in float32 through TRL 1.16's ``GRPOTrainer._get_per_token_logps_and_entropies`` (log-probs,
entropies, a GRPO-shaped loss, every parameter's gradient). Models, inputs and loss are
``bench_loss_share.py``'s (text Qwen2 / Qwen2.5-VL with an image prompt, hidden 256 x 4 layers, one
group of ``G`` rows of one prompt). bf16 arms, each forward + backward:

- ``trl_1mb``: TRL's pass, the ``G`` rows in one micro-batch (``per_device_train_batch_size = G``);
- ``trl_2mb``: TRL's pass, the rows in micro-batches of ``G / 2`` (``batch_size=G // 2``, as TRL's
  old-log-prob pass cuts a batch, or a smaller ``per_device_train_batch_size``);
- ``trl_pad``: TRL's pass, every row left-padded by ``--pad`` tokens (what the group gets in a
  micro-batch that also holds a longer prompt: TRL left-pads prompts);
- ``shared``: ``shared_loss.per_token_logps_and_entropies`` as the trainer runs it (the packs
  ``split_set`` chooses, rows left alone through TRL's pass);
- ``shared_1pack``: all ``G`` rows in one packed sequence.

Precision (``--precision``): ``bf16`` = the weights in bfloat16 and bf16 autocast, what the recipes run
(``dtype: bfloat16`` loads the model in bf16; TRL's ``bf16=True`` makes accelerate wrap the forwards in
``autocast(bfloat16)``, see ``GRPOTrainer._get_per_token_logps_and_entropies``); ``amp`` = float32 weights
under bf16 autocast (TRL's default when the model loads in float32; ``bench_train --amp auto`` on CUDA).
Gradients of bf16 weights are bf16; they are compared in float32.

Per arm: max and mean |log-prob - fp32| over the completion tokens, the same for entropies, |loss - fp32|,
the gradients' relative L2 error ``||g - g32|| / ||g32||`` per parameter (max, median) and over all
parameters together (global). Also the direct differences ``trl_2mb``/``trl_pad``/``shared`` vs
``trl_1mb`` (the H200 measurement compared ``shared`` with ``trl_1mb``).

    python benchmarks/bench_loss_bf16.py --threads 1 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench_loss_share import build, loss_inputs, to_device  # noqa: E402


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return nullcontext
    return partial(torch.autocast, device.type, dtype=dtype)


def trl_path(model, x, autocast, batch_size=None):
    """TRL 1.16's own method, its autocast what ``bf16=True`` gives (``accelerator.autocast``)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    ns = SimpleNamespace(accelerator=SimpleNamespace(autocast=autocast))
    fn = GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__
    logps, ent, _ = fn(
        ns, model, x["input_ids"], x["attention_mask"], x["C"], batch_size=batch_size, compute_entropy=True,
        **x["mm"],
    )  # fmt: skip
    return logps, ent


def shared_path(model, x, autocast, pack_rows=None, stats=None):
    """What ``share_prompt_loss=True`` runs (``NCGRPOTrainer`` passes the accelerator's autocast)."""
    from ncgrpo.trainer.shared_loss import per_token_logps_and_entropies

    def repeated(model, ids, am, c, compute_entropy, **mm):
        return trl_path(model, {"input_ids": ids, "attention_mask": am, "C": c, "mm": mm}, autocast)

    return per_token_logps_and_entropies(
        model, x["input_ids"], x["attention_mask"], x["C"], compute_entropy=True, pack_rows=pack_rows,
        autocast=autocast, repeated=repeated, stats=stats, **x["mm"],
    )  # fmt: skip


def left_pad(x: dict, pad: int, pad_id: int) -> dict:
    """Every row left-padded by ``pad`` tokens (attention mask 0), as TRL pads a shorter prompt."""
    if pad <= 0:
        return x
    B = x["input_ids"].shape[0]
    ids = torch.cat([torch.full((B, pad), pad_id, dtype=x["input_ids"].dtype), x["input_ids"]], 1)
    am = torch.cat([torch.zeros(B, pad, dtype=x["attention_mask"].dtype), x["attention_mask"]], 1)
    mm = dict(x["mm"])
    if "mm_token_type_ids" in mm:
        t = mm["mm_token_type_ids"]
        mm["mm_token_type_ids"] = torch.cat([torch.zeros(B, pad, dtype=t.dtype), t], 1)
    return {**x, "input_ids": ids, "attention_mask": am, "mm": mm}


def step(model, x, path):
    """Forward + backward of bench_loss_share's GRPO-shaped loss; log-probs, entropies, loss, gradients."""
    model.zero_grad(set_to_none=True)
    logps, ent = path(model, x)
    loss = -(x["adv"][:, None].to(logps.dtype) * logps + 0.01 * ent).mean()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(loss.detach()), "logps": logps.detach().float(), "ent": ent.detach().float(), "grads": grads,
            "logp_dtype": str(logps.dtype).removeprefix("torch.")}  # fmt: skip


def compare(a: dict, ref: dict) -> dict:
    """``a``'s error against ``ref`` (log-probs, entropies, loss, gradients)."""
    dl, de = (a["logps"] - ref["logps"]).abs(), (a["ent"] - ref["ent"]).abs()
    missing = sorted(set(ref["grads"]) ^ set(a["grads"]))
    if missing:
        raise AssertionError(f"gradients for different parameters: {missing[:5]}")
    rel, num, den = [], 0.0, 0.0
    for n, g32 in ref["grads"].items():
        d2, r2 = float((a["grads"][n] - g32).pow(2).sum()), float(g32.pow(2).sum())
        num, den = num + d2, den + r2
        if r2 > 0:
            rel.append((n, (d2 / r2) ** 0.5))
    worst = max(rel, key=lambda t: t[1])
    return {
        "logp_max": float(dl.max()),
        "logp_mean": float(dl.mean()),
        "ent_max": float(de.max()),
        "ent_mean": float(de.mean()),
        "loss": abs(a["loss"] - ref["loss"]),
        "grad_rel_max": worst[1],
        "grad_rel_max_param": worst[0],
        "grad_rel_median": statistics.median(r for _, r in rel),
        "grad_rel_global": (num / den) ** 0.5 if den > 0 else 0.0,
    }


ARMS = ("trl_1mb", "trl_2mb", "trl_pad", "shared", "shared_1pack")


def measure(kind: str, seed: int, args) -> dict:
    device = torch.device(args.device)
    low = {"bf16": torch.bfloat16, "amp": torch.float32}[args.precision]
    torch.manual_seed(seed)
    model32, proc = build(kind, seed, args.tower)
    model32 = model32.to(device)
    x = loss_inputs(kind, proc, model32.config.get_text_config().vocab_size, args.G, args.P, args.C, seed)
    if kind != "text":  # a sampled completion holds no image/video placeholder (the model would refuse it)
        special = [
            int(v) for k, v in model32.config.to_dict().items() if k.endswith("token_id") and v is not None
        ]
        comp = x["input_ids"][:, -args.C :]
        while (hit := torch.isin(comp, torch.tensor(special))).any():
            comp[hit] += 1
    pad_id = getattr(getattr(proc, "tokenizer", proc), "pad_token_id", None) or 0
    x32 = to_device(x, device, torch.float32)
    ref = step(model32, x32, partial(trl_path, autocast=nullcontext))
    model = copy.deepcopy(model32).to(dtype=low)  # the same weights
    if kind != "text":
        model.model.visual.requires_grad_(False)
    del model32
    xl = to_device(x, device, low)
    xl["adv"] = x32["adv"]  # the advantages are float32 in the trainer
    ac = _autocast(device, torch.bfloat16)
    stats = {}
    paths = {
        "trl_1mb": (xl, partial(trl_path, autocast=ac)),
        "trl_2mb": (xl, partial(trl_path, autocast=ac, batch_size=args.G // 2)),
        "trl_pad": (to_device(left_pad(x, args.pad, pad_id), device, low), partial(trl_path, autocast=ac)),
        "shared": (xl, partial(shared_path, autocast=ac, stats=stats)),
        "shared_1pack": (xl, partial(shared_path, autocast=ac, pack_rows=args.G)),
    }
    paths["trl_pad"][0]["adv"] = x32["adv"]
    out = {}
    t0 = time.perf_counter()
    for name, (inp, path) in paths.items():
        out[name] = step(model, inp, path)
    vs_ref = {k: compare(v, ref) for k, v in out.items()}
    vs_trl = {k: compare(out[k], out["trl_1mb"]) for k in ARMS if k != "trl_1mb"}
    return {
        "kind": kind,
        "seed": seed,
        "P": x["input_ids"].shape[1] - args.C,
        "packs": stats["packs"],
        "logp_dtype": out["trl_1mb"]["logp_dtype"],
        "vs_fp32": vs_ref,
        "vs_trl_1mb": vs_trl,
        "bf16_arms_s": time.perf_counter() - t0,
    }


def summary(runs: list[dict]) -> dict:
    """Per kind and arm: the max over seeds of each error (and the mean over seeds of the means)."""
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in runs):
        rs = [r for r in runs if r["kind"] == kind]
        for table in ("vs_fp32", "vs_trl_1mb"):
            for arm in rs[0][table]:
                rows = [r[table][arm] for r in rs]
                out[f"{kind}/{table}/{arm}"] = {
                    k: (statistics.mean if k.endswith("_mean") else max)(row[k] for row in rows)
                    for k in rows[0]
                    if not k.endswith("_param")
                }
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="text,vl")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--G", type=int, default=12)
    p.add_argument("--P", type=int, default=160, help="prompt tokens (incl. 64 image tokens for vl)")
    p.add_argument("--C", type=int, default=100, help="completion tokens")
    p.add_argument("--pad", type=int, default=24, help="left padding of the trl_pad arm")
    p.add_argument("--tower", default="proxy", choices=["proxy", "0.5b", "1.5b"])
    p.add_argument("--precision", default="bf16", choices=["bf16", "amp"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/bench_loss_bf16.json")
    args = p.parse_args(argv)
    if args.G < 2 or args.G % 2:
        p.error("--G must be even and >= 2 (trl_2mb splits the rows in two micro-batches)")
    torch.set_num_threads(args.threads)
    runs = []
    for kind in [k for k in args.kinds.split(",") if k]:
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            r = measure(kind, seed, args)
            runs.append(r)
            e = r["vs_fp32"]
            print(
                f"{kind} seed {seed} (P {r['P']}, C {args.C}, G {args.G}, packs {r['packs']}, {r['bf16_arms_s']:.0f} s): "
                + "; ".join(
                    f"{a} logp {e[a]['logp_max']:.3g}/{e[a]['logp_mean']:.2g} grad {e[a]['grad_rel_max']:.3g}"
                    f"/{e[a]['grad_rel_global']:.3g}"
                    for a in ARMS
                ),
                flush=True,
            )
    summ = summary(runs)
    print("# max over seeds (means: mean over seeds)")
    print(
        "| model | arm | against | logp max | logp mean | entropy max | loss | grad rel max | grad rel median | grad rel global |"
    )
    for key, v in summ.items():
        kind, table, arm = key.split("/")
        print(
            f"| {kind} | {arm} | {'fp32' if table == 'vs_fp32' else 'bf16 trl_1mb'} | {v['logp_max']:.3g} | "
            f"{v['logp_mean']:.2g} | {v['ent_max']:.3g} | {v['loss']:.2g} | {v['grad_rel_max']:.3g} | "
            f"{v['grad_rel_median']:.3g} | {v['grad_rel_global']:.3g} |"
        )
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip()  # fmt: skip
    except OSError:
        commit = None
    meta = {"commit": commit, "torch": torch.__version__, "machine": platform.platform(),
            "cpu": platform.processor()}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "meta": meta, "runs": runs, "summary": summ}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
