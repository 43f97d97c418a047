"""docs/releases.md, the release sweep's table (ci/sweep.sh), kept true: one row per
release the sweep covers, and every release the README names there with no failing
test. Plain file reading: no sglang import."""

from __future__ import annotations

import re

from helpers import ROOT

DOC = ROOT / "docs" / "releases.md"
RELEASE = re.compile(r"\b0\.\d+\.\d+(?:\.post\d+)?\b")


def key(version: str) -> tuple:
    release, _, post = version.partition(".post")
    return tuple(int(p) for p in release.split(".")) + (int(post) if post else -1,)


def rows() -> dict[str, list[str]]:
    """release -> its cells after the release, in the table's order (checked unique)."""
    table: dict[str, list[str]] = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| release |"):
            continue
        release, *cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert release not in table, f"two rows for {release}"
        table[release] = cells
    return table


def swept_releases() -> list[str]:
    """The sweep's releases: one requirements file each (ci/make-requirements.py writes
    one for every release from 0.4.10 on the registry; ci/sweep.sh builds from it)."""
    names = [p.name[len("sglang-"):-len(".txt")] for p in (ROOT / "ci" / "requirements").glob("sglang-*.txt")]
    return sorted(names, key=key)


def test_one_row_per_release_of_the_sweep_in_release_order():
    table = rows()
    assert list(table) == swept_releases()
    assert len(table) >= 45  # 0.4.10 .. 0.5.23, post releases included
    matrix = [v for entry in (ROOT / "ci" / "matrix").read_text().split() for v in [entry.split(":")[0]]
              if RELEASE.fullmatch(v)]  # VERSION or VERSION:engine
    assert matrix and set(matrix) <= set(table)


def test_each_row_is_not_run_or_complete():
    """A swept row has every cell, and its tests cell reads passed / failed / skipped
    (or says why none ran, or that a quick sweep ran none), its engine cell what the engine
    showed (or that the row was swept before that column); an unswept row says "not run"."""
    for release, cells in rows().items():
        assert len(cells) == 8, release
        if cells[0] == "not run":
            continue
        assert all(cells[i] for i in (0, 7)), release
        if not cells[0].startswith("not installed"):
            assert re.fullmatch(r"\d+ / \d+ / \d+|did not run \(rc \d+\)|not run \(quick sweep: .*\)", cells[4]), (
                release, cells[4])
            assert cells[5], release  # "none" or the first failure
            assert cells[6], release  # the engine's outcome, "not run", or swept before the column


def test_every_release_the_readme_names_has_a_row_and_no_failure_where_swept():
    """A release the README names (0.4.10 on) has a row, and where the sweep ran it, no
    test failed there: the README cannot claim a release the table contradicts. (Rows
    the sweep has not reached yet say "not run"; ci/sweep.sh fills them.)"""
    readme = (ROOT / "README.md").read_text()
    named = sorted({v for v in RELEASE.findall(readme) if key(v) >= (0, 4, 10, -1)}, key=key)
    assert named, "the README names no release"
    table = rows()
    for release in named:
        assert release in table, f"README names sglang {release}, docs/releases.md has no row"
        cells = table[release]
        if cells[0] == "not run" or cells[4].startswith("not run (quick sweep"):
            continue
        counts = re.fullmatch(r"(\d+) / (\d+) / (\d+)", cells[4])
        assert counts and int(counts.group(2)) == 0, f"sglang {release}: {cells[4]}; {cells[5]}"
        assert "failed: " not in cells[6], f"sglang {release}'s engine: {cells[6]}"
