"""The report wing: tables and figures made from run records only, never from today's config or classes.

- `query`: load and filter records, group them into rows, label settings, pick the canonical rows;
  `cells` and `derived`: the numbers of a row and those it takes from other rows; `layout`: what a
  table shows and the words it prints.
- Renderers: `matrix` (the defense x attack grid the board opens on), `markdown`, `csv_table`,
  `html_page`, `protocol_tables`; the figures: `plot` (shared) and `fig_examples`, `fig_sweeps`,
  `fig_defenses`, `fig_robust`.
- The command lines: `leaderboard` and `figures` (`python -m backdoorbench.leaderboard`,
  `python -m backdoorbench.figures`).
"""
