"""The reference docs that are generated stay current."""
from __future__ import annotations

from pathlib import Path

from scripts.readme_tables import readme_with_tables

ROOT = Path(__file__).resolve().parents[1]


def test_readme_settings_and_metrics_tables_are_generated_from_the_code():
    readme = (ROOT / "README.md").read_text()
    assert readme_with_tables(readme) == readme, "README's tables are stale: python scripts/readme_tables.py --write"
