"""The registry that names the benchmarks: one :class:`BenchmarkSpec` a line, and one's own benchmarks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ncgrpo.data.benchmarks.converters import (
    HALLUSION_PAPER_SPLIT,
    Converter,
    _ai2d_row,
    _chartqa_row,
    _convert_hallusionbench,
    _custom_row,
    _geo3k_row,
    _gsm8k_row,
    _math500_row,
    _mathverse_row,
    _mathvision_row,
    _mathvista_row,
    _mmstar_row,
    _per_row,
    _pope_row,
    _realworldqa_row,
    _wemath_row,
)
from ncgrpo.data.benchmarks.rows import _ROLES
from ncgrpo.data.types import Role

# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark: where it lives on the hub, which split the paper uses, how rows convert."""

    name: str
    role: Role
    default_split: str
    hub_id: str
    loader: Converter
    hub_config: str | None = None
    #: Extra file names/globs (relative to the data folder, ``{split}`` substituted) tried before the
    #: generic ``data/{split}-*.parquet`` / ``{split}.parquet`` / ``{split}.json[l]`` ones.
    files: tuple[str, ...] = ()
    #: Columns holding images (so they are read undecoded and decoded here, with row-level errors).
    image_columns: tuple[str, ...] = ("image",)
    #: Splits made from another stored split by the loader (``{"image_paper": "image"}``).
    derived_splits: dict[str, str] = field(default_factory=dict)
    #: The paper's column label (tables and figures); empty: the name.
    label: str = ""
    #: Other names the tables know it by, beside its name and its hub repository's name.
    aliases: tuple[str, ...] = ()
    #: One of the paper's benchmarks (its tables, the n = 10,038 OOD questions); False: added since.
    in_paper: bool = True


#: The benchmarks, one a line, in the paper's column order: name, role, the split the paper uses, hub
#: repository, row converter, the paper's column label, then where the hub's layout differs from the
#: defaults.
# fmt: off
_SPECS = [
    BenchmarkSpec("geo3k",          "in_domain", "test",                "hiyouga/geometry3k",      _per_row(_geo3k_row),       label="Geo3K",       image_columns=("images",)),
    BenchmarkSpec("hallusionbench", "ood",       HALLUSION_PAPER_SPLIT, "lmms-lab/HallusionBench", _convert_hallusionbench,    label="Hallusion",   derived_splits={HALLUSION_PAPER_SPLIT: "image"}, aliases=("hallusion",)),
    BenchmarkSpec("mathvista",      "ood",       "testmini",            "AI4Math/MathVista",       _per_row(_mathvista_row),   label="MathVista",   image_columns=("decoded_image",)),
    BenchmarkSpec("mathverse",      "ood",       "testmini",            "AI4Math/MathVerse",       _per_row(_mathverse_row),   label="MathVerse",   hub_config="testmini", files=("{split}.parquet", "{split}.json")),
    BenchmarkSpec("mathvision",     "ood",       "test",                "MathLLMs/MathVision",     _per_row(_mathvision_row),  label="MathVision",  image_columns=("decoded_image",)),
    BenchmarkSpec("wemath",         "ood",       "testmini",            "We-Math/We-Math",         _per_row(_wemath_row),      label="WeMath",      image_columns=("image_path",)),
    BenchmarkSpec("pope",           "general",   "test",                "lmms-lab/POPE",           _per_row(_pope_row),        label="POPE"),
    BenchmarkSpec("mmstar",         "general",   "val",                 "Lin-Chen/MMStar",         _per_row(_mmstar_row),      label="MMStar",      hub_config="val", files=("mmstar.parquet",)),
    BenchmarkSpec("ai2d",           "general",   "test",                "lmms-lab/ai2d",           _per_row(_ai2d_row),        label="AI2D"),
    BenchmarkSpec("realworldqa",    "general",   "test",                "xai-org/RealworldQA",     _per_row(_realworldqa_row), label="RealWorldQA"),
    BenchmarkSpec("chartqa",        "general",   "test",                "HuggingFaceM4/ChartQA",   _per_row(_chartqa_row),     label="ChartQA"),
    # text-only math, beyond the paper's columns: ood for a model trained on Geo3K (--data NAME=FILE:ROLE
    # gives another role, e.g. gsm8k=FILE:in-domain for a model trained on GSM8K)
    BenchmarkSpec("gsm8k",          "ood",       "test",                "openai/gsm8k",            _per_row(_gsm8k_row),       label="GSM8K",       hub_config="main", files=("main/{split}-*.parquet",), image_columns=(), in_paper=False),
    BenchmarkSpec("math500",        "ood",       "test",                "HuggingFaceH4/MATH-500",  _per_row(_math500_row),     label="MATH-500",    files=("{split}.jsonl", "math500.jsonl"), image_columns=(), in_paper=False),
]
# fmt: on
BENCHMARKS: dict[str, BenchmarkSpec] = {spec.name: spec for spec in _SPECS}

#: How a role is written after ``NAME=FILE:`` (``ncgrpo eval --data``), to the records' role.
ROLE_NAMES: dict[str, Role] = {
    "in-domain": "in_domain",
    "in_domain": "in_domain",
    "ood": "ood",
    "general": "general",
}
#: A user's own benchmark's name: it labels records, tables and figures.
_CUSTOM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def _norm_name(name: str) -> str:
    """A benchmark name as the tables match it to the paper's labels: lower-case letters and digits."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


#: Every name of a built-in benchmark (its name, its hub repository's name, its aliases), as matched.
_KNOWN_NAMES: dict[str, BenchmarkSpec] = {
    _norm_name(n): spec for spec in _SPECS for n in (spec.name, spec.hub_id.rsplit("/", 1)[-1], *spec.aliases)
}


def known_benchmark(name: str) -> BenchmarkSpec | None:
    """The built-in benchmark ``name`` stands for, matched on lower-case letters and digits of its name,
    its hub repository's name or an alias (so "MathVista", "mathvista", "math_vista" and "Geometry3K"
    all match); None for any other name."""
    return _KNOWN_NAMES.get(_norm_name(name))


def parse_role(text: str) -> Role:
    """``in-domain`` (or ``in_domain``), ``ood`` or ``general`` to the records' role; else ValueError."""
    role = ROLE_NAMES.get(str(text).strip().lower())
    if role is None:
        raise ValueError(f"role {text!r} is not one of in-domain, ood, general")
    return role


def custom_benchmark(name: str, role: Role = "in_domain") -> BenchmarkSpec:
    """The spec of a user's own benchmark ``name`` (any name but the registered ones and ``synthetic``):
    rows in the geo3k schema, images optional (:func:`_custom_row`), read from a file or folder only.

    Its questions are labelled ``name`` in records, tables and figures, with ``role`` (in_domain, ood or
    general: which table and which pooled test they join)."""
    if not _CUSTOM_NAME.fullmatch(name or ""):
        raise ValueError(
            f"benchmark name {name!r}: use letters, digits and _ . + - (it names the records, tables and figures)"
        )
    # tables label those by the paper's names
    if known_benchmark(name) is not None or _norm_name(name) == "synthetic":
        raise ValueError(f"{name!r} is a built-in benchmark's name; give your own benchmark another name")
    if role not in _ROLES:
        raise ValueError(f"role must be one of {sorted(_ROLES)}, got {role!r}")
    return BenchmarkSpec(
        name, role, "test", hub_id="", loader=_per_row(_custom_row), image_columns=("images", "image")
    )
