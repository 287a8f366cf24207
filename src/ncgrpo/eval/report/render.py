"""Renderers of a :class:`ComparisonTable`: Markdown, LaTeX (booktabs) and rich (terminal), with the
legend and the listing of every test behind a star."""

from __future__ import annotations

import math
import re
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table as RichTable
from rich.text import Text

from ncgrpo.eval.report.table import Cell, Column, ComparisonTable, Row, Table
from ncgrpo.eval.stats import ALPHA, BOOTSTRAP_RESAMPLES, MDD_LABEL, POWER, SEEDS_NEEDED_LABEL

# --- rendering -------------------------------------------------------------------------------


def format_p(p: float, *, latex: bool = False) -> str:
    """The paper's p style: two decimals from 0.1 up, two significant digits below, ``<1e-4`` floor."""
    if p < 1e-4:
        return "{<}10^{-4}" if latex else "<1e-4"
    text = f"{p:.2f}" if p >= 0.1 else f"{p:#.2g}"
    return f"{{=}}{text}" if latex else f"={text}"


def _header(col: Column) -> str:
    return f"{col.label} (ID)" if col.role == "in_domain" else col.label


def _value(cell: Cell, pm: str) -> str:
    text = f"{cell.mean:.1f}"
    if cell.half_range is not None:
        text += f"{pm}{cell.half_range:.1f}"
    return text


def _pooled_text(cell: Cell, *, latex: bool, minus: str) -> str:
    if cell.test is None:
        return ""
    text = f"p{format_p(cell.test.p, latex=latex)}"
    if latex:
        text = f"${text}$"
    if cell.significant:
        text += " (+)" if cell.test.diff_pp > 0 else f" ({minus})"
    return text


def _seed_pairs_text(pairs: Any) -> str:
    """ "1/1, 2/2": the (configuration seed, baseline seed) pairs; a run without a seed (the base model,
    paired with every seed) is "–"."""
    return ", ".join("/".join("–" if s is None else str(s) for s in pair) for pair in pairs)


def _seed_text(cell: Cell, *, latex: bool, minus: str) -> str:
    """ "p=0.015 (+1.2 pp)": the seed-level p and the mean per-seed difference; "n/a" where the
    t-test is undefined (see ``stats.paired_ttest``)."""
    level = cell.seed_level
    if level is None:
        return ""
    diff = f"{level.mean_pp:+.1f}".replace("-", minus)
    if math.isnan(level.p):
        return f"n/a ({diff} pp)"
    if latex:
        return f"$p{format_p(level.p, latex=True)}$ ({diff} pp)"
    return f"p{format_p(level.p)} ({diff} pp)"


def _power_text(cell: Cell, kind: str) -> str:
    """The MDD (points) or the seeds needed of a seed-level test (``stats.seed_power``); "n/a" where
    the seeds have no spread."""
    if cell.seed_level is None:
        return ""
    power = cell.seed_level.power
    return power.seeds_needed_text if kind == "seeds_needed" else power.mdd_text


def _cells(table: Table, row: Row, style: str) -> list[str]:
    """Cell strings of one row: style "md" (Markdown), "latex" or "rich" (rich markup)."""
    dash = {"md": "—", "latex": "---", "rich": "—"}[style]
    pm = {"md": " ± ", "latex": " $\\pm$ ", "rich": " ± "}[style]
    out = []
    for col in table.columns:
        cell = row.cells[col.key]
        if col.kind == "pooled":
            text = _pooled_text(cell, latex=style == "latex", minus="$-$" if style == "latex" else "−")
            out.append(text or dash)
            continue
        if col.kind == "seed":
            text = _seed_text(cell, latex=style == "latex", minus="$-$" if style == "latex" else "−")
            out.append(text or dash)
            continue
        if col.kind in ("mdd", "seeds_needed"):
            text = _power_text(cell, col.kind)
            out.append((text.replace(">", "$>$") if style == "latex" else text) or dash)  # ">10,000"
            continue
        if cell.mean is None:
            out.append(dash)
            continue
        text = _value(cell, pm)
        if cell.bold:
            text = {"md": f"**{text}**", "latex": f"\\textbf{{{text}}}", "rich": f"[bold]{text}[/bold]"}[
                style
            ]
        if cell.significant:
            text += {"md": "\\*", "latex": "$^*$", "rich": "[yellow]*[/yellow]"}[style]
        out.append(text)
    return out


def _legend(ct: ComparisonTable, table: Table, *, latex: bool = False) -> str:
    pooled = any(c.kind == "avg" for c in table.columns)
    seeds = any(r.n_seeds > 1 for r in table.rows)
    seed_level = any(c.kind == "seed" for c in table.columns)
    text = _legend_head(ct, pooled, seeds, latex=latex)
    if seed_level:
        p = "$p$" if latex else "p"
        text += (
            f" Pooled {p} and the stars are question-level: McNemar tests over the questions of every seed "
            f"pair. Seed-level {p} (primary with several seeds, seeds being the unit of replication): paired "
            "t-test over training seeds of the per-seed accuracy difference on the same questions, with the "
            "mean difference in points. "
        )
        power = (
            f"{MDD_LABEL}: the smallest true mean difference that test detects with {POWER:.0%} probability "
            f"at alpha {ALPHA}, given the seeds' observed spread; {SEEDS_NEEDED_LABEL}: the seeds per arm at "
            "which the observed mean difference would reach that power (same spread)."
        )
        text += latex_text(power) if latex else power
    return text


def single_seed_notes(ct: ComparisonTable, table: Table) -> list[str]:
    """The notes of ``table``'s configurations with one seed pair: no seed-level claim can be made,
    and the seeds their difference would need at the embedded base's seed-to-seed sd."""
    return [e.note for e in ct.single_seed if e.scope == table.scope]


def _legend_head(ct: ComparisonTable, pooled: bool, seeds: bool, *, latex: bool) -> str:
    if latex:
        base = latex_text(ct.baseline)
        text = (
            f"Accuracy (\\%) vs.\\ {base}. Bold: best per column. $^*$: exact McNemar $p{{<}}{ALPHA}$ vs.\\ "
            f"{base} on paired per-question outcomes"
        )
        text += (
            " (OOD avg: pooled over the OOD questions). OOD avg: unweighted mean of the OOD benchmarks."
            if pooled
            else "; Pooled: one test over all questions of these benchmarks."
        )
        return text + (" $\\pm$: half-range over seeds." if seeds else "")
    text = (
        f"Accuracy (%) vs. {ct.baseline}. Bold: best per column. *: exact McNemar p<{ALPHA} vs. "
        f"{ct.baseline} on paired per-question outcomes"
    )
    text += (
        " (OOD avg: pooled over the OOD questions). OOD avg: unweighted mean of the OOD benchmarks."
        if pooled
        else "; Pooled: one test over all questions of these benchmarks."
    )
    return text + (" ±: half-range over seeds." if seeds else "")


def _tables(ct: ComparisonTable) -> list[Table]:
    return [t for t in (ct.main, ct.general) if t is not None and t.columns]


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*")


def tests_markdown(ct: ComparisonTable) -> str:
    """Every test vs. the baseline with its discordant counts and corrected flags."""
    m = len(ct.tests)
    lines = [
        f"Exact McNemar tests vs. {ct.baseline} (n10: method right, baseline wrong; n01: the reverse). "
        f"Holm and Bonferroni over this family of {m} tests, alpha={ALPHA}.",
        "",
        "| Configuration | Test | Seeds | n | n10 | n01 | Δ pp | p | Holm | Bonferroni |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for t in ct.tests:
        r = t.result
        seeds = _seed_pairs_text(t.seeds)
        lines.append(
            f"| {_md_escape(t.configuration)} | {_md_escape(t.scope)} | {seeds} | {r.n} | {r.n10} | {r.n01} | "
            f"{r.diff_pp:+.1f} | {r.p:.3g} | {'reject' if t.holm_reject else '—'} (p={t.holm_p:.3g}) | "
            f"{'reject' if t.bonferroni_reject else '—'} (p={t.bonferroni_p:.3g}) |"
        )
    return "\n".join(lines) + "\n"


def _ci(low: float, high: float) -> str:
    return "—" if math.isnan(low) else f"[{low:+.1f}, {high:+.1f}]"


def seed_reference(ct: ComparisonTable, scope: str) -> str | None:
    """The baseline's seed-to-seed line for ``scope``: what two seeds of one method already differ by."""
    null = ct.seed_null.get(scope)
    if null is None:
        return None
    per_pair = "/".join(f"{100 * d:.1f}" for d in null.differ)
    pairs = ", ".join(f"{i}/{j}" for i, j in null.pairs)
    q = null.pooled
    return (
        f"Reference ({scope}): two seeds of {ct.baseline} answer {100 * null.mean_differ:.1f}% of the questions "
        f"differently (mean over seed pairs {pairs}: {per_pair}%); question-level McNemar between them, "
        f"pooled over those pairs: p={q.p:.3g} ({q.n10}/{q.n01}). Read a configuration's differ % against it."
    )


def seed_tests_markdown(ct: ComparisonTable) -> str:
    """The seed-level tests, the baseline's seed-to-seed reference, and the notes where the
    question-level and seed-level tests disagree."""
    conf = ct.seed_tests[0].result.ttest.confidence if ct.seed_tests else 0.95
    b = ct.seed_tests[0].result.bootstrap.n_resamples if ct.seed_tests else BOOTSTRAP_RESAMPLES
    lines = [
        f"Training seeds as the unit (primary with several seeds): per seed pair the accuracy difference vs. "
        f"{ct.baseline} on the pooled questions, a paired t-test over the seeds (df = seeds − 1) and its "
        f"{100 * conf:.0f}% t interval; the hierarchical bootstrap interval ({b} resamples of seeds, then of "
        "questions within each seed) adds the question variance. Question-level p: the pooled McNemar test "
        "beside it, which treats the questions as the only source of variance. Differ %: share of questions "
        "answered differently, mean over the seed pairs. Not part of the Holm/Bonferroni family.",
        "",
    ]
    if ct.seed_tests:
        lines += [
            "| Configuration | Test | Seeds | Δ pp per seed | mean Δ pp | t CI | bootstrap CI | seed-level p | "
            "question-level p | differ % |",
            "|---|---|---|---|---:|---|---|---:|---:|---:|",
        ]
        for t in ct.seed_tests:
            tt, bs = t.result.ttest, t.result.bootstrap
            seeds = _seed_pairs_text(t.seeds)
            p = "n/a" if math.isnan(tt.p) else f"{tt.p:.3g}"
            lines.append(
                f"| {_md_escape(t.configuration)} | {_md_escape(t.scope)} | {seeds} | "
                f"{'/'.join(f'{d:+.1f}' for d in tt.diffs_pp)} | {tt.mean_pp:+.1f} | "
                f"{_ci(tt.ci_low_pp, tt.ci_high_pp)} | {_ci(bs.low_pp, bs.high_pp)} | {p} | "
                f"{t.question_level.p:.3g} | {100 * t.differ:.1f} |"
            )
        lines.append("")
    refs = [r for r in (seed_reference(ct, scope) for scope in ct.seed_null) if r]
    lines += [_md_escape(r) for r in refs]
    if ct.notes:
        lines += ["", "Where the two tests disagree:", ""] + [f"- {_md_escape(n)}" for n in ct.notes]
    return "\n".join(lines).rstrip("\n") + "\n"


def to_markdown(ct: ComparisonTable, *, with_tests: bool = True) -> str:
    parts = [f"**{_md_escape(ct.header)}**\n"] if ct.header else []
    for table in _tables(ct):
        head = ["Method"] + [_header(c) for c in table.columns]
        lines = [
            f"## {table.title}",
            "",
            "| " + " | ".join(_md_escape(h) for h in head) + " |",
            "|" + "---|" + "---:|" * len(table.columns),
        ]
        for row in table.rows:
            lines.append("| " + " | ".join([_md_escape(row.name)] + _cells(table, row, "md")) + " |")
        lines += ["", _md_escape(_legend(ct, table))]
        notes = single_seed_notes(ct, table)
        if notes:
            lines += ["", *(f"- {_md_escape(n)}" for n in notes)]
        parts.append("\n".join(lines) + "\n")
    if ct.seed_tests or ct.seed_null:
        parts.append("## Seed-level tests\n\n" + seed_tests_markdown(ct))
    if with_tests and ct.tests:
        parts.append("## Paired tests\n\n" + tests_markdown(ct))
    return "\n".join(parts)


_LATEX_SPECIAL = {
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "\\": r"\textbackslash{}",
}


def latex_text(text: str) -> str:
    """Escape a label for LaTeX; ``σ0=0.2`` becomes ``$\\sigma_0{=}0.2$`` as in the paper."""
    parts = re.split(r"(σ\d*=?[\d.]*)", text)
    out = []
    for part in parts:
        m = re.fullmatch(r"σ(\d*)(=?)([\d.]*)", part)
        if m:
            sub = f"_{m.group(1)}" if m.group(1) else ""
            eq = "{=}" if m.group(2) else ""
            out.append(f"$\\sigma{sub}{eq}{m.group(3)}$")
        else:
            out.append("".join(_LATEX_SPECIAL.get(ch, ch) for ch in part))
    return "".join(out)


def to_latex(ct: ComparisonTable) -> str:
    """booktabs tables in the paper's style (``\\textbf`` best, ``$^*$`` significant)."""
    blocks = []
    diff = f"{latex_text(ct.header)}. " if ct.header else ""
    for table in _tables(ct):
        head = ["Method"] + [_header(c) for c in table.columns]
        lines = [
            "\\begin{table*}[t]",
            "  \\centering",
            "  \\small",
            "  \\begin{tabular}{l" + "c" * len(table.columns) + "}",
            "    \\toprule",
            "    " + " & ".join(latex_text(h) for h in head) + " \\\\",
            "    \\midrule",
        ]
        for row in table.rows:
            lines.append("    " + " & ".join([latex_text(row.name)] + _cells(table, row, "latex")) + " \\\\")
        lines += [
            "    \\bottomrule",
            "  \\end{tabular}",
            f"  \\caption{{\\textbf{{{latex_text(table.title)}.}} {diff}{_legend(ct, table, latex=True)}"
            + "".join(f" {latex_text(n)}." for n in single_seed_notes(ct, table))
            + "}",
            "\\end{table*}",
        ]
        blocks.append("\n".join(lines))
    head = "% Generated by `ncgrpo compare`; needs \\usepackage{booktabs}.\n"
    if ct.header:
        head += f"\\noindent\\textbf{{{latex_text(ct.header)}}}\n\n"
    return head + "\n\n".join(blocks) + "\n"


def to_rich(ct: ComparisonTable) -> list[Any]:
    """rich renderables: one table per results table, then the test listing."""

    out: list[Any] = [Text(ct.header, style="bold")] if ct.header else []
    for table in _tables(ct):
        caption = "\n".join([_legend(ct, table), *map(escape, single_seed_notes(ct, table))])
        rt = RichTable(title=table.title, caption=caption, caption_justify="left")
        rows = [_cells(table, row, "rich") for row in table.rows]
        rt.add_column("Method", no_wrap=True)
        for col in table.columns:
            rt.add_column(
                escape(_header(col)),
                justify="right",
                no_wrap=True,
                style="on grey15" if col.kind == "avg" else None,
            )
        for row, cells in zip(table.rows, rows, strict=True):
            rt.add_row(escape(row.name), *cells)
        out.append(rt)
    if ct.tests:
        columns = ["Configuration", "Test", "n", "n10", "n01", "Δ pp", "p", "Holm", "Bonf."]
        rows = [
            [
                escape(t.configuration), escape(t.scope), str(t.result.n), str(t.result.n10), str(t.result.n01),
                f"{t.result.diff_pp:+.1f}", f"{t.result.p:.3g}", "reject" if t.holm_reject else "—",
                "reject" if t.bonferroni_reject else "—",
            ]
            for t in ct.tests
        ]  # fmt: skip
        title = f"Paired exact McNemar tests vs. {ct.baseline} (Holm/Bonferroni over {len(ct.tests)} tests)"
        out.append(_rich_table(title, columns, "llrrrrrll", rows))
    if ct.seed_tests:
        columns = ["Configuration", "Test", "Δ pp per seed", "mean Δ pp", "t CI", "bootstrap CI", "seed-level p",
                   "question-level p", "differ %"]  # fmt: skip
        rows = [
            [
                escape(t.configuration), escape(t.scope), "/".join(f"{d:+.1f}" for d in t.result.ttest.diffs_pp),
                f"{t.result.ttest.mean_pp:+.1f}", _ci(t.result.ttest.ci_low_pp, t.result.ttest.ci_high_pp),
                _ci(t.result.bootstrap.low_pp, t.result.bootstrap.high_pp),
                "n/a" if math.isnan(t.result.ttest.p) else f"{t.result.ttest.p:.3g}",
                f"{t.question_level.p:.3g}", f"{100 * t.differ:.1f}",
            ]
            for t in ct.seed_tests
        ]  # fmt: skip
        title = f"Seed-level tests vs. {ct.baseline} (paired t-test over training seeds; primary with several seeds)"
        out.append(_rich_table(title, columns, "lllrllrrr", rows))
    lines = [r for r in (seed_reference(ct, scope) for scope in ct.seed_null) if r]
    lines += [f"Note: {n}" for n in ct.notes]
    if lines:
        out.append(Text("\n".join(lines)))
    return out


def _rich_table(title: str, columns: list[str], justify: str, rows: list[list[str]]) -> Any:
    """A rich table: one column per name, ``justify`` one letter per column (l: left, r: right)."""

    table = RichTable(title=title)
    for name, j in zip(columns, justify, strict=True):
        table.add_column(name, justify="left" if j == "l" else "right")
    for row in rows:
        table.add_row(*row)
    return table


def print_rich(ct: ComparisonTable, console: Any = None) -> None:
    console = console or Console()
    width = console.width
    try:
        for renderable in to_rich(ct):
            # At its natural width: a table wider than the terminal wraps rather than truncating numbers.
            # Text (the reference line, the notes) wraps at the terminal's width.
            natural = (
                Measurement.get(console, console.options.update_width(10_000), renderable).maximum
                if not isinstance(renderable, Text)
                else width
            )
            console.width = max(width, natural)
            console.print(renderable, crop=False)
    finally:
        console.width = width
