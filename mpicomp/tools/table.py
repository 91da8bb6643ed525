"""Text tables and notes of the command line, at most ``WIDTH`` columns: each column as
wide as its widest cell, two spaces apart, a rule under the head; where that is too
wide, the cells of the columns named to ``squeeze`` are cut in the middle (``~``).
``mpicomp bench``, ``advise`` and ``trace summary`` print with it."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

#: The widest line a table or note prints: a terminal of 120 columns shows it unwrapped.
WIDTH = 120


def cut(text: str, width: int) -> str:
    """Return ``text`` cut to ``width`` characters in the middle, ``~`` where it was cut
    (the start and the end of a name tell it apart: ``layer4.1~conv2.weight``)."""
    if len(text) <= width:
        return text
    if width < 3:
        return text[:width]
    tail = (width - 1) // 2
    return text[: width - 1 - tail] + "~" + (text[-tail:] if tail else "")


def lines(
    head: Sequence[str],
    rows: Sequence[Sequence[str]],
    right: Sequence[int] = (),
    squeeze: Sequence[tuple[int, int]] = (),
    width: int = WIDTH,
) -> list[str]:
    """Return a table's lines: ``head``, a rule of dashes, then ``rows``.

    Args:
        head: the column titles.
        rows: cells as text, as many as ``head`` each.
        right: indices of the columns aligned right (numbers); the others align left.
        squeeze: (column, narrowest) pairs, in the order to narrow them while the table
            is wider than ``width``; their long cells are cut in the middle.
        width: the widest line wanted.
    """
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows, strict=True)]
    over = sum(widths) + 2 * (len(widths) - 1) - width
    for column, narrowest in squeeze:
        if over <= 0:
            break
        take = min(over, max(widths[column] - max(narrowest, len(head[column])), 0))
        widths[column] -= take
        over -= take
    right = set(right)

    def line(cells) -> str:
        out = []
        for i, (cell, w) in enumerate(zip(cells, widths, strict=True)):
            text = cut(str(cell), w)
            out.append(text.rjust(w) if i in right else text.ljust(w))
        return "  ".join(out).rstrip()

    return [line(head), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def note(text: str, width: int = WIDTH) -> str:
    """Return prose wrapped to ``width`` columns, its paragraphs (split at newlines) kept."""
    return "\n".join(
        textwrap.fill(p, width, break_on_hyphens=False, break_long_words=False) or ""
        for p in text.split("\n")
    )


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """Return ``n`` and its noun in the number it takes: ``1 thread``, ``2 threads``."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def listing(head: str, items: Sequence[str], sep: str = "; ", width: int = WIDTH) -> list[str]:
    """Return ``head`` and ``items`` joined by ``sep``, wrapped between items to ``width``
    columns (an item longer than a line, alone: within it); later lines indented by two
    spaces."""
    out, line = [], head
    for i, item in enumerate(items):
        piece = item + (sep.rstrip() if i < len(items) - 1 else "")
        if len(piece) + 2 > width:  # e.g. Open MPI's version string
            out.append(line)
            *whole, line = textwrap.wrap(
                piece, width, initial_indent="  ", subsequent_indent="    "
            )
            out.extend(whole)
        elif line.strip() and len(line) + 1 + len(piece) > width:
            out.append(line)
            line = "  " + piece
        else:
            line = f"{line} {piece}" if line else piece
    return [*out, line]
