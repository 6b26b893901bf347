"""A benchmark's results as the project keeps them: the markdown report at `out`, the JSON of
everything measured beside it, and the report printed."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: Path, report: str, data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    print(report)
