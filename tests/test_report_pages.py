"""The figures on README.md and docs/results.md that `infer.report_pages` writes are the ones
their results files give: a page edited by hand, or a results file changed without running
`python -m infer.report_pages`, fails here. Reads JSON only (no JAX)."""

import re

import pytest

from infer import report_pages


def test_every_generated_block_matches_its_files():
    assert report_pages.stale() == [], "run python -m infer.report_pages"


def test_a_figure_changed_by_hand_is_caught():
    text = (report_pages.ROOT / "README.md").read_text()
    block = re.search(r"<!-- report_pages:results -->.*?<!-- /report_pages:results -->", text, re.S)
    figure = re.search(r"\d\.\d\d×", block.group(0)).group(0)  # the first speed-up figure
    edited = text[: block.start()] + block.group(0).replace(figure, "9.99×") + text[block.end() :]
    assert edited != text
    assert report_pages.render("README.md", edited) == text  # written back from the file


def test_rows_name_files_that_exist_and_known_machines():
    for row in report_pages.RESULTS_ROWS:
        assert row.machine in report_pages.MACHINES, row.measurement
        for name in row.files:
            assert (report_pages.RESULTS / name).is_file(), name
        assert row.figure()  # computes from its files


def test_a_page_without_its_block_is_refused():
    with pytest.raises(ValueError, match="report_pages:"):
        report_pages.render("README.md", "no blocks here")
