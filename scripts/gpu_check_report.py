"""The report of ``scripts/gpu_check.sh``: reads what its parts left in ``OUT/logs/`` and writes
``OUT/report.json`` and ``OUT/report.md`` (atomically). Standard library only, so it runs with any
``python3`` even where the checked environment is broken.

    python3 scripts/gpu_check_report.py OUT [--work WORK] [--started ISO] [--command "..."]

Reads ``logs/parts.tsv`` (one line per part: name, status, exit code, seconds, note), ``logs/<part>.log``
(the tail of a failed part's log goes into the report), ``logs/<part>.mem.csv`` (nvidia-smi samples:
index, used MiB, total MiB; the peak per GPU), ``logs/env.log`` (its ``ENV_JSON`` line),
``logs/tests.xml`` (pytest's junit XML), ``logs/bench_vllm_rollout.json`` and ``WORK/train/metrics.jsonl``.
A missing or unreadable input is reported as such, never an exception: the report is written whatever
the parts did.
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
TRAIN_KEYS = ("loss", "reward", "entropy", "grad_norm", "noise/sigma_k", "noise/first_token_tv", "step_time")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


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
                "exit_code": int(rc) if rc.lstrip("-").isdigit() else None,
                "seconds": int(seconds) if seconds.isdigit() else None,
                "note": cells[4] if len(cells) > 4 else "",
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


def bench_summary(b: dict) -> dict:
    if "error" in b:
        return b
    keys = (
        "vllm_median_s",
        "ratio_ncgrpo_over_vanilla",
        "paired_ratio_median",
        "ratio_sigma0_over_vanilla",
        "paired_ratio_sigma0_median",
        "plugin_in_engine_median_s",
        "plugin_hook_s_per_rollout",
        "transformers_ncgrpo_median_s",
        "speedup_vllm_over_transformers",
        "new_tokens_per_s",
        "engine_start_s",
        "model_build_s",
        "rows",
        "params",
    )
    out = {k: b.get(k) for k in keys}
    out["machine"] = b.get("machine")
    out["config"] = b.get("config")
    return out


def build(out: Path, work: Path | None, started: str | None, command: str | None) -> dict:
    logs = out / "logs"
    parts = read_parts(logs)
    for p in parts:
        p["memory"] = peak_memory(logs / f"{p['name']}.mem.csv")
        if p["status"] == "failed" and p["log"]:
            p["log_tail"] = log_tail(Path(p["log"]))
    bench = read_json(logs / "bench_vllm_rollout.json")
    report = {
        "started": started,
        "finished": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "environment": read_env(logs),
        "parts": parts,
        "tests": read_junit(logs / "tests.xml"),
        "bench": bench_summary(bench) if bench is not None else None,
        "train": read_train(work / "train") if work is not None else None,
        "ok": bool(parts) and not any(p["status"] == "failed" for p in parts),
    }
    return report


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown(r: dict) -> str:
    lines = ["# GPU check", ""]
    lines.append(
        f"Started {_fmt(r['started'])}, finished {r['finished']}; overall: **{'ok' if r['ok'] else 'FAILED'}**."
    )
    if r.get("command"):
        lines += ["", f"    {r['command']}"]
    env = r.get("environment")
    lines += ["", "## Machine", ""]
    if env:
        gpus = ", ".join(env.get("gpus") or []) or "none visible to torch"
        lines.append(
            f"GPUs: {gpus}; CUDA available: {env.get('cuda_available')}; Python {env.get('python')}."
        )
        versions = ", ".join(
            f"{k} {env.get(k) or 'absent'}"
            for k in ("torch", "transformers", "trl", "vllm", "deepspeed", "accelerate", "ncgrpo")
        )
        lines.append(f"Packages: {versions}.")
        lines.append(f"ncgrpo vLLM plugin installed (entry point): {env.get('ncgrpo_plugin_installed')}.")
    else:
        lines.append("(the environment probe did not run or failed; see the env part below)")
    lines += [
        "",
        "## Parts",
        "",
        "| part | status | exit | seconds | peak GPU memory (MiB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in r["parts"]:
        mem = p.get("memory")
        mem_s = (
            "; ".join(f"GPU {i}: {m['peak_used_mib']} of {m['total_mib']}" for i, m in mem.items())
            if mem
            else "-"
        )
        status = p["status"] + (f" ({p['note']})" if p.get("note") else "")
        lines.append(f"| {p['name']} | {status} | {_fmt(p['exit_code'])} | {_fmt(p['seconds'])} | {mem_s} |")
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
    b = r.get("bench")
    if b:
        lines += ["", "## vLLM rollout benchmark (Qwen2.5-VL-3B-sized, random weights)", ""]
        if "error" in b:
            lines.append(b["error"])
        else:
            cfg, med = b.get("config") or {}, b.get("vllm_median_s") or {}
            tps = b.get("new_tokens_per_s") or {}
            pe = b.get("plugin_in_engine_median_s") or {}
            lines.append(
                f"{b.get('rows')} rows (P = {cfg.get('prompts')}, G = {2 * (cfg.get('n') or 0)}), prompts >= "
                f"{cfg.get('prompt_tokens')} tokens, {cfg.get('max_new_tokens')} new tokens each, "
                f"{cfg.get('repeats')} interleaved repeats, dtype {cfg.get('dtype')}; engine start "
                f"{_fmt(b.get('engine_start_s'), 1)} s."
            )
            lines += [
                "",
                "| arm | median s | new tokens / s | plugin code in the worker, ms |",
                "| --- | --- | --- | --- |",
            ]
            for arm, label in (
                ("vanilla", "vanilla"),
                ("ncgrpo", "NC-GRPO"),
                ("sigma0", "NC-GRPO requests, sigma 0"),
            ):
                ms = pe.get(arm)
                lines.append(
                    f"| {label} | {_fmt(med.get(arm))} | {_fmt(tps.get(arm), 0)} | {_fmt(None if ms is None else 1e3 * ms, 2)} |"
                )
            lines += [
                "",
                f"NC-GRPO / vanilla: {_fmt(b.get('ratio_ncgrpo_over_vanilla'), 4)} (ratio of medians), "
                f"{_fmt(b.get('paired_ratio_median'), 4)} (median of paired ratios); sigma-0 / vanilla: "
                f"{_fmt(b.get('ratio_sigma0_over_vanilla'), 4)}, {_fmt(b.get('paired_ratio_sigma0_median'), 4)}.",
                f"transformers engine (NC-GRPO): {_fmt(b.get('transformers_ncgrpo_median_s'))} s; vLLM speed-up "
                f"{_fmt(b.get('speedup_vllm_over_transformers'), 2)}x.",
            ]
    tr = r.get("train")
    if tr:
        lines += [
            "",
            "## 3-step training run",
            "",
            f"{tr['steps_logged']} steps logged in `{tr['folder']}/metrics.jsonl`; train_runtime {_fmt(tr['train_runtime_s'], 1)} s.",
        ]
        if tr["steps"]:
            keys = sorted({k for s in tr["steps"] for k in s})
            lines += ["", "| " + " | ".join(keys) + " |", "| " + " | ".join("---" for _ in keys) + " |"]
            for s in tr["steps"]:
                lines.append("| " + " | ".join(_fmt(s.get(k), 4) for k in keys) + " |")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the OUT_DIR given to gpu_check.sh")
    ap.add_argument("--work", default=None, help="its --work folder (the training run is WORK/train)")
    ap.add_argument("--started", default=None)
    ap.add_argument("--command", default=None)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
