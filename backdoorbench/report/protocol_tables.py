"""The protocol tables, made from the records (`<results_dir>/leaderboard/protocols.md`,
written with the leaderboard): per attack, the reactivation and cost of every defense run with
`eval.reactivation.enabled=true`; the clean-data budget sweep (`experiment=clean_budget`); the
sensitivity sweeps (`experiment=sensitivity_<defense>`). Every number is the mean over the seeds
of one setting (± the std where there are several); n says how many."""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter, defaultdict
from typing import Any, Callable

from backdoorbench.records import RunRecord
from backdoorbench.report.cells import NOT_APPLICABLE, NotApplicable, summarize
from backdoorbench.report.derived import row_setting, sensitivity_keys, sweep_key, sweep_settings
from backdoorbench.report.query import Row, row_label

CLEAN_BUDGET_KEY = "clean_fraction"  # the config key (under `defense.`) the clean-budget sweep varies

# The sweeps drawn as a table need this many settings: two rows of one setting that happen to differ
# in one key (an earlier protocol beside the table's) are not a sweep.
MIN_SETTINGS = 3


def _stat(values: list[float | None], scale: float = 100.0, digits: int = 1) -> str:
    kept = [v for v in values if v is not None]
    if not kept:
        return "–"
    mean = statistics.fmean(kept) * scale
    if len(kept) == 1 or statistics.stdev(kept) * scale < 0.5 * 10 ** -digits:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(kept) * scale:.{digits}f}"


def _pct(values: list[float | None]) -> str:
    return _stat(values)


def _curve(record: RunRecord, part: str) -> dict[str, Any]:
    block = getattr(record, "reactivation", None) or {}
    curve = block.get(part)
    return curve if isinstance(curve, dict) and curve.get("asr") else {}


def _labels(rows: list[Row], *dropped: str) -> dict[int, str]:
    """id(row) -> its setting label (`report.setting`, a cut budget named) without the keys a table's
    columns already say (the swept ones), "–" at the defaults."""
    return {id(row): row_label(row, dropped) or "–" for row in rows}


def _heading(row: Row) -> str:
    return f"{row.dataset}, {row.model}: {row.attack} {row.target_mode}, victim trained {row.training}"


def _reactivation_runs(rows: list[Row], records: dict[str, RunRecord]) -> list[tuple[Row, list[RunRecord]]]:
    """(row, its records that measured the retuning attack on a defended model) for each defense row with any."""
    found = []
    for row in rows:
        if row.table == "defenses":
            members = [records[i] for i in row.run_ids if i in records and _curve(records[i], "defended")]
            if members:
                found.append((row, members))
    return found


def reactivation_tables(rows: list[Row], records: dict[str, RunRecord]) -> list[str]:
    """One table per attack setting: each defense row whose own runs measured the retuning attack."""
    groups: dict[str, list[tuple[Row, list[RunRecord]]]] = defaultdict(list)
    for row, members in _reactivation_runs(rows, records):
        groups[_heading(row)].append((row, members))
    lines: list[str] = []
    for heading, entries in sorted(groups.items()):
        labels = _labels([row for row, _ in entries])
        lines += [f"### {heading}", "",
                  "| defense | setting | n | CA / ASR after the defense | ASR after retuning | QRA probe ASR: "
                  "defended / clean model | victim's ASR after the same retuning | passes/img | cost s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row, members in sorted(entries, key=lambda e: (e[0].defense, labels[id(e[0])])):
            def get(read: Callable[[RunRecord], float | None]) -> list[float | None]:
                return [read(r) for r in members]
            defended = [_curve(r, "defended") for r in members]
            probe = [c.get("probe") or {} for c in defended]
            cost = [r.defense_cost or {} for r in members]
            setting = labels[id(row)]
            lines.append(" | ".join([
                f"| {row.defense}", setting, str(len(members)),
                f"{_pct(get(lambda r: r.metrics['defended']['clean_acc']))} / "
                f"{_pct(get(lambda r: r.metrics['defended']['asr']))}",
                _pct([c["asr"][-1] for c in defended]),
                f"{_pct([p.get('asr') for p in probe])} / {_pct([p.get('asr_clean_model') for p in probe])}",
                _pct([(_curve(r, "attacked").get("asr") or [None])[-1] for r in members]),
                _stat([c.get("passes_per_train_image") for c in cost], 1.0, 2),
                _stat([c.get("seconds", r.timings_s.get("defense")) for c, r in zip(cost, members)], 1.0, 0)]) + " |")
        lines.append("")
    return lines


def reactivation_matrix(rows: list[Row], records: dict[str, RunRecord]) -> list[str]:
    """Defense x attack, per dataset, model and victim training: ASR after the defense -> ASR after
    the retuning attack, the undefended victim's first; of several settings of one cell, the one
    with the most seeds (then the newest). What a reader scans for which defenses hold up."""
    cells: dict[tuple[str, str, str], dict[str, dict[str, tuple[Row, list[RunRecord]]]]] = defaultdict(
        lambda: defaultdict(dict))
    for row, members in _reactivation_runs(rows, records):
        where = (row.dataset, row.model, row.training)
        column = f"{row.attack} {row.target_mode}"
        held = cells[where][row.defense].get(column)
        if held is None or (len(members), row.created_at) > (len(held[1]), held[0].created_at):
            cells[where][row.defense][column] = (row, members)
    # a pairing the defense's threat model excludes (ABL, spectral, AC vs attacks that poison in their own
    # training step) shows as n/a, as in the leaderboard, not as a run still to make
    excluded = {(row.dataset, row.model, row.training, row.defense, f"{row.attack} {row.target_mode}") for row in rows
                if row.table == "defenses" and isinstance(row.cells.get("asr_after"), NotApplicable)}
    lines: list[str] = []
    for (dataset, model, training), by_defense in sorted(cells.items()):
        columns = sorted({c for by_column in by_defense.values() for c in by_column})
        lines += [f"### {dataset}, {model}, victims trained {training}: ASR after the defense -> after retuning", "",
                  "| defense | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
        # the victim each run retuned as its reference: one per seed, the same in every defense's
        # run but an in-training defense's (it trains its own pair): the reference most runs share
        victims: dict[str, Counter] = defaultdict(Counter)
        for by_column in by_defense.values():
            for column, (_, members) in by_column.items():
                reference = [_curve(r, "attacked")["asr"] for r in members if _curve(r, "attacked")]
                if not reference:
                    continue
                victims[column][f"{_pct([c[0] for c in reference])} -> {_pct([c[-1] for c in reference])} "
                                f"(n={len(reference)})"] += 1
        lines.append("| no defense (victim) | " + " | ".join(
            victims[c].most_common(1)[0][0] if victims[c] else "–" for c in columns) + " |")
        for defense, by_column in sorted(by_defense.items()):
            texts = []
            for column in columns:
                if column not in by_column:
                    texts.append(NOT_APPLICABLE if (dataset, model, training, defense, column) in excluded else "–")
                    continue
                _, members = by_column[column]
                texts.append(f"{_pct([r.metrics['defended']['asr'] for r in members])} -> "
                             f"{_pct([_curve(r, 'defended')['asr'][-1] for r in members])} (n={len(members)})")
            lines.append(f"| {defense} | " + " | ".join(texts) + " |")
        lines.append("")
    return lines


def _value_text(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _restricted(row: Row, seeds: tuple[int, ...], records: dict[str, RunRecord]) -> Row | None:
    """`row` as if it had run only `seeds` (a subset of its own): its CA and ASR after recomputed from
    its records of those seeds; None when a record is missing or has no defended model."""
    kept = [r for r in map(records.get, row.run_ids) if r is not None and r.seed in seeds]
    if len(kept) != len(seeds) or not all(r.metrics.get("defended") for r in kept):
        return None
    cells = {key: summarize([r.metrics["defended"][metric] for r in kept])
             for key, metric in (("ca_after", "clean_acc"), ("asr_after", "asr"))}
    return dataclasses.replace(row, seeds=sorted(seeds), cells={**row.cells, **cells},
                               run_ids=[r.run_id for r in kept])


def _kernels(rows: list[Row], seeds: tuple[int, ...], records: dict[str, RunRecord]) -> set[str]:
    """The CPU kernels (`env.cpu_capability`) that the records of `rows` for `seeds` name; older records name none."""
    return {kernel for row in rows for run_id in row.run_ids if (r := records.get(run_id)) is not None
            and r.seed in seeds and (kernel := (r.env or {}).get("cpu_capability"))}


def _like_with_like(chosen: dict[tuple, Row], seeds: tuple[int, ...], members: list[Row], keys: tuple[str, ...],
                    records: dict[str, RunRecord]) -> None:
    """Make each setting of a sweep's seed set the run closest to the sweep's own: of the rows that ran
    those seeds (or those and more, then restricted to them), one whose records name the kernels the
    sweep's name, then one naming none (made before records named them), the newest first; a row naming
    other kernels is never taken (docs/fidelity.md#reproducibility). So a sweep run at seed 0 beside a
    3-seed row at its default gets the default's seed-0 run, made like the sweep."""
    sweep_kernels = _kernels(list(chosen.values()), seeds, records)
    candidates: dict[tuple, list[tuple[tuple[bool, str], Row]]] = defaultdict(list)
    for row in members:
        if not set(seeds) <= set(row.seeds):
            continue
        kernels = _kernels([row], seeds, records)
        if kernels and sweep_kernels and kernels != sweep_kernels:
            continue
        candidates[row_setting(row, keys)].append(((bool(kernels), row.created_at), row))
    for setting, ranked in candidates.items():
        for _, row in sorted(ranked, key=lambda item: item[0], reverse=True):
            narrowed = row if sorted(row.seeds) == sorted(seeds) else _restricted(row, seeds, records)
            if narrowed is not None:
                chosen[setting] = narrowed
                break


def _sweeps(rows: list[Row], keys_of: Callable[[Row], tuple[str, ...]],
            records: dict[str, RunRecord] | None = None) -> dict[str, list[tuple[Row, tuple, dict]]]:
    """heading -> [(a row of the sweep, its seeds, {setting: row})] for each sweep of MIN_SETTINGS or more
    of the dotted keys `keys_of(row)` names (none: the row is in no sweep). A sweep compares one seed
    set (derived.sweep_settings); given the records, each setting is then the run of that seed set made
    most like the sweep (_like_with_like), which may be a row that ran those seeds and more, restricted
    to them (a sweep run at seed 0 beside a 3-seed row at its default: the default's seed-0 run, not
    the 3-seed mean)."""
    by_key: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        keys = keys_of(row) if row.table == "defenses" else ()
        if keys and hasattr(row.cells.get("asr_after"), "mean"):
            by_key[(row.defense, keys, *sweep_key(row, keys))].append(row)
    found: dict[str, list[tuple[Row, tuple, dict]]] = defaultdict(list)
    for (_, keys, *_), members in by_key.items():
        seeds, chosen = sweep_settings(members, keys)
        if records and seeds:
            _like_with_like(chosen, seeds, members, keys, records)
        if len(chosen) >= MIN_SETTINGS:
            found[_heading(members[0])].append((members[0], seeds, chosen))
    return found


def _clean_budget_keys(row: Row) -> tuple[str, ...]:
    return (f"defense.{CLEAN_BUDGET_KEY}",) if row.facts.get("clean_budget") else ()


def clean_budget_tables(rows: list[Row], records: dict[str, RunRecord] | None = None) -> list[str]:
    """Per attack setting: CA / ASR after each defense at each share of clean training data it held."""
    lines: list[str] = []
    sweeps = _sweeps(rows, _clean_budget_keys, records)
    for heading, entries in sorted(sweeps.items()):
        fractions = sorted({s[0] for _, _, chosen in entries for s in chosen if s[0] is not None})
        lines += [f"### {heading}", "", "CA / ASR after the defense, %, at each clean fraction of the training set.", "",
                  "| defense | setting | seeds | " + " | ".join(f"{100 * f:g}%" for f in fractions) + " |",
                  "|---|---|---|" + "---|" * len(fractions)]
        labels = _labels([first for first, _, _ in entries], CLEAN_BUDGET_KEY)
        for first, seeds, chosen in sorted(entries, key=lambda e: (e[0].defense, labels[id(e[0])])):
            cells = []
            for fraction in fractions:
                row = chosen.get((fraction,))
                cells.append("–" if row is None else
                             f"{_cell(row, 'ca_after')} / {_cell(row, 'asr_after')}")
            setting = labels[id(first)]
            lines.append(f"| {first.defense} | {setting} | {' '.join(map(str, seeds))} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _cell(row: Row, key: str) -> str:
    cell = row.cells.get(key)
    if cell is None or not hasattr(cell, "mean"):
        return "–"
    return f"{100 * cell.mean:.1f}" + (f" ± {100 * cell.std:.1f}" if cell.n > 1 and 100 * cell.std >= 0.05 else "")


def sensitivity_tables(rows: list[Row], records: dict[str, RunRecord] | None = None) -> list[str]:
    """Per attack setting: each defense's ASR after (and CA after) at every value of its swept
    hyper-parameter, the default in bold, and the spread (max - min ASR after, points)."""
    lines: list[str] = []
    for heading, entries in sorted(_sweeps(rows, sensitivity_keys, records).items()):
        lines += [f"### {heading}", "",
                  "Each value: ASR after / CA after the defense, %; the default in bold.", "",
                  "| defense | swept | seeds | values: ASR / CA after | ASR spread (points) |", "|---|---|---|---|---|"]
        for first, seeds, chosen in sorted(entries, key=lambda e: e[0].defense):
            keys = first.facts["sensitivity_keys"]
            # the default: the setting of a row at the defense's defaults (`report.defense_at_defaults`)
            default = next((s for s, row in chosen.items() if row.facts.get("defense_at_defaults")), None)
            parts, asr = [], []
            for setting in sorted(chosen, key=_sort_key):
                row = chosen[setting]
                value = ", ".join(_value_text(v) for v in setting)
                value = f"**{value}**" if setting == default else value
                parts.append(f"{value}: {_cell(row, 'asr_after')} / {_cell(row, 'ca_after')}")
                asr.append(row.cells["asr_after"].mean)
            lines.append(f"| {first.defense} | {', '.join(keys)} | {' '.join(map(str, seeds))} | {' · '.join(parts)} | "
                         f"{100 * (max(asr) - min(asr)):.1f} |")
        lines.append("")
    return lines


def _sort_key(setting: tuple) -> tuple:
    """Numbers and lists of numbers (NAD's betas) by value, anything else by its text."""
    return tuple((0, v if isinstance(v, tuple) else (v,), "") if isinstance(v, (int, float, tuple)) else (1, (), str(v))
                 for v in setting)


def protocol_markdown(rows: list[Row], records: list[RunRecord]) -> str:
    """protocols.md: the reactivation, clean-budget and sensitivity tables."""
    by_id = {r.run_id: r for r in records}
    sections = [
        ("Reactivation and cost", "The retuning attack of Min et al. (NeurIPS 2024) after each defense, and "
         "what the defense cost (passes: images through the model forward plus backward, per training image). "
         "Runs with `eval.reactivation.enabled=true`: first the overview, then each attack in full.",
         reactivation_matrix(rows, by_id) + reactivation_tables(rows, by_id)),
        ("Clean-data budget", "`python -m backdoorbench --multirun experiment=clean_budget attack=<name>`: each "
         "defense with 0.5% to 10% of the training set as its clean data.", clean_budget_tables(rows, by_id)),
        ("Sensitivity", "`python -m backdoorbench --multirun experiment=sensitivity_<defense> attack=<name>`: "
         "each defense's key hyper-parameter swept around its default.", sensitivity_tables(rows, by_id)),
    ]
    out = ["# Protocol tables", "",
           "Made by `python -m backdoorbench.leaderboard` from the records, never by hand. "
           "CA, ASR in %, mean ± std over the seeds listed; one seed: no ±.", ""]
    for title, text, lines in sections:
        out += [f"## {title}", "", text, ""] + (lines or ["No runs of this protocol.", ""])
    return "\n".join(out)
