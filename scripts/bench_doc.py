"""docs/BENCHMARKS.md's generated tables: each benchmark owns the block between its two markers
(`<!-- NAME:begin -->` ... `<!-- NAME:end -->`) and rewrites only that. Torch-free."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_block(name: str, body: str, doc: Path = DOC) -> None:
    """Replace the text between NAME's markers with `body` (markers appended at the end when missing)."""
    begin, end = markers(name)
    text = doc.read_text()
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
