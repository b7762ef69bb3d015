"""The headline of docs/benchmarks.md: its table and its plot, both drawn from docs/benchmarks-headline.json.

Each row of the JSON is one target: the workload, what nanoserve is measured against, the figure as
docs/benchmarks-history.md records it, the machine, the commit and the command. A row's ``bars`` are what the plot
shows: nanoserve / peer (for W5, the share of the time the simulated accelerator is busy), with the row's target
where it has one; ``computed`` marks a ratio worked out from the recorded figures, cut (not rounded) to three
digits. ``python -m bench.plot_headline --table`` prints the Markdown table that docs/benchmarks.md holds (a test
checks that they agree); ``python -m bench.plot_headline`` draws docs/img/headline.png (needs matplotlib: the
``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "benchmarks-headline.json"
IMAGE = ROOT / "docs" / "img" / "headline.png"
COLUMNS = ("workload", "nanoserve against", "figure", "machine", "commit", "command")
KEYS = ("workload", "against", "figure", "machine", "commit", "command")
# Bars near 1.0 against nanoserve itself (no " vs " in their label) and every busy share (W5: against an idle-free
# accelerator) go in a panel of their own, on a linear scale; ratios against other engines span 1x to 12x and take a
# log scale.
CLOSE_TO_ONE = (0.8, 1.2)


def load(path: Path = DATA) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(row[key] for key in KEYS) + " |")
    return "\n".join(lines) + "\n"


def bars(rows: list[dict]) -> list[dict]:
    return [bar for row in rows for bar in row["bars"]]


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = bars(rows)
    near = [b for b in every if b.get("efficiency")
            or CLOSE_TO_ONE[0] <= b["ratio"] <= CLOSE_TO_ONE[1] and " vs " not in b["label"]]
    far = [b for b in every if b not in near]
    fig, axes = plt.subplots(2, 1, figsize=(10, 7.5), height_ratios=[len(far), len(near)])
    _panel(axes[0], far, "nanoserve against other engines (nanoserve / peer, log scale)", log=True)
    _panel(axes[1], near, "nanoserve against itself; W5: the accelerator's busy share (1.0: it never waits)",
           log=False)
    fig.text(0.01, 0.005, "Green: target reached; red: not reached; blue: no target; black tick: the target. "
             "†: computed from the recorded figures. Commits and commands: docs/benchmarks.md.",
             fontsize=7.5, color="0.3")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _panel(ax, panel_bars: list[dict], title: str, log: bool) -> None:
    labels = [b["label"] + (" †" if b.get("computed") else "") for b in panel_bars]
    ratios = [b["ratio"] for b in panel_bars]
    positions = list(range(len(panel_bars)))[::-1]
    colours = [_colour(b) for b in panel_bars]
    ax.barh(positions, [r - 1 for r in ratios], left=1, color=colours, height=0.6)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(0.8, 20)
        ax.set_xticks([1, 2, 4, 8, 16], labels=["1x", "2x", "4x", "8x", "16x"])
    else:
        ax.set_xlim(min(0.85, min(ratios) - 0.05), 1.1)
    for y, b, r in zip(positions, panel_bars, ratios, strict=True):
        if "target" in b:
            ax.plot([b["target"]], [y], marker="|", markersize=16, markeredgewidth=2, color="black")
        text = f"{r:g}" if b.get("efficiency") else f"{r:g}x"
        ax.text(max(r, 1.0) * 1.02 if log else max(r, 1.0) + 0.003, y, text, va="center", fontsize=9)
    ax.axvline(1.0, color="0.2", linestyle="--", linewidth=1)
    ax.set_yticks(positions, labels=labels, fontsize=9)
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", color="0.9")
    ax.set_axisbelow(True)


def _colour(bar: dict) -> str:
    if "target" not in bar:
        return "tab:blue"
    return "tab:green" if bar["ratio"] >= bar["target"] else "tab:red"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the headline's figures (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=IMAGE, help="the PNG to write (default: %(default)s)")
    parser.add_argument("--table", action="store_true", help="print the Markdown table instead of drawing")
    args = parser.parse_args(argv)
    rows = load(args.data)
    if args.table:
        print(markdown_table(rows), end="")
    else:
        plot(rows, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
