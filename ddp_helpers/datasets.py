"""Tiny, deterministic image datasets written to disk in ``torchvision.datasets.ImageFolder`` layout.

``make_image_folder`` draws one filled shape per image (class ``i`` has its own shape *and*
colour), on a dark, slightly noisy background, and writes small PNG files with the standard
library only (no torch, PIL or NumPy needed). The same arguments always give byte-identical
files, so notebooks can regenerate the data instead of downloading it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import tempfile
import zlib
from pathlib import Path

__all__ = ["SHAPES", "COLOURS", "class_names", "make_image_folder"]

SHAPES = ("square", "circle", "triangle", "cross", "ring", "diamond")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 210, 40),
    "magenta": (200, 50, 200),
    "cyan": (40, 200, 210),
}
_MARKER = ".make_image_folder.json"


def class_names(num_classes: int) -> list[str]:
    """Folder names of the classes, in the order ImageFolder sorts them (its label order)."""
    if not 1 <= num_classes <= len(SHAPES):
        raise ValueError(f"num_classes must be between 1 and {len(SHAPES)}, not {num_classes}")
    colours = list(COLOURS)
    return [f"{i:02d}_{colours[i]}_{SHAPES[i]}" for i in range(num_classes)]


def _inside(shape: str, x: float, y: float, cx: float, cy: float, r: float) -> bool:
    dx, dy = x - cx, y - cy
    if shape == "square":
        return abs(dx) <= r and abs(dy) <= r
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "triangle":  # apex up, base at cy + r
        return -r <= dy <= r and abs(dx) <= (dy + r) / 2
    if shape == "cross":
        w = r / 3
        return (abs(dx) <= w and abs(dy) <= r) or (abs(dy) <= w and abs(dx) <= r)
    if shape == "ring":
        d2 = dx * dx + dy * dy
        return (0.55 * r) ** 2 <= d2 <= r * r
    if shape == "diamond":
        return abs(dx) + abs(dy) <= r
    raise ValueError(f"unknown shape {shape!r}")


def _draw(shape: str, colour: tuple[int, int, int], size: int, rng: random.Random) -> bytes:
    """One RGB image as raw rows, each prefixed with PNG filter byte 0."""
    r = rng.uniform(0.28, 0.40) * size
    cx = rng.uniform(r, size - r)
    cy = rng.uniform(r, size - r)
    rows = bytearray()
    for y in range(size):
        rows.append(0)
        for x in range(size):
            if _inside(shape, x + 0.5, y + 0.5, cx, cy, r):
                jitter = rng.randint(-20, 20)
                rows.extend(min(255, max(0, c + jitter)) for c in colour)
            else:
                g = rng.randint(10, 50)
                rows.extend((g, g, g))
    return bytes(rows)


def _png(raw: bytes, size: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def make_image_folder(
    root: str | os.PathLike,
    num_classes: int = 4,
    images_per_class: int = 16,
    size: int = 16,
    seed: int = 0,
    val_fraction: float = 0.0,
) -> Path:
    """Write a small shapes-and-colours image dataset under ``root`` and return ``root`` as a Path.

    Layout (what ``torchvision.datasets.ImageFolder`` expects)::

        root/<class>/<class>_000.png          when val_fraction == 0
        root/train/<class>/... and root/val/<class>/...   when 0 < val_fraction < 1

    Class ``i`` (label ``i``, folder ``class_names(num_classes)[i]``) is a filled shape of its own
    kind and colour at a random position and size. Files depend only on the arguments, so calling
    again with the same arguments is cheap (nothing is rewritten); other arguments replace the folder.
    """
    if isinstance(images_per_class, bool) or not isinstance(images_per_class, int) or images_per_class < 1:
        raise ValueError(f"images_per_class must be a positive whole number, not {images_per_class!r}")
    if isinstance(size, bool) or not isinstance(size, int) or not 4 <= size <= 512:
        raise ValueError(f"size must be a whole number of pixels from 4 to 512, not {size!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), not {val_fraction!r}")
    n_val = round(images_per_class * val_fraction)
    if val_fraction > 0 and not 0 < n_val < images_per_class:
        raise ValueError(
            f"val_fraction={val_fraction} leaves no train or no val image out of {images_per_class}"
        )
    names = class_names(num_classes)
    root = Path(root)
    settings = {
        "num_classes": num_classes,
        "images_per_class": images_per_class,
        "size": size,
        "seed": seed,
        "val_fraction": val_fraction,
        "version": 1,
    }
    if _written_with(root, settings):
        return root
    if root.exists() and not (root / _MARKER).exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} exists, is not empty, and was not written by make_image_folder")
    # Every argument is valid: build the new folder beside the old one, then swap, so that a bad call, an
    # interrupted cell or a crash never leaves a half-written or emptied dataset where a notebook looks.
    root.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{root.name}.new", dir=root.parent))
    try:
        for label, name in enumerate(names):
            shape = SHAPES[label]
            colour = COLOURS[name.split("_")[1]]
            rng = random.Random(f"{seed}-{label}")  # str seeds hash deterministically (not via hash())
            for i in range(images_per_class):
                split = "" if val_fraction == 0 else ("val" if i >= images_per_class - n_val else "train")
                folder = build / split / name if split else build / name
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{name}_{i:03d}.png").write_bytes(_png(_draw(shape, colour, size, rng), size))
        (build / _MARKER).write_text(json.dumps(settings))
        _swap_in(build, root, settings)
    finally:
        shutil.rmtree(build, ignore_errors=True)  # gone already when the swap succeeded
    return root


def _written_with(root: Path, settings: dict) -> bool:
    try:
        return json.loads((root / _MARKER).read_text()) == settings
    except (OSError, ValueError):
        return False


def _swap_in(build: Path, root: Path, settings: dict) -> None:
    """Put the finished folder ``build`` at ``root``, replacing an earlier make_image_folder folder there."""
    old = None
    if _written_with(root, settings):  # another process made the same folder meanwhile: keep theirs, which
        return  # it may be reading (moving it away, even to put the same files back, would pull it away)
    if root.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old", dir=root.parent))
        os.replace(root, old / "data")
    try:
        os.replace(build, root)
    except OSError:
        if _written_with(root, settings):  # another process made the same folder meanwhile: keep theirs
            pass
        elif old is not None and not root.exists():
            os.replace(old / "data", root)  # put the old folder back rather than lose it
            raise
        else:
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
