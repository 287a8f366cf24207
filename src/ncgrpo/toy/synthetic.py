"""The embedded synthetic visual-math suite: the paper's protocol in miniature, offline, on a CPU.

Nobody can download Qwen2.5-VL or Geometry3K offline, so a tiny vision-language model is trained on
one geometry-like family (``in_domain``, the Geometry3K stand-in) and evaluated in-domain, on held-out
families that need another skill (``ood``) and on a POPE-style object-existence probe (``general``).

Design, in the order a reader needs it:

* Images are ``IMAGE_SIZE`` x ``IMAGE_SIZE`` RGB (84 = 6 patches of 14 px, a multiple of the 28 px
  factor Qwen2.5-VL's processor resizes to), flat colours on white, drawn without anti-aliasing so
  every pixel is one of a few exact colours. Numbers are drawn as seven-segment digits from
  rectangles (``DIGIT_W`` x ``DIGIT_H``, stroke ``STROKE``): no font file, identical everywhere.
* Every item is ``spec -> image``: a family's ``sample(rng)`` draws the whole scene description
  (``spec = {"scene": ..., "ask": ...}``), the problem text and the answer; ``render(spec["scene"])``
  draws it. The spec is what ``tests/data/solver.py`` re-solves independently.
* The image is necessary: each sampler draws the problem text first, then the answer uniformly from
  the family's answer set, independently of the text, then a scene with that answer. So the best
  text-only predictor is at chance, which ``Family.chance`` states
  (``E_text[max_a P(a | text)]`` = the mean over question kinds of 1 / #answers).
* Everything is seeded from ``random.Random`` instances (never global state): one stream per
  (seed, split, family), so the test split does not change when the train size does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

from ncgrpo.data.types import LETTERS as ALL_LETTERS
from ncgrpo.data.types import AnswerType, Role

__all__ = [
    "IMAGE_SIZE",
    "COLOURS",
    "SHAPES",
    "Item",
    "Family",
    "FAMILIES",
    "family",
    "render",
    "DEFAULT_SIZES",
    "SPLITS",
]

IMAGE_SIZE = 84
WHITE = (255, 255, 255)
INK = (0, 0, 0)
GRID = (200, 200, 200)
#: The palette; names are the words used in problem texts.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 38, 38),
    "green": (22, 163, 74),
    "blue": (37, 99, 235),
    "yellow": (234, 179, 8),
    "purple": (147, 51, 234),
    "orange": (249, 115, 22),
}
SHAPES = ("circle", "square", "triangle")

# Seven-segment digits: cell DIGIT_W x DIGIT_H, bars STROKE thick, DIGIT_GAP between cells.
DIGIT_W, DIGIT_H, STROKE, DIGIT_GAP = 7, 12, 2, 2
# Segment rectangles (x0, y0, x1, y1), end-exclusive, inside one cell.
_SEGMENT_BOXES = {
    "a": (0, 0, 7, 2),
    "b": (5, 0, 7, 7),
    "c": (5, 5, 7, 12),
    "d": (0, 10, 7, 12),
    "e": (0, 5, 2, 12),
    "f": (0, 0, 2, 7),
    "g": (0, 5, 7, 7),
}
_DIGIT_SEGMENTS = {
    "0": "abcdef", "1": "bc", "2": "abdeg", "3": "abcdg", "4": "bcfg",
    "5": "acdfg", "6": "acdefg", "7": "abc", "8": "abcdefg", "9": "abcdfg",
}  # fmt: skip

# Bar charts: four bars, heights 1..BAR_MAX in units of BAR_UNIT px above the baseline row BAR_BASE.
BAR_UNIT, BAR_BASE, BAR_MAX, BAR_WIDTH = 11, 78, 6, 12
BAR_X0 = (16, 33, 50, 67)

SPLITS = ("train", "validation", "test")
#: train: in-domain items in all; validation and test: items per family.
DEFAULT_SIZES = {"train": 2000, "validation": 64, "test": 200}
LETTERS = ALL_LETTERS[:4]  # the suite's multiple-choice questions have four options


# ----------------------------------------------------------------------------------------- rendering


def label_size(text: str) -> tuple[int, int]:
    """Pixel size (w, h) of a seven-segment label."""
    return len(text) * DIGIT_W + (len(text) - 1) * DIGIT_GAP, DIGIT_H


def _draw_label(draw: ImageDraw.ImageDraw, text: str, x: int, y: int) -> None:
    for i, ch in enumerate(text):
        cx = x + i * (DIGIT_W + DIGIT_GAP)
        for seg in _DIGIT_SEGMENTS[ch]:
            x0, y0, x1, y1 = _SEGMENT_BOXES[seg]
            draw.rectangle((cx + x0, y + y0, cx + x1 - 1, y + y1 - 1), fill=INK)


def _shape_points(shape: str, x: int, y: int, r: int) -> list[tuple[float, float]] | None:
    """Outline of a small object centred at (x, y) with size r; None for a circle."""
    if shape == "square":
        return [(x - r, y - r), (x + r, y - r), (x + r, y + r), (x - r, y + r)]
    if shape == "triangle":  # equilateral, pointing up, centroid at (x, y), circumradius 1.2 r
        big = 1.2 * r
        return [
            (x + big * math.cos(a), y + big * math.sin(a))
            for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)
        ]
    return None


def render(scene: Mapping[str, Any]) -> Image.Image:
    """Draw a scene description (``spec["scene"]``) as an RGB image; a pure function of ``scene``."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), WHITE)
    draw = ImageDraw.Draw(img)
    kind = scene["type"]
    if kind == "figure":
        pts = [tuple(p) for p in scene["vertices"]]
        draw.polygon(pts, fill=COLOURS[scene["fill"]], outline=INK, width=2)
        for lab in scene["labels"]:
            _draw_label(draw, lab["text"], lab["x"], lab["y"])
    elif kind == "objects":
        for ob in scene["objects"]:
            x, y, r, fill = ob["x"], ob["y"], ob["r"], COLOURS[ob["colour"]]
            pts = _shape_points(ob["shape"], x, y, r)
            if pts is None:
                draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
            else:
                draw.polygon(pts, fill=fill)
    elif kind == "bars":
        base, unit = scene["base"], scene["unit"]
        for k in range(1, BAR_MAX + 1):
            draw.line((12, base - k * unit, IMAGE_SIZE - 2, base - k * unit), fill=GRID)
        for k in (2, 4, 6):
            _draw_label(draw, str(k), 1, base - k * unit - DIGIT_H // 2)
        for bar in scene["bars"]:
            draw.rectangle(
                (bar["x0"], base - bar["height"] * unit, bar["x1"] - 1, base - 1), fill=COLOURS[bar["colour"]]
            )
        draw.rectangle((10, base - BAR_MAX * unit - 4, 11, base + 1), fill=INK)  # y axis
        draw.rectangle((10, base, IMAGE_SIZE - 2, base + 1), fill=INK)  # x axis
    else:
        raise ValueError(f"unknown scene type {kind!r}")
    return img


# ------------------------------------------------------------------------------------ scene geometry


def _seg_dist(p: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    ax, ay, bx, by, px, py = *a, *b, *p
    dx, dy = bx - ax, by - ay
    t = max(0.0, min(1.0, ((px - ax) * dx + (py - ay) * dy) / (dx * dx + dy * dy)))
    return math.hypot(px - ax - t * dx, py - ay - t * dy)


def _inside_convex(p: tuple[float, float], poly: list[tuple[float, float]]) -> bool:
    signs = set()
    for (ax, ay), (bx, by) in zip(poly, poly[1:] + poly[:1], strict=True):
        cross = (bx - ax) * (p[1] - ay) - (by - ay) * (p[0] - ax)
        signs.add(cross > 0)
    return len(signs) == 1


def _place_labels(
    poly: list[tuple[int, int]], labels: list[tuple[str, float, float]]
) -> list[dict[str, Any]] | None:
    """Turn (text, centre x, centre y) into label boxes, or None if one would touch the figure,
    another label or the border. A label whose centre lies outside the convex figure at a distance
    of at least its half-diagonal (+2 px for the outline) from every edge cannot touch the figure."""
    placed: list[dict[str, Any]] = []
    edges = list(zip(poly, poly[1:] + poly[:1], strict=True))
    for text, cx, cy in labels:
        w, h = label_size(text)
        x, y = round(cx - w / 2), round(cy - h / 2)
        if x < 1 or y < 1 or x + w > IMAGE_SIZE - 1 or y + h > IMAGE_SIZE - 1:
            return None
        centre = (x + w / 2, y + h / 2)
        if (
            _inside_convex(centre, poly)
            or min(_seg_dist(centre, a, b) for a, b in edges) < math.hypot(w, h) / 2 + 2
        ):
            return None
        for other in placed:
            ow, oh = label_size(other["text"])
            if (
                x < other["x"] + ow + 2
                and other["x"] < x + w + 2
                and y < other["y"] + oh + 2
                and other["y"] < y + h + 2
            ):
                return None
        placed.append({"text": text, "x": x, "y": y})
    return placed


def _fit(rng: random.Random, shape: list[tuple[float, float]], size: float) -> list[tuple[int, int]]:
    """Randomly rotate/reflect a polygon, scale its bounding box to ``size`` px, centre it (+-3 px)."""
    t = rng.uniform(0, 2 * math.pi)
    flip = rng.choice((1, -1))
    pts = [
        (x * math.cos(t) - flip * y * math.sin(t), x * math.sin(t) + flip * y * math.cos(t)) for x, y in shape
    ]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    s = size / max(max(xs) - min(xs), max(ys) - min(ys))
    ox = IMAGE_SIZE / 2 + rng.randint(-3, 3) - s * (max(xs) + min(xs)) / 2
    oy = IMAGE_SIZE / 2 + rng.randint(-3, 3) - s * (max(ys) + min(ys)) / 2
    return [(round(ox + s * x), round(oy + s * y)) for x, y in pts]


def _labelled_triangle(
    rng: random.Random, shape: list[tuple[float, float]], labels_at: Callable[[list[tuple[int, int]]], list]
) -> tuple[list[tuple[int, int]], list[dict[str, Any]]]:
    """Place a triangle and its labels, retrying rotations (and shrinking) until the labels fit."""
    for attempt in range(400):
        poly = _fit(rng, shape, 50 - attempt // 40 * 2)
        placed = _place_labels(poly, labels_at(poly))
        if placed is not None:
            return poly, placed
    raise RuntimeError("could not place labels")  # pragma: no cover - never seen over 10^5 draws


def _scatter(rng: random.Random, sizes: list[int], gap: int) -> list[tuple[int, int]]:
    """Centres for objects of the given sizes, inside the canvas and ``gap`` px apart (edge to edge)."""
    while True:
        centres: list[tuple[int, int]] = []
        for r in sizes:
            m = math.ceil(1.2 * r) + 2
            for _ in range(200):
                c = (rng.randint(m, IMAGE_SIZE - 1 - m), rng.randint(m, IMAGE_SIZE - 1 - m))
                if all(
                    math.dist(c, o) >= 1.2 * (r + ro) + gap for o, ro in zip(centres, sizes, strict=False)
                ):
                    centres.append(c)
                    break
            else:
                break
        if len(centres) == len(sizes):
            return centres


# ----------------------------------------------------------------------------------------- families


@dataclass
class Item:
    """One generated question. ``image`` is None until the family's ``make`` renders ``spec["scene"]``."""

    problem: str
    answer: str
    spec: dict[str, Any]
    choices: list[str] | None = None
    image: Image.Image | None = None


@dataclass(frozen=True)
class Family:
    """A question family: ``sample`` draws text, answer and spec; ``make`` also renders the image."""

    name: str
    role: Role
    answer_type: AnswerType
    sample: Callable[[random.Random], Item]
    chance: float  # E_text[max_a P(a | text)]: the best text-only accuracy, by construction
    description: str = ""

    def make(self, rng: random.Random) -> Item:
        item = self.sample(rng)
        item.image = render(item.spec["scene"])
        return item


def _q(text: str) -> str:
    return "<image>" + text


# In-domain: Geometry3K-like questions about one drawn figure. Four kinds, equally likely.
_PERIMETERS = range(6, 19)  # triangle sides 2..6, strict triangle inequality
_MISSING = range(20, 141, 10)  # unlabelled angle; the two labelled ones are 20..90
_GEOMETRY_KINDS = {"sides": 4, "angle_sum": 4, "perimeter": len(_PERIMETERS), "missing_angle": len(_MISSING)}


def _sample_geometry(rng: random.Random) -> Item:
    kind = rng.choice(list(_GEOMETRY_KINDS))
    fill = rng.choice(list(COLOURS))
    if kind in ("sides", "angle_sum"):
        n = rng.randint(3, 6)
        r = rng.randint(24, 34)
        t0 = rng.uniform(0, 2 * math.pi)
        cx, cy = IMAGE_SIZE / 2 + rng.randint(-5, 5), IMAGE_SIZE / 2 + rng.randint(-5, 5)
        verts = []
        for i in range(n):
            t = t0 + 2 * math.pi * i / n + rng.uniform(-0.15, 0.15) * math.pi / n
            rr = r * rng.uniform(0.88, 1.0)
            verts.append([round(cx + rr * math.cos(t)), round(cy + rr * math.sin(t))])
        scene = {"type": "figure", "vertices": verts, "fill": fill, "labels": []}
        if kind == "sides":
            return Item(
                _q("How many sides does the shape have?"), str(n), {"scene": scene, "ask": {"kind": kind}}
            )
        return Item(
            _q("What is the sum of the interior angles of the shape in degrees?"),
            str((n - 2) * 180),
            {"scene": scene, "ask": {"kind": kind}},
        )
    if kind == "perimeter":
        p = rng.choice(_PERIMETERS)
        triples = [
            (a, b, p - a - b)
            for a in range(2, 7)
            for b in range(2, 7)
            if 2 <= p - a - b <= 6 and 2 * max(a, b, p - a - b) < p
        ]
        sides = rng.choice(triples)  # side i joins vertex i and vertex i + 1
        a, b, c = sides
        # vertex 0 at the origin, vertex 1 at (a, 0), vertex 2 where |v1 v2| = b and |v2 v0| = c
        x2 = (a * a + c * c - b * b) / (2 * a)
        shape = [(0.0, 0.0), (float(a), 0.0), (x2, math.sqrt(max(c * c - x2 * x2, 0.0)))]

        def side_labels(poly: list[tuple[int, int]]) -> list[tuple[str, float, float]]:
            gx, gy = sum(p[0] for p in poly) / 3, sum(p[1] for p in poly) / 3
            out = []
            for i, s in enumerate(sides):
                (ax, ay), (bx, by) = poly[i], poly[(i + 1) % 3]
                mx, my = (ax + bx) / 2, (ay + by) / 2
                nx, ny = by - ay, ax - bx
                if nx * (mx - gx) + ny * (my - gy) < 0:  # make the normal point outwards
                    nx, ny = -nx, -ny
                k = 10 / math.hypot(nx, ny)
                out.append((str(s), mx + k * nx, my + k * ny))
            return out

        poly, labels = _labelled_triangle(rng, shape, side_labels)
        for i, lab in enumerate(labels):
            lab["side"] = [i, (i + 1) % 3]
        scene = {"type": "figure", "vertices": [list(v) for v in poly], "fill": fill, "labels": labels}
        return Item(
            _q("What is the perimeter of the triangle?"), str(p), {"scene": scene, "ask": {"kind": kind}}
        )
    # missing_angle: labelled angles at vertices 0 and 1, vertex 2 unlabelled
    c = rng.choice(_MISSING)
    a = rng.choice(range(max(20, 90 - c), min(90, 160 - c) + 1, 10))
    b = 180 - a - c
    ra, rb, rc = (math.radians(v) for v in (a, b, c))
    shape = [(0.0, 0.0), (math.sin(rc), 0.0), (math.sin(rb) * math.cos(ra), math.sin(rb) * math.sin(ra))]

    def angle_labels(poly: list[tuple[int, int]]) -> list[tuple[str, float, float]]:
        out = []
        for i, value in ((0, a), (1, b)):
            vx, vy = poly[i]
            ux = uy = 0.0
            for j in (1, 2):
                ox, oy = poly[(i + j) % 3]
                d = math.hypot(ox - vx, oy - vy)
                ux, uy = ux + (ox - vx) / d, uy + (oy - vy) / d
            d = math.hypot(ux, uy)
            out.append((str(value), vx - 13 * ux / d, vy - 13 * uy / d))  # outside, on the external bisector
        return out

    poly, labels = _labelled_triangle(rng, shape, angle_labels)
    for i, lab in enumerate(labels):
        lab["vertex"] = i
    scene = {"type": "figure", "vertices": [list(v) for v in poly], "fill": fill, "labels": labels}
    return Item(
        _q("Two angles of the triangle are labelled. What is the third angle in degrees?"),
        str(c),
        {"scene": scene, "ask": {"kind": kind}},
    )


def _object(shape: str, colour: str, r: int) -> dict[str, Any]:
    return {"shape": shape, "colour": colour, "r": r}


def _placed(rng: random.Random, objects: list[dict[str, Any]], gap: int) -> dict[str, Any]:
    rng.shuffle(objects)
    for ob, (x, y) in zip(objects, _scatter(rng, [o["r"] for o in objects], gap), strict=True):
        ob["x"], ob["y"] = x, y
    return {"type": "objects", "objects": objects}


def _plural(shape: str, n: int = 2) -> str:
    return shape if n == 1 else shape + "s"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _sample_counting(rng: random.Random) -> Item:
    target = rng.choice(SHAPES)
    n = rng.randint(1, 9)
    others = [s for s in SHAPES if s != target]
    objects = [_object(target, rng.choice(list(COLOURS)), 5) for _ in range(n)]
    objects += [_object(rng.choice(others), rng.choice(list(COLOURS)), 5) for _ in range(rng.randint(0, 3))]
    scene = _placed(rng, objects, gap=3)
    return Item(
        _q(f"How many {_plural(target)} are there in the image?"),
        str(n),
        {"scene": scene, "ask": {"kind": "count", "shape": target}},
    )


def _sample_bar_chart(rng: random.Random) -> Item:
    colours = rng.sample(list(COLOURS), 4)
    if rng.random() < 0.5:
        pos = rng.randint(1, 4)
        top = rng.randint(2, BAR_MAX)
        heights = [top if i == pos - 1 else rng.randint(1, top - 1) for i in range(4)]
        problem, answer, ask = (
            "Which bar is the tallest? Answer with its position from the left.",
            str(pos),
            {"kind": "tallest"},
        )
    else:
        heights = [rng.randint(1, BAR_MAX) for _ in range(4)]
        asked = rng.randrange(4)
        problem = f"What is the value of the {colours[asked]} bar?"
        answer, ask = str(heights[asked]), {"kind": "bar_value", "colour": colours[asked]}
    bars = [
        {"colour": c, "height": h, "x0": x0, "x1": x0 + BAR_WIDTH}
        for c, h, x0 in zip(colours, heights, BAR_X0, strict=True)
    ]
    scene = {"type": "bars", "bars": bars, "unit": BAR_UNIT, "base": BAR_BASE}
    return Item(_q(problem), answer, {"scene": scene, "ask": ask})


def _sample_compare(rng: random.Random) -> Item:
    shape = rng.choice(("circle", "square"))
    which = rng.choice(("bigger", "smaller"))
    answer = rng.choice(("left", "right"))
    small = rng.randint(6, 14)
    big = rng.randint(small + 3, 17)
    left_big = (answer == "left") == (which == "bigger")
    sizes = (big, small) if left_big else (small, big)
    objects = [
        {
            "shape": shape,
            "colour": rng.choice(list(COLOURS)),
            "r": r,
            "x": x + rng.randint(-2, 2),
            "y": 42 + rng.randint(-10, 10),
        }
        for r, x in zip(sizes, (21, 63), strict=True)
    ]
    scene = {"type": "objects", "objects": objects}
    return Item(
        _q(f"Which {shape} is {which}, the left one or the right one?"),
        answer,
        {"scene": scene, "ask": {"kind": "compare", "shape": shape, "which": which}},
    )


def _sample_colour_choice(rng: random.Random) -> Item:
    shapes = rng.sample(SHAPES, rng.randint(2, 3))
    target = shapes[0]
    options = rng.sample(list(COLOURS), 4)
    k = rng.randrange(4)
    colour = options[k]
    rest = rng.sample([c for c in COLOURS if c != colour], len(shapes) - 1)
    objects = [_object(s, c, rng.randint(8, 11)) for s, c in zip(shapes, [colour, *rest], strict=True)]
    scene = _placed(rng, objects, gap=6)
    lines = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(options))
    return Item(
        _q(f"What colour is the {target}?\n{lines}"),
        LETTERS[k],
        {"scene": scene, "ask": {"kind": "colour", "shape": target, "options": options}},
        choices=options,
    )


def _sample_pope(rng: random.Random) -> Item:
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    present = rng.random() < 0.5
    near_miss = rng.random() < 0.5  # POPE's adversarial negatives: an object sharing colour or shape
    n = rng.randint(2, 4)
    combos: list[tuple[str, str]] = [(colour, shape)] if present else []
    if near_miss:
        if rng.random() < 0.5:
            combos.append((colour, rng.choice([s for s in SHAPES if s != shape])))
        else:
            combos.append((rng.choice([c for c in COLOURS if c != colour]), shape))
    pool = [(c, s) for c in COLOURS for s in SHAPES if (c, s) != (colour, shape) and (c, s) not in combos]
    combos += rng.sample(pool, n - len(combos))
    objects = [_object(s, c, rng.randint(7, 10)) for c, s in combos]
    scene = _placed(rng, objects, gap=6)
    return Item(
        _q(f"Is there {_article(colour)} {colour} {shape} in the image?"),
        "yes" if present else "no",
        {"scene": scene, "ask": {"kind": "exists", "colour": colour, "shape": shape, "near_miss": near_miss}},
    )


FAMILIES: tuple[Family, ...] = (
    Family(
        "geometry", "in_domain", "number", _sample_geometry,
        chance=sum(1 / k for k in _GEOMETRY_KINDS.values()) / len(_GEOMETRY_KINDS),
        description="sides / interior-angle sum of a polygon, perimeter from labelled sides, third angle of a triangle",
    ),
    Family("counting", "ood", "number", _sample_counting, chance=1 / 9, description="count circles/squares/triangles (1-9) among distractors"),
    Family("bar_chart", "ood", "number", _sample_bar_chart, chance=(1 / 4 + 1 / BAR_MAX) / 2, description="tallest bar (1-4) or value of a coloured bar (1-6)"),
    Family("compare", "ood", "free", _sample_compare, chance=1 / 2, description="which of two shapes is bigger/smaller: left or right"),
    Family("colour_choice", "ood", "choice", _sample_colour_choice, chance=1 / 4, description="colour of a named shape, options A-D"),
    Family("pope", "general", "yesno", _sample_pope, chance=1 / 2, description="is there a <colour> <shape>? (balanced, half the scenes with a near miss)"),
)  # fmt: skip


def family(name: str) -> Family:
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise KeyError(f"no synthetic family {name!r}; have {[f.name for f in FAMILIES]}")
