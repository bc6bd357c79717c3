from pathlib import Path

from nova.capture.coverage import render


def test_ops_md_is_current():
    committed = (Path(__file__).parents[1] / "docs" / "ops.md").read_text()
    assert committed == render(), "regenerate: python -m nova.capture.coverage > docs/ops.md"
