"""docs/benchmarks.md's headline: the table in the doc is the one drawn from docs/benchmarks-headline.json, which the
plot is drawn from too, and every figure in it comes from docs/benchmarks-history.md."""

from __future__ import annotations

from bench import plot_headline

DOCS = plot_headline.ROOT / "docs"


def test_the_doc_holds_the_table_the_json_draws():
    doc = (DOCS / "benchmarks.md").read_text()
    assert plot_headline.markdown_table(plot_headline.load()) in doc, "run python -m bench.plot_headline --table"


def test_one_row_per_target_at_most_twelve():
    assert 0 < len(plot_headline.load()) <= 12


def test_each_plotted_ratio_is_the_one_its_row_shows():
    for row in plot_headline.load():
        for bar in row["bars"]:
            assert f"{bar['ratio']:g}" in row["figure"], (bar["label"], row["figure"])
            assert ("†" in row["figure"]) >= bool(bar.get("computed")), bar["label"]


def test_each_commit_is_recorded_in_the_history():
    history = (DOCS / "benchmarks-history.md").read_text()
    for row in plot_headline.load():
        if row["commit"] != "–":
            for commit in row["commit"].split("; "):
                assert commit in history, commit


def test_the_plot_is_there():
    assert (DOCS / "img" / "headline.png").stat().st_size > 0
