"""The leaderboard as one self-contained HTML page: the defense x attack matrix on top, the detection
board, then the tables, sortable by any header, the canonical rows shown by default. No library, no
server, no network."""

from __future__ import annotations

import html
import urllib.parse

from backdoorbench.report import detection, matrix
from backdoorbench.report.cells import TABLES, cell_text
from backdoorbench.report.layout import (FOOTNOTE, GLOSSARY, UNITS, by_section, describe_filters, key_columns,
                                         key_values, layout, layout_note)
from backdoorbench.report.query import Row


# Each table sorts on its own header cells; a cell's data-sort is its key (the unrounded mean, or
# text), the header's data-type says how to compare; missing values go last either way. The radio
# buttons show the canonical rows, the other settings, or all. No library, no server, no network.
SORT_SCRIPT = """
(function () {
  function compare(x, y, numeric) {
    return numeric ? Number(x) - Number(y) : x.localeCompare(y, undefined, {numeric: true});
  }
  function sortTable(table, column, th) {
    var numeric = th.getAttribute("data-type") === "number";
    var ascending = th.getAttribute("aria-sort") !== "ascending";
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    var body = table.tBodies[0];
    var rows = Array.prototype.map.call(body.rows, function (row, i) {
      return {row: row, key: row.cells[column].getAttribute("data-sort"), i: i};
    });
    rows.sort(function (a, b) {
      if (a.key === "" || b.key === "") return (a.key === "") - (b.key === "") || a.i - b.i;
      return (ascending ? 1 : -1) * compare(a.key, b.key, numeric) || a.i - b.i;
    });
    rows.forEach(function (r) { body.appendChild(r.row); });
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, column) {
      th.addEventListener("click", function () { sortTable(table, column, th); });
      th.addEventListener("keydown", function (event) {
        if (event.key === "Enter" || event.key === " ") { event.preventDefault(); sortTable(table, column, th); }
      });
    });
  });
  function show(view) { document.body.className = "view-" + view; }
  document.querySelectorAll("input[name=view]").forEach(function (input) {
    input.addEventListener("change", function () { show(input.value); });
    if (input.checked) show(input.value);
  });
})();
"""
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 100%; }
.scroll { overflow: auto; max-height: 80vh; max-width: 100%; margin-bottom: 0.5em; border: 1px solid #ccc; }
table { border-collapse: separate; border-spacing: 0; font-size: 14px; }
th, td { border-right: 1px solid #ddd; border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: right;
         white-space: nowrap; vertical-align: top; background: #fff; }
th { background: #f2f2f2; cursor: pointer; user-select: none; position: sticky; top: 0; z-index: 2; }
th:first-child, td:first-child { position: sticky; left: 0; z-index: 1; }
th:first-child { z-index: 3; }
th[aria-sort=ascending]::after { content: " ▲"; } th[aria-sort=descending]::after { content: " ▼"; }
td.text, th.text { text-align: left; } code { font-size: 12px; }
td.setting { white-space: normal; min-width: 10em; max-width: 16em; }
body.view-canonical tr.other, body.view-other tr.canonical { display: none; }
tr.canonical td:first-child { box-shadow: inset 3px 0 0 #2a7ab0; }
details.runs summary { cursor: pointer; }
details.runs div { white-space: normal; min-width: 24em; max-width: 36em; text-align: left; font-size: 12px; padding-top: 4px; }
.note { color: #555; font-size: 13px; margin: 0.3em 0; }
dl.terms { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; font-size: 13px; max-width: 70em; }
dl.terms dt { font-weight: 600; } dl.terms dd { margin: 0; }
nav { margin: 0.5em 0 1em; font-size: 15px; } nav a { color: #2a7ab0; }
.grid-scroll { display: inline-block; overflow: auto; max-width: 100%; margin-bottom: 1em; border: 1px solid #ccc; }
table.grid td, table.grid th { text-align: center; padding: 3px 6px; font-size: 12px; vertical-align: middle; }
table.grid th { cursor: default; position: static; }
table.grid tbody th { text-align: left; position: sticky; left: 0; z-index: 1; }
table.grid thead th:first-child { position: sticky; left: 0; z-index: 2; }
table.grid td a { color: inherit; text-decoration: none; display: block; }
table.grid td span { display: block; white-space: nowrap; } table.grid .asr { font-weight: 600; }
table.grid .n { color: #555; font-size: 11px; } table.grid td.na, table.grid td.none { color: #888; }
.legend span { padding: 1px 6px; }
tr:target td { background: #e8f1f8; } tr[id] { scroll-margin-top: 32px; }  /* a cell's link: its row below the sticky header */
"""


def _term(header: str) -> str:
    if "reactivation" in header:
        return "reactivation"
    if header.startswith("ΔCA"):
        return "ΔCA vs clean"
    return "spread" if header == "ASR spread" else header.split()[0]


def _runs_cell(row: Row) -> str:
    esc = html.escape
    links = []
    for run_id, path in zip(row.run_ids, row.record_paths or [""] * len(row.run_ids)):
        label = f"<code>{esc(run_id[:8])}</code>"
        links.append(f'<a href="../{esc(urllib.parse.quote(path))}">{label}</a>' if path else label)
    return (f'<details class="runs"><summary><code>{esc(row.group_id[:8])}</code></summary><div>'
            f"seeds {esc(', '.join(map(str, row.seeds)))}; records {', '.join(links)}<br>"
            f"<code>{esc(row.command)}</code></div></details>")


def _detection_html(rows: list[Row]) -> list[str]:
    """The detection board: per dataset, protocol and model a sortable table per detector level, every
    row shown (each is a canonical cell); a row's config names its seeds, records and command."""
    esc = html.escape
    definitions = dict(GLOSSARY)
    found = detection.boards(rows)
    if not found:
        return []
    parts = [f'<section id="detection"><h2>{esc(detection.TITLE)}</h2>', f'<p class="note">{esc(detection.INTRO)}</p>']
    heading = None
    for board in found:
        if board.heading != heading:
            heading = board.heading
            parts.append(f"<h3>{esc(heading)}</h3>")
        shape = detection.shape_of(board)
        parts += [f"<h4>{esc(detection.LEVELS[board.level])}</h4>"]
        if shape.note:
            parts.append(f'<p class="note">{esc(shape.note)}</p>')
        parts.append(f'<div class="scroll"><table class="sortable detection" data-table="detection-{board.level}">'
                     "<thead><tr>")
        parts += header_cells(shape, definitions)
        parts.append("</tr></thead><tbody>")
        for entry in board.entries:
            keys = entry.keys()
            parts.append("<tr>")
            for key in shape.keys:
                sort = keys[key] if keys[key] != "–" else ""
                kind = "text setting" if key == "setting" else "text"
                parts.append(f'<td class="{kind}" data-sort="{esc(sort)}">{esc(keys[key])}</td>')
            for c in shape.columns:
                cell = entry.cells.get(c.key)
                sort = repr(cell.mean) if cell else ""
                parts.append(f'<td data-sort="{sort}">{esc(cell_text(cell, c, entry.row.n))}</td>')
            parts.append(f'<td class="text" data-sort="{esc(entry.row.group_id)}">{_runs_cell(entry.row)}</td></tr>')
        parts.append("</tbody></table></div>")
    parts.append("</section>")
    return parts


def to_html(rows: list[Row], filters: dict[str, str | None] | None = None, notes: str | None = None) -> str:
    """The page; `notes`, a link relative to the leaderboard folder, names where the commands are told."""
    esc = html.escape
    definitions = dict(GLOSSARY)
    canonical = sum(r.canonical for r in rows if r.table != "detections")
    board = _detection_html(rows)
    listed = sum(r.table != "detections" for r in rows)  # the rows of the tables below: detection-only runs are not
    where = f' The commands that made them: the results folder\'s <a href="{esc(notes)}">README.md</a>.' if notes else ""
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">', "<title>backdoorbench leaderboard</title>",
        f"<style>{STYLE}</style></head><body>", "<h1>backdoorbench leaderboard</h1>",
        "<p>Generated by <code>python -m backdoorbench.leaderboard</code> from the records under <code>runs/</code>; "
        f"do not edit.{esc(describe_filters(filters or {}))}{where} Click a column header to sort; click a row's "
        "config for its seeds, records and command.</p>",
        f"<p>{esc(UNITS)}</p>",
        '<nav><a href="#matrix">Defense x attack matrix</a> · '
        + ('<a href="#detection">Detection</a> · ' if board else "")
        + '<a href="#tables">All rows, by dataset</a> · <a href="#terms">What the columns mean</a></nav>',
        *matrix.to_html(rows),
        *board,
        '<section id="tables"><h2>All rows</h2>',
        '<p class="view">Rows: <label><input type="radio" name="view" value="canonical" checked> canonical '
        f'({canonical}: one per attack x mode at the protocol\'s setting)</label> <label><input type="radio" '
        f'name="view" value="other"> other settings ({listed - canonical}: sweeps, earlier protocols)</label> '
        '<label><input type="radio" name="view" value="all"> all</label></p>',
    ]
    for section, members in by_section([r for r in rows if r.table != "detections"]).items():
        parts.append(f"<h2>{esc(section)}</h2>")
        for table, title, _ in TABLES:
            chosen = [r for r in members if r.table == table]
            if not chosen:
                continue
            shape = layout(chosen, table)
            n_canonical = sum(r.canonical for r in chosen)
            note = f"Canonical rows: {n_canonical}, others: {len(chosen) - n_canonical}. " + layout_note(shape)
            parts += [f"<h3>{esc(title)}</h3>", f'<p class="note">{esc(note)}</p>',
                      f'<div class="scroll"><table class="sortable" data-table="{table}"><thead><tr>']
            parts += header_cells(shape, definitions)
            parts.append("</tr></thead><tbody>")
            for row in chosen:
                parts.append(f'<tr id="row-{esc(row.group_id)}" class="{"canonical" if row.canonical else "other"}">')
                keys = dict(zip(key_columns(table), key_values(row)))
                for key in shape.keys:
                    sort = str(row.n) if key == "n" else ("" if keys[key] == "–" else keys[key])
                    kind = "text setting" if key == "setting" else "text"
                    parts.append(f'<td class="{kind}" data-sort="{esc(sort)}">{esc(keys[key])}</td>')
                for c in shape.columns:
                    cell = row.cells[c.key]
                    sort = repr(cell.mean) if cell else ""
                    parts.append(f'<td data-sort="{sort}">{esc(cell_text(cell, c, row.n))}</td>')
                parts.append(f'<td class="text" data-sort="{esc(row.group_id)}">{_runs_cell(row)}</td>')
                parts.append("</tr>")
            parts.append("</tbody></table></div>")
    if not rows:
        parts.append("<p>No records.</p>")
    parts += [f"<p>{esc(FOOTNOTE)}</p>", "</section>",
              '<section id="terms"><h2>What the columns mean</h2><dl class="terms">',
              *(f"<dt>{esc(term)}</dt><dd>{esc(text)}</dd>" for term, text in GLOSSARY),
              "</dl></section>", f"<script>{SORT_SCRIPT}</script>", "</body></html>", ""]
    return "\n".join(parts)


def header_cells(shape, definitions: dict[str, str]) -> list[str]:
    """The <th> cells of a sortable table: its key columns, its value columns, then config, each
    titled with its definition."""
    esc = html.escape
    cells = []
    for key in shape.keys:
        kind = "number" if key == "n" else "text"
        cells.append(f'<th class="text" data-type="{kind}" tabindex="0" '
                     f'title="{esc(definitions.get(key, definitions["attack"]))}">{esc(key)}</th>')
    for c in shape.columns:
        cells.append(f'<th data-type="number" tabindex="0" title="{esc(definitions[_term(c.header)])}">'
                     f"{esc(c.header)}</th>")
    cells.append(f'<th class="text" data-type="text" tabindex="0" title="{esc(definitions["config"])}">config</th>')
    return cells
