"""The matrix a reader opens the board on: for each dataset x protocol x model, a defense x attack
grid of canonical cells (CA / ASR after the defense, mean ± std, n), the undefended victim first."""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass

from backdoorbench.report.cells import FEW_SEEDS, FLAG, NOT_APPLICABLE, Cell, NotApplicable
from backdoorbench.report.query import CLEAN_ATTACK, Row

VICTIM = "none"  # the grid's first row: the attacked model, before any defense
TITLE = "Defense x attack: the canonical cells"
INTRO = ("Each cell: CA / ASR after the defense in %, mean ± std over the seeds, (n=seeds); the first row, "
         f"{VICTIM}, is the undefended victim (CA / ASR of the attacked model). {NOT_APPLICABLE}: the defense's "
         "threat model excludes the attack; –: not run. The columns are the attacks some defense was run against "
         "(the attacks table below has every attack). Each cell is its pair's canonical row; the rows behind "
         "the cells, and every other setting, are listed below.")


@dataclass
class Grid:
    """One grid: its heading, its attack columns and, per defense (the victim first), a row per column or None."""

    heading: str
    columns: list[str]
    cells: dict[str, dict[str, Row]]  # defense -> column -> the canonical row

    @property
    def defenses(self) -> list[str]:
        return sorted(self.cells, key=lambda d: (d != VICTIM, d))


def column_of(row: Row) -> str:
    """The grid column of a row: its attack and target rule."""
    return f"{row.attack} {row.target_mode}"


def grids(rows: list[Row]) -> list[Grid]:
    """A grid per dataset, protocol and model that has a canonical row of an attack (not the clean
    control); its columns are the attacks a defense met there (all of them where none did)."""
    found: dict[tuple[str, str, str], dict[str, dict[str, Row]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        if row.canonical and row.attack != CLEAN_ATTACK and row.table != "detections":  # repair results only
            defense = VICTIM if row.table == "attacks" else row.defense
            found[(row.dataset, row.protocol, row.model)][defense][column_of(row)] = row
    out = []
    for (dataset, protocol, model), cells in sorted(found.items()):
        # the attacks some defense met; a grid of victims only (no defense run yet) shows every attack
        defended = {c for defense, by_column in cells.items() if defense != VICTIM for c in by_column}
        columns = sorted(defended or {c for by_column in cells.values() for c in by_column})
        out.append(Grid(f"{dataset}, {protocol} protocol, {model}", columns, {VICTIM: {}, **cells}))
    return out


def measures(row: Row) -> tuple[Cell | NotApplicable | None, Cell | NotApplicable | None]:
    """(CA, ASR) of a grid cell: the attacked model's for the victim row, else after the defense."""
    if row.table == "attacks":
        return row.cells.get("ca"), row.cells.get("asr")
    return row.cells.get("ca_after"), row.cells.get("asr_after")


def number(cell: Cell | NotApplicable | None) -> str:
    """A percentage with one decimal and its ± where the seeds differ at that precision."""
    if isinstance(cell, NotApplicable):
        return NOT_APPLICABLE
    if cell is None:
        return "–"
    spread = f"{100 * cell.std:.1f}"
    return f"{100 * cell.mean:.1f}" + (f" ± {spread}" if cell.n > 1 and float(spread) > 0 else "")


def seeds_text(row: Row) -> str:
    """`n=3`, flagged where fewer than FEW_SEEDS seeds ran."""
    return f"n={row.n}" + (f" {FLAG}" if row.n < FEW_SEEDS else "")


def cell_markdown(row: Row | None) -> str:
    """`CA / ASR (n=k)` of one cell; `n/a` where the threat model excludes the pair; – where none ran."""
    if row is None:
        return "–"
    ca, asr = measures(row)
    if isinstance(asr, NotApplicable):
        return NOT_APPLICABLE
    return f"{number(ca)} / {number(asr)} ({seeds_text(row)})"


def to_markdown(rows: list[Row]) -> list[str]:
    """The grids as Markdown tables, under one heading; [] when no canonical attack row exists."""
    found = grids(rows)
    if not found:
        return []
    lines = ["", f"## {TITLE}", "", INTRO]
    for grid in found:
        lines += ["", f"### {grid.heading}", "", "| defense | " + " | ".join(grid.columns) + " |",
                  "|---|" + "---|" * len(grid.columns)]
        for defense in grid.defenses:
            cells = [cell_markdown(grid.cells[defense].get(c)) for c in grid.columns]
            lines.append(f"| {defense} | " + " | ".join(cells) + " |")
    return lines


def colour(asr: float) -> str:
    """The background of a cell by its ASR: green at 0, yellow at 50%, red at 100%."""
    return f"hsl({120 * (1 - min(max(asr, 0.0), 1.0)):.0f}, 70%, 82%)"


def _cell_html(row: Row | None, defense: str, column: str) -> str:
    esc = html.escape
    if row is None:
        return '<td class="none">–</td>'
    ca, asr = measures(row)
    if isinstance(asr, NotApplicable):
        return f'<td class="na" title="{esc(asr.reason)}">{NOT_APPLICABLE}</td>'
    style = f' style="background: {colour(asr.mean)}"' if isinstance(asr, Cell) else ""
    where = f"{defense} vs {column}: {row.training}" + (f"; {row.label}" if row.label else "")
    return (f'<td{style} title="{esc(where)}"><a href="#row-{esc(row.group_id)}">'
            f'<span class="ca">{esc(number(ca))}</span><span class="asr">{esc(number(asr))}</span>'
            f'<span class="n">{esc(seeds_text(row))}</span></a></td>')


def to_html(rows: list[Row]) -> list[str]:
    """The grids as HTML tables coloured by ASR after, each cell a link to its row in the full tables."""
    esc = html.escape
    found = grids(rows)
    if not found:
        return []
    parts = [f'<section id="matrix"><h2>{esc(TITLE)}</h2>', f'<p class="note">{esc(INTRO)}</p>',
             '<p class="note legend">Colour: ASR after <span style="background: ' + colour(0.0) + '">0%</span> '
             f'<span style="background: {colour(0.5)}">50%</span> <span style="background: {colour(1.0)}">100%</span>; '
             "in each cell CA above, ASR below (bold). Click a cell for its row.</p>"]
    for grid in found:
        parts += [f"<h3>{esc(grid.heading)}</h3>", '<div class="grid-scroll"><table class="grid"><thead><tr>',
                  '<th class="text">defense \\ attack</th>']
        for column in grid.columns:
            attack, _, mode = column.partition(" ")
            parts.append(f"<th>{esc(attack)}<br><small>{esc(mode)}</small></th>")
        parts.append("</tr></thead><tbody>")
        for defense in grid.defenses:
            name = "none (victim)" if defense == VICTIM else defense
            parts.append(f'<tr><th class="text">{esc(name)}</th>'
                         + "".join(_cell_html(grid.cells[defense].get(c), defense, c) for c in grid.columns) + "</tr>")
        parts.append("</tbody></table></div>")
    parts.append("</section>")
    return parts
