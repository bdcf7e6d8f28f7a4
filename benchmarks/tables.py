"""The plain-text tables the benchmarks print: one format for `make bench`
(`benchmarks.run`) and the parts run on their own (`saves`, `mooncake_tier`),
in a module of its own so that none of them imports the runner back."""

from __future__ import annotations

from typing import Any


def table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns]
    lines = [title, "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(cell(r.get(c, "")).rjust(w) for c, w in zip(columns, widths, strict=True))
              for r in rows]
    return "\n".join(lines)
