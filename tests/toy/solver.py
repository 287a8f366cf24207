"""An independent solver for the synthetic suite, used only by tests.

It shares no code with ``ncgrpo.toy.synthetic``: it answers each question from the scene
description (``spec``) with its own arithmetic, and it checks the spec against the rendered pixels
with its own palette, its own seven-segment reader and its own object finder. A bug in the
generator's answer code or renderer therefore shows up as a disagreement here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import ndimage

PALETTE = {
    "red": (220, 38, 38),
    "green": (22, 163, 74),
    "blue": (37, 99, 235),
    "yellow": (234, 179, 8),
    "purple": (147, 51, 234),
    "orange": (249, 115, 22),
}
WHITE = (255, 255, 255)
BLACK = (0, 0, 0)

# Seven-segment reading: a 7 x 12 cell, cells 9 px apart. One probe pixel per segment, each inside
# that segment only, and two probes in the holes that must stay blank.
CELL_PITCH = 9
PROBES = {"a": (3, 0), "b": (6, 3), "c": (6, 8), "d": (3, 11), "e": (0, 8), "f": (0, 3), "g": (3, 5)}
HOLES = ((3, 3), (3, 8))
DIGITS = {
    "abcdef": "0", "bc": "1", "abdeg": "2", "abcdg": "3", "bcfg": "4",
    "acdfg": "5", "acdefg": "6", "abc": "7", "abcdefg": "8", "abcdfg": "9",
}  # fmt: skip


def solve(spec: dict[str, Any]) -> str:
    """The answer, computed from the scene description alone."""
    scene, ask = spec["scene"], spec["ask"]
    kind = ask["kind"]
    if kind == "sides":
        return str(len(scene["vertices"]))
    if kind == "angle_sum":
        return str(180 * (len(scene["vertices"]) - 2))
    if kind == "perimeter":
        return str(sum(int(lab["text"]) for lab in scene["labels"]))
    if kind == "missing_angle":
        return str(180 - sum(int(lab["text"]) for lab in scene["labels"]))
    if kind == "count":
        return str(sum(ob["shape"] == ask["shape"] for ob in scene["objects"]))
    if kind == "tallest":
        heights = [bar["height"] for bar in scene["bars"]]
        assert heights.count(max(heights)) == 1, "tallest bar must be unique"
        return str(heights.index(max(heights)) + 1)
    if kind == "bar_value":
        (height,) = [bar["height"] for bar in scene["bars"] if bar["colour"] == ask["colour"]]
        return str(height)
    if kind == "compare":
        left, right = sorted(scene["objects"], key=lambda ob: ob["x"])
        assert left["r"] != right["r"]
        bigger = "left" if left["r"] > right["r"] else "right"
        smaller = "right" if bigger == "left" else "left"
        return bigger if ask["which"] == "bigger" else smaller
    if kind == "colour":
        (colour,) = [ob["colour"] for ob in scene["objects"] if ob["shape"] == ask["shape"]]
        return "ABCD"[ask["options"].index(colour)]
    if kind == "exists":
        hit = any(ob["colour"] == ask["colour"] and ob["shape"] == ask["shape"] for ob in scene["objects"])
        return "yes" if hit else "no"
    raise ValueError(f"unknown ask kind {kind!r}")


# ----------------------------------------------------------------------------- image checks


def _px(arr: np.ndarray, x: float, y: float) -> tuple[int, ...]:
    return tuple(int(v) for v in arr[int(round(y)), int(round(x))])


def read_number(arr: np.ndarray, x: int, y: int, cells: int) -> str:
    """Read ``cells`` seven-segment digits whose first cell's top-left corner is (x, y)."""
    out = ""
    for _ in range(cells):
        lit = "".join(s for s, (dx, dy) in PROBES.items() if _px(arr, x + dx, y + dy) == BLACK)
        assert all(_px(arr, x + dx, y + dy) == WHITE for dx, dy in HOLES), f"blotted digit at {(x, y)}"
        out += DIGITS.get(lit, "?")
        x += CELL_PITCH
    return out


def find_objects(arr: np.ndarray) -> list[tuple[str, str, float, float, int]]:
    """Coloured blobs as (shape, colour, centre x, centre y, width); the shape from how much of its
    bounding box a blob fills (square 1, circle pi/4, triangle 1/2)."""
    mask = (arr != 255).any(axis=-1)
    labels, n = ndimage.label(mask)
    found = []
    for idx, sl in enumerate(ndimage.find_objects(labels), start=1):
        blob = labels[sl] == idx
        ys, xs = np.nonzero(blob)
        colour = tuple(int(v) for v in arr[sl][ys[0], xs[0]])
        (name,) = [k for k, v in PALETTE.items() if v == colour]
        fill = blob.sum() / blob.size
        shape = "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"
        found.append(
            (
                shape,
                name,
                sl[1].start + (blob.shape[1] - 1) / 2,
                sl[0].start + (blob.shape[0] - 1) / 2,
                blob.shape[1],
            )
        )
    return found


def _angle(p: list[int], q: list[int], r: list[int]) -> float:
    """Interior angle at p of triangle p q r, in degrees."""
    a = math.atan2(q[1] - p[1], q[0] - p[0]) - math.atan2(r[1] - p[1], r[0] - p[0])
    return abs((math.degrees(a) + 180) % 360 - 180)


def check_image(image: Any, spec: dict[str, Any]) -> None:
    """Assert that the rendered image shows what the spec says."""
    arr = np.asarray(image.convert("RGB"))
    scene, ask = spec["scene"], spec["ask"]
    if scene["type"] == "figure":
        verts = scene["vertices"]
        cx, cy = sum(v[0] for v in verts) / len(verts), sum(v[1] for v in verts) / len(verts)
        assert _px(arr, cx, cy) == PALETTE[scene["fill"]], "figure fill at its centroid"
        for lab in scene["labels"]:
            assert read_number(arr, lab["x"], lab["y"], len(lab["text"])) == lab["text"], f"label {lab}"
        # the figure is drawn to scale: labelled sides and angles agree with the vertices
        if ask["kind"] == "perimeter":
            lengths = [math.dist(verts[i], verts[j]) for i, j in (lab["side"] for lab in scene["labels"])]
            values = [int(lab["text"]) for lab in scene["labels"]]
            k = sum(lengths) / sum(values)
            assert all(abs(ln - k * v) <= 1.5 for ln, v in zip(lengths, values, strict=True)), (
                lengths,
                values,
            )
        if ask["kind"] == "missing_angle":
            for lab in scene["labels"]:
                i = lab["vertex"]
                drawn = _angle(verts[i], verts[(i + 1) % 3], verts[(i + 2) % 3])
                assert abs(drawn - int(lab["text"])) <= 5, (drawn, lab)
    elif scene["type"] == "objects":
        found = sorted((s, c) for s, c, *_ in find_objects(arr))
        assert found == sorted((ob["shape"], ob["colour"]) for ob in scene["objects"]), found
        for ob in scene["objects"]:
            assert _px(arr, ob["x"], ob["y"]) == PALETTE[ob["colour"]], f"object centre {ob}"
        if ask["kind"] == "compare":  # measured widths give the same answer as the spec
            (_, _, lx, _, lw), (_, _, rx, _, rw) = sorted(find_objects(arr), key=lambda f: f[2])
            assert lw != rw
            bigger = "left" if lw > rw else "right"
            assert (
                bigger if ask["which"] == "bigger" else {"left": "right", "right": "left"}[bigger]
            ) == solve(spec)
    elif scene["type"] == "bars":
        base, unit = scene["base"], scene["unit"]
        for k in (2, 4, 6):
            assert read_number(arr, 1, base - k * unit - 6, 1) == str(k), f"tick {k}"
        for bar in scene["bars"]:
            x = (bar["x0"] + bar["x1"] - 1) / 2
            colour = PALETTE[bar["colour"]]
            assert _px(arr, x, base - (bar["height"] - 0.5) * unit) == colour, f"bar below its top {bar}"
            assert _px(arr, x, base - (bar["height"] + 0.5) * unit) != colour, f"bar above its top {bar}"
    else:
        raise ValueError(scene["type"])
