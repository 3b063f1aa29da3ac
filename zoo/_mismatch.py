"""One wording for "these files do not fit this model": every missing, unexpected and
mis-shaped entry listed, long lists cut."""

from __future__ import annotations


def shorten(items: list[str], limit: int = 20) -> str:
    """`items` joined by commas, the first `limit` of them and a count of the rest."""
    shown = ", ".join(items[:limit])
    return shown + (f", … and {len(items) - limit} more" if len(items) > limit else "")


def mismatch_lines(noun: str, missing: list[str], unexpected: list[str], misshaped: list[str]) -> list[str]:
    """The indented lines listing what does not fit (`noun`: "keys", "tensors", ...);
    empty when everything fits."""
    lines = []
    if missing:
        lines.append(f"  missing {noun} ({len(missing)}): {shorten(missing)}")
    if unexpected:
        lines.append(f"  unexpected {noun} ({len(unexpected)}): {shorten(unexpected)}")
    if misshaped:
        lines.append(f"  mis-shaped tensors ({len(misshaped)}):")
        lines.extend(f"    {m}" for m in misshaped[:20])
        if len(misshaped) > 20:
            lines.append(f"    … and {len(misshaped) - 20} more")
    return lines
