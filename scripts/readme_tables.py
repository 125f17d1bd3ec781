"""Print the README's generated reference tables: settings from app.settings.Settings (the one source of
every setting) and metrics from app.metrics.Metrics (the one registry every process writes):

  python scripts/readme_tables.py            # both tables, in Markdown
  python scripts/readme_tables.py --write    # replace them in README.md, between their markers

tests/test_docs.py fails when README.md's tables differ from this output."""
from __future__ import annotations

import sys
from pathlib import Path

from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.metrics import Metrics  # noqa: E402
from app.settings import ENV_PREFIX, Settings, shown_default  # noqa: E402


def _default(field) -> str:
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    return f"`{shown_default(field.default)}`"


def settings_table() -> str:
    rows = ["| flag / variable | default | what it does |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        text = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{flag}` `{ENV_PREFIX}{name.upper()}` | {_default(field)} | {text} |")
    return "\n".join(rows)


def metrics_table() -> str:
    """Every metric of a fresh Metrics, with the labels its samples carry once each way of recording
    has been used once."""
    metrics = Metrics()
    metrics.model_loaded("tiny", "fp32", "CPUExecutionProvider")
    metrics.serve_endpoints(["/embed"])
    metrics.request_answered("/embed", 500, 0.01, {"error_type": "internal_error"})
    metrics.observe_link(0.0, 0.0, 0.0)
    rows = ["| metric | type | labels | what it counts |", "| --- | --- | --- | --- |"]
    for family in metrics.registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels} - {"le"})
        name = family.name + ("_total" if family.type == "counter" else "")
        text = family.documentation.replace("|", "\\|")
        rows.append(f"| `{name}` | {family.type} | {', '.join(f'`{k}`' for k in labels)} | {text} |")
    return "\n".join(rows)


TABLES = {"settings": settings_table, "metrics": metrics_table}


def _markers(kind: str) -> tuple[str, str]:
    return f"<!-- {kind} table: scripts/readme_tables.py -->", f"<!-- end of {kind} table -->"


def readme_with_tables(readme: str) -> str:
    for kind, make in TABLES.items():
        begin, end = _markers(kind)
        head, found, rest = readme.partition(begin)
        if not found:
            raise ValueError(f"README.md has no {begin} marker")
        _, _, tail = rest.partition(end)
        readme = f"{head}{begin}\n{make()}\n{end}{tail}"
    return readme


if __name__ == "__main__":
    if "--write" in sys.argv:
        path = ROOT / "README.md"
        path.write_text(readme_with_tables(path.read_text()))
    else:
        print("\n\n".join(make() for make in TABLES.values()))
