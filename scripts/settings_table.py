"""Print the README's settings table from app.settings.Settings (the one source of every setting):

  python scripts/settings_table.py            # the table, in Markdown
  python scripts/settings_table.py --write    # replace it in README.md, between its markers

tests/test_docs.py fails when README.md's table differs from this output."""
from __future__ import annotations

import sys
from pathlib import Path

from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.settings import ENV_PREFIX, Settings  # noqa: E402

BEGIN, END = "<!-- settings table: scripts/settings_table.py -->", "<!-- end of settings table -->"


def _default(field) -> str:
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    value = field.default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def table() -> str:
    rows = ["| flag / variable | default | what it does |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        text = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{flag}` `{ENV_PREFIX}{name.upper()}` | {_default(field)} | {text} |")
    return "\n".join(rows)


def readme_with_table(readme: str) -> str:
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        path = ROOT / "README.md"
        path.write_text(readme_with_table(path.read_text()))
    else:
        print(table())
