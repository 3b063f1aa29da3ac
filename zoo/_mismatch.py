"""One wording for "these files do not fit this model": every missing, unexpected and
mis-shaped entry listed, long lists cut."""

from __future__ import annotations


def shorten(items: list[str], limit: int = 20) -> str:
    """`items` joined by commas, the first `limit` of them and a count of the rest."""
    shown = ", ".join(items[:limit])
    return shown + (f", … and {len(items) - limit} more" if len(items) > limit else "")


def listed(items: list[str], limit: int = 20) -> list[str]:
    """One indented line per item, the first `limit` of them and a count of the rest."""
    lines = [f"    {item}" for item in items[:limit]]
    if len(items) > limit:
        lines.append(f"    … and {len(items) - limit} more")
    return lines


def section(title: str, items: list[str], limit: int = 20) -> list[str]:
    """`  title (n):` and `listed(items)` under it; empty when there are no items."""
    return [f"  {title} ({len(items)}):", *listed(items, limit)] if items else []


def mismatch_lines(noun: str, missing: list[str], unexpected: list[str], misshaped: list[str]) -> list[str]:
    """The indented lines listing what does not fit (`noun`: "keys", "tensors", ...);
    empty when everything fits."""
    lines = []
    if missing:
        lines.append(f"  missing {noun} ({len(missing)}): {shorten(missing)}")
    if unexpected:
        lines.append(f"  unexpected {noun} ({len(unexpected)}): {shorten(unexpected)}")
    return lines + section("mis-shaped tensors", misshaped)


def summary(noun: str, missing: list[str], unexpected: list[str], misshaped: list[str], limit: int = 3) -> str:
    """One line naming the first few of what does not fit (a message's first line, the
    one a command prints): `2 missing tensors (a, b); 1 mis-shaped (w: expected [2, 3],
    found [4, 3])`; empty when everything fits."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing {noun} ({shorten(missing, limit)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected {noun} ({shorten(unexpected, limit)})")
    if misshaped:
        parts.append(f"{len(misshaped)} mis-shaped ({shorten(misshaped, limit)})")
    return "; ".join(parts)
