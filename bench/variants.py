"""One results file per bench: ``bench/results/<bench>.json`` holds every named run ("variant") of
that bench, ``{"latest": name, "variants": {name: report}}``. A run writes its own variant (with
the date and the command that made it) and keeps the others; running a variant again replaces it."""

from __future__ import annotations

import datetime
import json
import shlex
from pathlib import Path


def write_variant(path: Path, name: str, report: dict, module: str, argv: list[str]) -> dict:
    """Merge ``report`` into the results file ``path`` as variant ``name``; ``module`` and ``argv``
    (e.g. "bench.swap_core", its arguments) say how it was made. Returns the variant as written."""
    path = Path(path)
    done = json.loads(path.read_text()) if path.exists() else {}
    variants = done.get("variants", {})
    variants[name] = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python3", "-m", module, *argv]),
        **report,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"latest": name, "variants": variants}, indent=1))
    return variants[name]
