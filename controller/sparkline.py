"""Small inline charts for `ctl status`: a series as one line of block characters.

    >>> sparkline([1, 2, 3, 4, 3, 2], width=6)
    '▁▃▆█▆▃'

Values are bucketed to ``width`` points (the mean of each bucket), then scaled between the
series' own min and max; a flat series is a flat line. None values are skipped."""

from __future__ import annotations

from typing import Optional, Sequence

BARS = "▁▂▃▄▅▆▇█"


def downsample(values: Sequence[Optional[float]], width: int) -> list[float]:
    """At most ``width`` points, each the mean of its share of the series, in order."""
    clean = [float(v) for v in values if v is not None]
    if len(clean) <= width:
        return clean
    out = []
    for i in range(width):
        lo, hi = i * len(clean) // width, (i + 1) * len(clean) // width
        part = clean[lo:max(hi, lo + 1)]
        out.append(sum(part) / len(part))
    return out


def sparkline(values: Sequence[Optional[float]], width: int = 24) -> str:
    points = downsample(values, width)
    if not points:
        return ""
    lo, hi = min(points), max(points)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return BARS[len(BARS) // 2 - 1] * len(points)
    scale = (len(BARS) - 1) / (hi - lo)
    return "".join(BARS[round((p - lo) * scale)] for p in points)
