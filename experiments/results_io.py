"""CSV in and out for the experiment scripts (``--replot`` redraws from the CSV)."""

from __future__ import annotations

import csv
import pathlib


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    """Rows with possibly different keys: the header is their union, gaps are 0."""
    fields = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval=0)
        w.writeheader()
        w.writerows(rows)


def read_csv(path: pathlib.Path) -> list[dict]:
    """Rows written by :func:`write_csv`, numbers as numbers."""

    def num(v: str):
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v

    with path.open() as f:
        return [{k: num(v) for k, v in row.items()} for row in csv.DictReader(f)]
