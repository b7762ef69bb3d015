"""Which CPU kernel, our C one or torch's, runs each kernel family at each shape class.

The C kernels (``csrc/``) beat torch on the machine they were tuned on and lose on another: on an AVX2-only
Zen 3, MKL's float32 GEMM outruns the C linear kernel at prefill sizes. So the executor measures both at
start-up (``probe.py``) for each family and class of row counts, caches the table per machine
beside the kernel build, logs it once, and the layers ask it per call. ``--cpu-kernels`` forces a table
(tests, or a user who measured otherwise). This module is plain data: no torch, no layers.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

FAMILIES = ("linear", "decode_attention", "prefill_attention", "rms_norm", "silu_and_mul", "rotary")
CLASSES = ("1", "2-8", "9-32", "33+", "prefill")
WAYS = ("c", "torch")
# The rows each class is measured at. A call has as many rows as tokens: one per sequence in decode, so
# more rows than a decode batch holds (max_num_seqs defaults to 256) come from a prefill. Prefill attention is
# classed by its step's longest context instead (a prompt's cost grows with its length, whatever shares the step),
# then, where that chooses torch, by each request's own (``CpuAttention.prefill``), and measured on one prompt
# (``probe.PREFILL_ATTENTION_TOKENS``).
PROBE_ROWS = {"1": 1, "2-8": 4, "9-32": 16, "33+": 64, "prefill": 512}
PREFILL_ROWS = 257
_BOUNDS = ((1, "1"), (8, "2-8"), (32, "9-32"), (PREFILL_ROWS - 1, "33+"))


def shape_class(rows: int) -> str:
    for bound, name in _BOUNDS:
        if rows <= bound:
            return name
    return "prefill"


@dataclass(frozen=True)
class KernelChoice:
    """``table[family][class]`` is ``"c"`` or ``"torch"``; ``timings[family][class]`` the (C, torch) ms measured."""

    table: Mapping[str, Mapping[str, str]]
    source: str = "default"
    timings: Mapping[str, Mapping[str, tuple[float, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Per call the layers index a tuple by rows instead of classifying: ~270 lookups per decode step.
        fast = {f: tuple(self.table[f][shape_class(r)] == "c" for r in range(PREFILL_ROWS + 1)) for f in FAMILIES}
        object.__setattr__(self, "_fast", fast)

    @classmethod
    def uniform(cls, way: str, source: str = "default") -> KernelChoice:
        return cls({f: dict.fromkeys(CLASSES, way) for f in FAMILIES}, source)

    def use_c(self, family: str, rows: int) -> bool:
        """Whether the C kernel runs a call of ``rows`` (prefill attention: its longest context, or a request's)."""
        return self._fast[family][min(rows, PREFILL_ROWS)]

    def uses(self, family: str, way: str) -> bool:
        return way in self.table[family].values()

    def with_ways(self, ways: Mapping[tuple[str, str], str], source: str | None = None) -> KernelChoice:
        """This table with ``ways[(family, class)]`` put in."""
        table = {f: {c: ways.get((f, c), self.table[f][c]) for c in CLASSES} for f in FAMILIES}
        return KernelChoice(table, source or self.source, self.timings)

    def describe(self) -> str:
        """One log line: each family's way per class, in ``CLASSES`` order (``linear=c/c/c/c/torch ...``)."""
        return " ".join(f"{f}={'/'.join(self.table[f][c] for c in CLASSES)}" for f in FAMILIES)

    def to_json(self) -> str:
        timings = {f: {c: list(t) for c, t in row.items()} for f, row in self.timings.items()}
        return json.dumps({"table": self.table, "timings": timings}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> KernelChoice:
        data = json.loads(text)
        table = {f: {c: data["table"][f][c] for c in CLASSES} for f in FAMILIES}
        if any(way not in WAYS for row in table.values() for way in row.values()):
            raise ValueError("a kernel choice names a way other than c or torch")
        timings = {f: {c: tuple(t) for c, t in row.items()} for f, row in data.get("timings", {}).items()}
        return cls(table, source, timings)


ALL_C = KernelChoice.uniform("c")


def parse_override(text: str) -> dict[tuple[str, str], str]:
    """``--cpu-kernels``: ``auto`` (measure), or items joined by commas, later ones winning: ``c`` or ``torch`` (every
    entry) and ``family[:class]=c|torch`` (e.g. ``c,linear:prefill=torch``); entries no item names are measured."""
    text = text.strip().lower()
    if text == "auto":
        return {}
    ways: dict[tuple[str, str], str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item in WAYS:
            ways.update({(f, c): item for f in FAMILIES for c in CLASSES})
            continue
        target, _, way = item.partition("=")
        family, _, klass = target.partition(":")
        if way not in WAYS or family not in FAMILIES or (klass and klass not in CLASSES):
            raise ValueError(
                f"--cpu-kernels item {item!r}: expected family[:class]=c|torch with family one of {', '.join(FAMILIES)}"
                f" and class one of {', '.join(CLASSES)}, or c or torch for every entry (or the whole value auto)"
            )
        ways.update({(family, c): way for c in ([klass] if klass else CLASSES)})
    if not ways:
        raise ValueError("--cpu-kernels is empty: give auto, or c, torch and family[:class]=c|torch items")
    return ways


def covers_all(ways: Mapping[tuple[str, str], str]) -> bool:
    return len(ways) == len(FAMILIES) * len(CLASSES)


def cache_path(root: Path, parts: Iterable[object]) -> Path:
    """The cached table for this machine, kernel build, torch, dtype, threads and model shape (``parts``)."""
    key = hashlib.sha256(repr(tuple(parts)).encode()).hexdigest()[:16]
    return root / f"kernel-choice-{key}.json"


def load_cached(path: Path) -> KernelChoice | None:
    try:
        return KernelChoice.from_json(path.read_text(), source=f"cached in {path}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable, or not a table: measure again
        return None


def save(path: Path, choice: KernelChoice) -> None:
    """Written beside the target and renamed, so executors starting together never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        try:
            f.write(choice.to_json())
            f.flush()
        except OSError:  # a full disk: no half-written file left behind for every later start
            os.unlink(f.name)
            raise
    os.chmod(f.name, 0o644)  # readable by whoever shares the cache, as the kernel build is (not the temp file's 0600)
    os.replace(f.name, path)
