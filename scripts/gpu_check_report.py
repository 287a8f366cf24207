"""The report of ``scripts/gpu_check.sh``: reads what its parts left in ``OUT/logs/`` and writes
``OUT/report.json`` (everything) and ``OUT/report.md`` (atomically), and prints a short summary (the
device tool returns the end of a command's output). Standard library only, so it runs with any
``python3`` even where the checked environment is broken.

    python3 scripts/gpu_check_report.py OUT [--work WORK] [--started ISO] [--command "..."] [--quiet]

Reads ``logs/parts.tsv`` (one line per part: name, status, exit code, seconds, cap, note),
``logs/<part>.log`` (the end of a failed part's log goes into the report), ``logs/<part>.mem.csv``
(nvidia-smi samples: index, used MiB, total MiB; the peak per GPU), ``logs/env.log`` (its ``ENV_JSON``
line), ``logs/tests.xml`` (pytest's junit XML), the benchmarks' ``logs/rollout.json``, ``logs/step.json``
and ``logs/loss.json``, and ``WORK/train/metrics.jsonl`` and ``WORK/lora/metrics.jsonl``. A missing or
unreadable input is reported as such, never an exception: the report is written whatever the parts did.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

PARTS_FILE = "parts.tsv"
TAIL_LINES = 40
TRAIN_KEYS = (
    "loss",
    "reward",
    "reward_std",
    "entropy",
    "grad_norm",
    "noise/sigma_k",
    "noise/first_token_tv",
    "noise/rel_perturbation",
    "step_time",
)
ROLLOUT_LABELS = {
    "vanilla": "vanilla GRPO (TRL: one prefill per row, no hook)",
    "ncgrpo": "NC-GRPO, shared prefill",
    "ncgrpo_noshare": "NC-GRPO, one prefill per row",
}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _int(s: str) -> int | None:
    return int(s) if s.lstrip("-").isdigit() else None


def read_parts(logs: Path) -> list[dict]:
    parts = []
    f = logs / PARTS_FILE
    if not f.exists():
        return parts
    for line in f.read_text(encoding="utf-8").splitlines():
        cells = line.split("\t")
        if len(cells) < 4:
            continue
        name, status, rc, seconds = cells[:4]
        parts.append(
            {
                "name": name,
                "status": status,
                "exit_code": _int(rc),
                "seconds": _int(seconds),
                "cap_s": _int(cells[4]) if len(cells) > 4 else None,
                "note": cells[5] if len(cells) > 5 else "",
                "log": str(logs / f"{name}.log") if (logs / f"{name}.log").exists() else None,
            }
        )
    return parts


def log_tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    except OSError as e:
        return [f"(log unreadable: {e})"]


def peak_memory(path: Path) -> dict | None:
    """Peak used MiB per GPU index from nvidia-smi's CSV samples."""
    if not path.exists():
        return None
    peak: dict[str, dict] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 3 or not all(c.isdigit() for c in cells):
            continue
        idx, used, total = cells[0], int(cells[1]), int(cells[2])
        cur = peak.setdefault(idx, {"peak_used_mib": 0, "total_mib": total, "samples": 0})
        cur["peak_used_mib"] = max(cur["peak_used_mib"], used)
        cur["samples"] += 1
    return peak or None


def read_env(logs: Path) -> dict | None:
    f = logs / "env.log"
    if not f.exists():
        return None
    for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("ENV_JSON "):
            try:
                return json.loads(line[len("ENV_JSON ") :])
            except json.JSONDecodeError:
                return None
    return None


def read_junit(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable junit XML: {e}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": [], "skipped_reasons": []}
    for s in suites:
        for k in ("tests", "failures", "errors", "skipped"):
            out[k] += int(s.get(k, 0))
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            for tag in ("failure", "error"):
                el = case.find(tag)
                if el is not None:
                    out["failed"].append({"test": name, "message": (el.get("message") or "")[:500]})
            el = case.find("skipped")
            if el is not None:
                out["skipped_reasons"].append({"test": name, "reason": (el.get("message") or "")[:300]})
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


def read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        return {"error": f"unreadable: {e}"}


def read_train(run: Path) -> dict | None:
    f = run / "metrics.jsonl"
    if not f.exists():
        return None
    rows = []
    for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    steps = [r for r in rows if "loss" in r]
    keep = [{k: r[k] for k in ("step", *TRAIN_KEYS) if k in r} for r in steps]
    final = next((r for r in reversed(rows) if "train_runtime" in r), None)
    return {
        "folder": str(run),
        "lines": len(rows),
        "steps_logged": len(steps),
        "steps": keep,
        "train_runtime_s": final.get("train_runtime") if final else None,
        "last_line": rows[-1] if rows else None,
    }


# ------------------------------------------------------------------------------- benchmark summaries
def rollout_summary(b: dict) -> dict:
    if "error" in b:
        return b
    keys = (
        "rows",
        "prompt_tokens",
        "params",
        "median_s",
        "paired_ratio",
        "ratio",
        "ratio_noshare",
        "new_tokens_per_s",
        "peak_memory_bytes",
        "decode",
        "decode_roofline",
        "breakdown",
        "hook_share_of_prefill",
        "repeats_done",
        "time_cap_s",
        "cut_by_time_cap",
        "build_s",
    )
    out = {k: b.get(k) for k in keys}
    out["machine"], out["config"] = b.get("machine"), b.get("config")
    return out


def step_summary(b: dict) -> dict:
    if "error" in b:
        return b
    methods = {}
    for m, d in (b.get("methods") or {}).items():
        methods[m] = {
            k: d.get(k)
            for k in (
                "median_wall_s",
                "ratio_wall",
                "ratio_wall_ci95",
                "paired_ratio_wall",
                "median_sections_s",
                "wall_s",
            )
        }
    return {
        "machine": b.get("machine"),
        "config": b.get("config"),
        "params": b.get("params"),
        "rows_per_step": b.get("rows_per_step"),
        "timed_steps_per_method": b.get("timed_steps_per_method"),
        "rounds_done": b.get("rounds_done"),
        "cut_by_time_cap": b.get("cut_by_time_cap"),
        "methods_not_run": b.get("methods_not_run"),
        "equal_lengths": b.get("equal_lengths"),
        "methods": methods,
    }


def loss_summary(b: dict) -> dict:
    if "error" in b:
        return b
    return {"config": b.get("config"), "flops": b.get("flops"), "timed": b.get("proxy")}


def build(out: Path, work: Path | None, started: str | None, command: str | None) -> dict:
    logs = out / "logs"
    parts = read_parts(logs)
    for p in parts:
        p["memory"] = peak_memory(logs / f"{p['name']}.mem.csv")
        if p["status"] == "failed" and p["log"]:
            p["log_tail"] = log_tail(Path(p["log"]))
    rollout, step, loss = (read_json(logs / f"{n}.json") for n in ("rollout", "step", "loss"))
    return {
        "started": started,
        "finished": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "environment": read_env(logs),
        "parts": parts,
        "seconds_total": sum(p["seconds"] or 0 for p in parts),
        "tests": read_junit(logs / "tests.xml"),
        "rollout": rollout_summary(rollout) if rollout is not None else None,
        "step": step_summary(step) if step is not None else None,
        "loss": loss_summary(loss) if loss is not None else None,
        "train": read_train(work / "train") if work is not None else None,
        "lora": read_train(work / "lora") if work is not None else None,
        # a tests part that collected no gpu-marked test checked nothing: not ok
        "ok": bool(parts) and not any(p["status"] in ("failed", "empty") for p in parts),
    }


# ----------------------------------------------------------------------------------------- markdown
def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _gib(b) -> str:
    return "-" if not b else f"{b / 2**30:.2f}"


def _machine_md(env: dict | None) -> list[str]:
    lines = ["", "## Machine", ""]
    if not env:
        return lines + ["(the environment probe did not run or failed; see the env part below)"]
    gpus = ", ".join(env.get("gpus") or []) or "none visible to torch"
    lines.append(
        f"GPUs: {gpus}"
        + (f" ({env['gpu_memory_gib']} GiB, {env.get('gpu_sms')} SMs)" if env.get("gpu_memory_gib") else "")
        + f"; CUDA available: {env.get('cuda_available')} (torch CUDA {env.get('torch_cuda')}); "
        f"Python {env.get('python')}; {env.get('cpu_count')} CPUs."
    )
    names = ("torch", "transformers", "trl", "datasets", "accelerate", "peft", "math_verify", "tokenizers")
    lines.append("Packages: " + ", ".join(f"{k} {env.get(k) or 'absent'}" for k in names) + ".")
    for k in ("transformers", "trl", "ncgrpo"):
        if env.get(k + "_from"):
            lines.append(f"- {k} imported from `{env[k + '_from']}`")
        elif env.get(k + "_error"):
            lines.append(f"- {k}: {env[k + '_error']}")
    return lines


def _rollout_md(b: dict) -> list[str]:
    lines = ["", "## P1: rollout, NC-GRPO vs vanilla (bench_rollout)", ""]
    if "error" in b:
        return lines + [b["error"]]
    cfg, med = b.get("config") or {}, b.get("median_s") or {}
    params = (b.get("params") or {}).get("total")
    lines.append(
        f"{_fmt(b.get('rows'))} rows (P = {cfg.get('prompts')}, G = {2 * (cfg.get('n') or 0)}), "
        f"{_fmt(b.get('prompt_tokens'))} prompt tokens, {cfg.get('max_new_tokens')} new tokens each, "
        f"{cfg.get('size')} ({_fmt(None if params is None else params / 1e9, 2)} B parameters), {cfg.get('dtype')}, "
        f"{b.get('repeats_done')} interleaved repeats."
    )
    for c in b.get("cut_by_time_cap") or []:
        lines.append(f"- cut by the time cap: {c}")
    dec, tps, mem = b.get("decode") or {}, b.get("new_tokens_per_s") or {}, b.get("peak_memory_bytes") or {}
    paired = b.get("paired_ratio") or {}
    lines += [
        "",
        "| arm | median s | x vanilla | paired | new tokens/s | decode ms/step | HBM roofline | peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = med.get("vanilla")
    for arm, label in ROLLOUT_LABELS.items():
        if arm not in med:
            continue
        d = dec.get(arm) or {}
        frac = d.get("hbm_roofline_fraction")
        lines.append(
            f"| {label} | {_fmt(med[arm])} | {_fmt(med[arm] / base if base else None, 4)} | "
            f"{_fmt(paired.get(arm), 3)} | {_fmt(tps.get(arm), 0)} | "
            f"{_fmt(None if d.get('s_per_step') is None else 1e3 * d['s_per_step'], 2)} | "
            f"{'-' if frac is None else f'{100 * frac:.1f}%'} | {_gib(mem.get(arm))} |"
        )
    roof = b.get("decode_roofline") or {}
    if roof.get("floor_s_per_step"):
        lines.append(
            f"\nHBM floor of a decode step: {roof['weight_bytes'] / 1e9:.2f} GB of weights + "
            f"{roof['kv_bytes_mean'] / 1e9:.3f} GB of KV cache at the mean context, over the measured "
            f"{roof['bandwidth_Bps'] / 1e12:.2f} TB/s = {1e3 * roof['floor_s_per_step']:.3f} ms."
        )
    for pos, s in (b.get("hook_share_of_prefill") or {}).items():
        lines.append(
            f"- the hook's share of the prefill (positions={pos}): {100 * s['share']:.2f}% "
            f"({1e3 * s['hook_s']:.2f} of {1e3 * s['prefill_s']:.1f} ms)"
        )
    return lines


def _step_md(b: dict) -> list[str]:
    lines = ["", "## P2: optimizer step, NC-GRPO vs vanilla (bench_train)", ""]
    if "error" in b:
        return lines + [b["error"]]
    cfg = b.get("config") or {}
    lines.append(
        f"{cfg.get('size')}, {b.get('rows_per_step')} rows a step (G = {cfg.get('G')}), "
        f"{cfg.get('max_completion_length')} completion tokens forced, {b.get('rounds_done')} interleaved "
        f"rounds, {b.get('timed_steps_per_method')} timed steps per method (the first step of a run is warm-up)."
    )
    for c in b.get("cut_by_time_cap") or []:
        lines.append(f"- cut by the time cap: {c}")
    if b.get("methods_not_run"):
        lines.append(f"- not run (the cap): {', '.join(b['methods_not_run'])}")
    lines += [
        "",
        "| method | median step s | x vanilla | 95% CI | paired | generate s | compute_loss s | rest s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m, d in (b.get("methods") or {}).items():
        ci = d.get("ratio_wall_ci95") or [None, None]
        sec = d.get("median_sections_s") or {}
        lines.append(
            f"| {m} | {_fmt(d.get('median_wall_s'))} | {_fmt(d.get('ratio_wall'))} | "
            f"[{_fmt(ci[0])}, {_fmt(ci[1])}] | {_fmt(d.get('paired_ratio_wall'))} | "
            f"{_fmt(sec.get('generate'))} | {_fmt(sec.get('compute_loss'))} | {_fmt(sec.get('rest'))} |"
        )
    return lines


def _loss_md(b: dict) -> list[str]:
    lines = ["", "## Shared-prompt loss vs TRL's pass (bench_loss_share)", ""]
    if "error" in b:
        return lines + [b["error"]]
    for kind, m in (b.get("timed") or {}).items():
        e, med = m.get("exactness") or {}, m.get("median_s") or m.get("median_cpu_s") or {}
        lines.append(
            f"- {kind}, {m.get('tower')} tower, {m.get('device')} {m.get('dtype')}, attention "
            f"{m.get('attn_implementation')}; G = {m.get('G')}, P = {m.get('P')}, C = {m.get('C')} (tokens "
            f"{m.get('tokens_repeated')} -> {m.get('tokens_shared')}); forward + backward, {m.get('repeats_done')} "
            f"repeats ({m.get('clock')}): TRL {_fmt(med.get('repeated'))} s, shared {_fmt(med.get('shared'))} s "
            f"= **{_fmt(m.get('ratio'))}x** (packs {m.get('packs')}); all rows in one pack {_fmt(m.get('ratio_one_pack'))}x; "
            f"peak memory {', '.join(f'{k} {_gib(v)} GiB' for k, v in (m.get('peak_memory_bytes') or {}).items()) or '-'}"
        )
        lines.append(
            f"  exactness: loss |diff| {_fmt(e.get('loss_abs_diff'), 2)}, log-prob max |diff| "
            f"{_fmt(e.get('max_abs_logp_diff'), 4)}, entropy {_fmt(e.get('max_abs_entropy_diff'), 4)}, max relative "
            f"gradient diff {_fmt(e.get('max_rel_grad_diff'), 4)}; log-probs bit-identical: {e.get('bit_identical_logps')}"
        )
        if m.get("cut_by_time_cap"):
            lines.append(f"  cut by the time cap: {m['cut_by_time_cap']}")
    for name, f in (b.get("flops") or {}).items():
        lines.append(
            f"- FLOPs at the recipes' proportions, {name}: loss side {f.get('ratio', 0):.3f}x of TRL's "
            f"({f.get('ratio_packed', 0):.3f}x as shared_loss packs it)"
        )
    return lines


def _train_md(tr: dict, title: str) -> list[str]:
    lines = [
        "",
        f"## {title}",
        "",
        f"{tr['steps_logged']} steps logged in `{tr['folder']}/metrics.jsonl`; train_runtime "
        f"{_fmt(tr['train_runtime_s'], 1)} s.",
    ]
    if tr["steps"]:
        keys = sorted({k for s in tr["steps"] for k in s})
        lines += ["", "| " + " | ".join(keys) + " |", "| " + " | ".join("---" for _ in keys) + " |"]
        for s in tr["steps"]:
            lines.append("| " + " | ".join(_fmt(s.get(k), 4) for k in keys) + " |")
    return lines


def markdown(r: dict) -> str:
    lines = ["# GPU check", ""]
    lines.append(
        f"Started {_fmt(r['started'])}, finished {r['finished']}; parts {r.get('seconds_total')} s in all; "
        f"overall: **{'ok' if r['ok'] else 'FAILED'}**."
    )
    if r.get("command"):
        lines += ["", f"    {r['command']}"]
    lines += _machine_md(r.get("environment"))
    lines += [
        "",
        "## Parts",
        "",
        "| part | status | exit | seconds | cap | peak GPU memory (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in r["parts"]:
        mem = p.get("memory")
        mem_s = (
            "; ".join(f"GPU {i}: {m['peak_used_mib']} of {m['total_mib']}" for i, m in mem.items())
            if mem
            else "-"
        )
        status = p["status"] + (f" ({p['note']})" if p.get("note") else "")
        lines.append(
            f"| {p['name']} | {status} | {_fmt(p['exit_code'])} | {_fmt(p['seconds'])} | "
            f"{_fmt(p.get('cap_s'))} | {mem_s} |"
        )
    t = r.get("tests")
    if t:
        lines += ["", "## gpu-marked tests", ""]
        if "error" in t:
            lines.append(t["error"])
        else:
            lines.append(
                f"{t['tests']} collected: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, "
                f"{t['skipped']} skipped."
            )
            for f in t["failed"]:
                lines.append(f"- FAILED `{f['test']}`: {f['message']}")
            for s in t["skipped_reasons"]:
                lines.append(f"- skipped `{s['test']}`: {s['reason']}")
    if r.get("rollout"):
        lines += _rollout_md(r["rollout"])
    if r.get("step"):
        lines += _step_md(r["step"])
    if r.get("loss"):
        lines += _loss_md(r["loss"])
    if r.get("train"):
        lines += _train_md(r["train"], "3 NC-GRPO training steps (the 7B recipe scaled, transformers engine)")
    if r.get("lora"):
        lines += _train_md(r["lora"], "LoRA training steps (use_peft)")
    failed = [p for p in r["parts"] if p.get("log_tail")]
    if failed:
        lines += ["", "## Failed parts: end of their logs"]
        for p in failed:
            lines += [
                "",
                f"### {p['name']} (exit {p['exit_code']}; {p['log']})",
                "",
                "```",
                *p["log_tail"],
                "```",
            ]
    return "\n".join(lines) + "\n"


def summary(r: dict) -> str:
    """A few lines for the end of the command's output."""
    out = [f"gpu_check: {'ok' if r['ok'] else 'FAILED'}; parts {r.get('seconds_total')} s"]
    out.append(
        "  "
        + ", ".join(
            f"{p['name']} {p['status']} {_fmt(p['seconds'])}/{_fmt(p.get('cap_s'))}s" for p in r["parts"]
        )
    )
    t = r.get("tests")
    if t and "error" not in t:
        out.append(
            f"  tests: {t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped"
        )
    b = r.get("rollout")
    if b and "error" not in b and b.get("median_s"):
        med = b["median_s"]
        out.append(
            "  P1 rollout x vanilla: "
            + ", ".join(f"{k} {med[k] / med['vanilla']:.3f}" for k in med if k != "vanilla")
            + f" ({b.get('repeats_done')} repeats)"
        )
    s = r.get("step")
    if s and "error" not in s and s.get("methods"):
        out.append(
            "  P2 step x vanilla: "
            + ", ".join(f"{m} {_fmt(d.get('ratio_wall'))}" for m, d in s["methods"].items() if m != "vanilla")
            + f" ({s.get('timed_steps_per_method')} timed steps each)"
        )
    lo = r.get("loss")
    if lo and "error" not in lo:
        for kind, m in (lo.get("timed") or {}).items():
            out.append(
                f"  loss {kind}: shared / TRL {_fmt(m.get('ratio'))}, max rel grad diff "
                f"{_fmt((m.get('exactness') or {}).get('max_rel_grad_diff'), 4)}"
            )
    for key in ("train", "lora"):
        tr = r.get(key)
        if tr:
            out.append(f"  {key}: {tr['steps_logged']} steps logged")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the OUT_DIR given to gpu_check.sh")
    ap.add_argument(
        "--work", default=None, help="its --work folder (the training runs are WORK/train, WORK/lora)"
    )
    ap.add_argument("--started", default=None)
    ap.add_argument("--command", default=None)
    ap.add_argument("--quiet", action="store_true", help="do not print the summary")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not (out / "logs").is_dir():
        print(
            f"gpu_check_report: error: {out}/logs does not exist (run scripts/gpu_check.sh {out} first)",
            file=sys.stderr,
        )
        return 2
    report = build(out, Path(args.work) if args.work else None, args.started, args.command)
    _atomic_write(out / "report.json", json.dumps(report, indent=2, default=str) + "\n")
    _atomic_write(out / "report.md", markdown(report))
    if not args.quiet:
        print(summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
