"""The fixed-width text tables of the patch report, the coverage table and the plan's
description."""
from __future__ import annotations

from typing import List, Optional

__all__ = ["format_table"]


def format_table(headers: List[str], rows: List[List[str]], align: Optional[str] = None) -> str:
    """Fixed-width text table (``align``: one ``l``/``r`` per column)."""
    align = align or "l" * len(headers)
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]

    def fmt(cells):
        out = []
        for c, w, a in zip(cells, widths, align):
            c = str(c)
            out.append(c.rjust(w) if a == "r" else c.ljust(w))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(headers), sep] + [fmt(r) for r in rows])
