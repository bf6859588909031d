"""The fault x point -> outcome table of the documentation, rendered from what ``make faults``
wrote (``docs/operations/data/faults.json``): nothing in it is typed by hand."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "docs" / "operations" / "data" / "faults.json"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(path: Path = DATA) -> str:
    """The table as Markdown, or a note saying how to produce it."""
    if not path.exists():
        return "*No results published yet: `make faults` writes them.*\n"
    doc = json.loads(path.read_text())
    lines = [
        f"Measured by `make faults` ({doc['form']} form) at commit `{doc['commit']}` on "
        f"{doc['date'][:10]}, {doc['machine']}.",
        "",
        "| fault | point | outcome | attempts | what the run said |",
        "|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        said = row["line"] or "; ".join(row.get("retried") or []) or "-"
        lines.append(
            f"| {row['fault']} | `{row['point']}` | {_cell(row['outcome'])} | {row['attempts']} "
            f"| {_cell(said)[:300]} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render())
