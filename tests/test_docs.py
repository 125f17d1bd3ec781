"""The reference docs that are generated stay current."""
from __future__ import annotations

from pathlib import Path

from scripts.settings_table import readme_with_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_settings_table_is_generated_from_settings():
    readme = (ROOT / "README.md").read_text()
    assert readme_with_table(readme) == readme, "README's settings table is stale: python scripts/settings_table.py --write"
