"""benchmarks/run_all.py: each benchmark's table goes into its page under docs/benchmarks,
between its markers, and a page that cannot take it stops the script before anything runs."""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import run_all

SCRIPT = Path(run_all.__file__).resolve()
PAGES = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )


def test_the_script_writes_into_the_benchmark_pages():
    assert run_all.PAGES == PAGES


@pytest.mark.parametrize("key", sorted(run_all.BLOCKS))
def test_every_benchmark_has_a_page_holding_its_block_once(key):
    name = run_all.BLOCKS[key]
    page = PAGES / f"{name}.md"
    assert page.is_file(), f"{page} is missing"
    assert run_all.block_problem(page.read_text(), name) is None


def test_the_index_links_every_benchmark_page():
    index = (PAGES / "index.md").read_text()
    for page in PAGES.glob("*.md"):
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"index.md does not link {page.name}"


def test_a_block_is_replaced_and_the_prose_around_it_kept():
    page = (
        "# Title\n\nBefore.\n\n<!-- generated:x -->\nold table\n<!-- /generated:x -->\n\n"
        "After, with <!-- generated:y --> another block's marker.\n"
    )
    once = run_all.replace_block(page, "x", "new table\n\n| a |")
    assert once == page.replace("old table", "new table\n\n| a |")
    assert run_all.replace_block(once, "x", "new table\n\n| a |") == once


@pytest.mark.parametrize(
    ("page", "problem"),
    [
        ("no block at all\n", "0 times and <!-- /generated:x --> 0 times"),
        ("<!-- generated:x -->\nonly the start\n", "1 times and <!-- /generated:x --> 0 times"),
        (
            "<!-- generated:x -->\n<!-- /generated:x -->\n<!-- generated:x -->\n",
            "2 times and <!-- /generated:x --> 1 times",
        ),
        ("<!-- /generated:x -->\n<!-- generated:x -->\n", "before <!-- generated:x -->"),
    ],
)
def test_a_page_without_its_block_once_is_refused_by_name(page, problem):
    with pytest.raises(ValueError, match="cannot write the table x") as caught:
        run_all.replace_block(page, "x", "table")
    assert problem in str(caught.value)


def test_a_missing_page_stops_the_script_before_any_benchmark_runs(tmp_path):
    (tmp_path / "fs-tier.md").write_text("# fs tier\n\nno block here\n")
    result = run_script("--only", "fs,serving", "--pages", str(tmp_path))
    assert result.returncode == 1
    assert "fs-tier.md holds <!-- generated:fs-tier --> 0 times" in result.stderr
    assert "serving-path.md: no such page (for --only serving)" in result.stderr
    assert "$ " not in result.stdout  # no benchmark was started
    assert (tmp_path / "fs-tier.md").read_text() == "# fs tier\n\nno block here\n"


def test_an_unknown_benchmark_name_is_refused(tmp_path):
    result = run_script("--only", "fs,nope", "--pages", str(tmp_path))
    assert result.returncode == 2
    assert "--only: no benchmark named nope" in result.stderr


@pytest.mark.slow
def test_a_quick_run_rewrites_the_table_of_its_page_only(tmp_path):
    pages, root = tmp_path / "pages", tmp_path / "root"
    pages.mkdir()
    root.mkdir()
    shutil.copy(PAGES / "fs-tier.md", pages / "fs-tier.md")
    before = (pages / "fs-tier.md").read_text()
    result = run_script("--only", "fs", "--quick", "--root", str(root), "--pages", str(pages))
    assert result.returncode == 0, result.stderr
    after = (pages / "fs-tier.md").read_text()
    start, end = run_all.markers("fs-tier")
    head, rest = after.split(start)
    table, tail = rest.split(end)
    assert head == before.split(start)[0]
    assert tail == before.split(end)[1]
    today = datetime.date.today().isoformat()
    assert f"| {today} |" in table
    assert "Command: `python benchmarks/fs_tier.py --root" in table
    assert "--rounds 1 --total-gib 0.5`" in table
    assert f"updated {pages / 'fs-tier.md'}" in result.stdout
