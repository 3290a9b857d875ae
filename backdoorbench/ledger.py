"""The fidelity ledger as data: docs/ledger/<section>.yaml is the source of each section of
docs/fidelity.md, and the values it states are checked against the resolved config.

    python -m backdoorbench.ledger --write [SECTION ...]   render the YAML into docs/fidelity.md
    python -m backdoorbench.ledger --check                 exit 1 if docs/fidelity.md is stale

A row states one parameter: the paper's value, the official one (per dataset, at
`owner/repo@commit:path:line`), ours (per protocol and dataset) and why they differ. The schema is
docs/ledger/README.md; tests/test_ledger.py resolves every method under every protocol and dataset
and holds it to the rows.
"""

from __future__ import annotations

import argparse
import fcntl
import math
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from backdoorbench.errors import UserError
from backdoorbench.fileio import atomic_write_text

REPO = Path(__file__).resolve().parent.parent
LEDGER_DIR = REPO / "docs" / "ledger"
FIDELITY = REPO / "docs" / "fidelity.md"
PROTOCOLS = ("backdoorbench", "quick")
DATASETS = ("mnist5k", "mnist", "cifar10", "gtsrb", "tiny_imagenet")
ROW_FIELDS = {"parameter", "key", "paper", "official", "source", "official_text", "ours", "ours_text", "why"}
SECTION_FIELDS = {"section", "text", "rows", "after"}
SOURCE = re.compile(r"^[\w.-]+/[\w.-]+@[0-9a-f]{40}:[^:\s]+:\d+(-\d+)?$")
MISSING = object()
UNSET = "unset"  # an `ours` value: the config has no such key there (the code's own default applies)


class LedgerError(UserError):
    """A ledger file that does not follow docs/ledger/README.md."""


@dataclass(frozen=True)
class Row:
    section: str
    index: int
    data: Mapping[str, Any]

    @property
    def key(self) -> str | None:
        return self.data.get("key")

    @property
    def where(self) -> str:
        return f"docs/ledger/{self.section}.yaml row {self.index + 1} ({self.data.get('parameter')})"

    def official(self, dataset: str) -> Any:
        """The official value on `dataset`, MISSING where the official code gives none."""
        if "official" not in self.data:
            return MISSING
        value = self.data["official"]
        if isinstance(value, Mapping):
            return value.get(dataset, MISSING)
        return value

    def ours(self, protocol: str, dataset: str) -> Any:
        """Our value under `protocol` on `dataset`: the most specific key of the `ours` map wins."""
        value = self.data.get("ours", MISSING)
        if not isinstance(value, Mapping):
            return value
        for key in (f"{protocol}/{dataset}", f"*/{dataset}", protocol, "*"):
            if key in value:
                return value[key]
        return MISSING

    def departs(self) -> list[tuple[str, str]]:
        """The (protocol, dataset) pairs where ours differs from an official value."""
        return [(p, d) for p in PROTOCOLS for d in DATASETS
                if (official := self.official(d)) is not MISSING
                and (ours := self.ours(p, d)) is not MISSING and not same_value(ours, official)]


def same_value(a: Any, b: Any) -> bool:
    """Equal, numbers to 4 significant digits (the ledger writes 40/255 as 0.1569)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def section_names() -> list[str]:
    return sorted(p.stem for p in LEDGER_DIR.glob("*.yaml"))


def load(section: str) -> dict[str, Any]:
    """One ledger file, its schema checked."""
    path = LEDGER_DIR / f"{section}.yaml"
    if not path.is_file():
        raise LedgerError(f"no ledger file {path}; the sections are {', '.join(section_names())}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise LedgerError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    where = f"docs/ledger/{section}.yaml"
    if not isinstance(data, dict):
        raise LedgerError(f"{where} holds no mapping; see docs/ledger/README.md")
    if unknown := set(data) - SECTION_FIELDS:
        raise LedgerError(f"{where}: unknown field(s) {sorted(unknown)}; a section has {sorted(SECTION_FIELDS)}")
    if data.get("section") != section:
        raise LedgerError(f"{where} says section {data.get('section')!r}; it must be {section!r}, its file's stem")
    rows = data.get("rows") or []
    if not isinstance(rows, list):
        raise LedgerError(f"{where}: rows must be a list")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "parameter" not in row:
            raise LedgerError(f"{where} row {i + 1}: a row is a mapping with at least `parameter`")
        if unknown := set(row) - ROW_FIELDS:
            raise LedgerError(f"{where} row {i + 1} ({row['parameter']}): unknown field(s) {sorted(unknown)}; "
                              f"a row has {sorted(ROW_FIELDS)}")
    return data


def rows(section: str, data: dict[str, Any] | None = None) -> list[Row]:
    data = load(section) if data is None else data
    return [Row(section, i, row) for i, row in enumerate(data.get("rows") or [])]


def sources(row: Row | Mapping[str, Any]) -> list[str]:
    """A row's `source`, one string or a list, as a list."""
    value = (row.data if isinstance(row, Row) else row).get("source")
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


# ---------------------------------------------------------------------------------------- rendering

def format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if abs(value) >= 1e-4 or value == 0 else f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def _scope(key: str) -> str:
    protocol, _, dataset = key.partition("/")
    if protocol == "*":
        return dataset
    return f"{protocol} on {dataset}" if dataset else protocol


def format_map(value: Any) -> str:
    """A value, or a per-dataset / per-protocol map, as a table cell."""
    if not isinstance(value, Mapping):
        return f"`{format_value(value)}`"
    parts = [f"`{format_value(value['*'])}`"] if "*" in value else []
    parts += [f"{_scope(k)} `{format_value(v)}`" for k, v in value.items() if k != "*"]
    return "; ".join(parts)


def _cell(text: Any) -> str:
    return " ".join(str(text).split()) if text is not None else ""


def render_row(row: Mapping[str, Any]) -> str:
    keyed = "key" in row
    parameter = _cell(row["parameter"])
    if keyed:
        parameter += f" (`{row['key']}`)"
    official = []
    if keyed and "official" in row:
        official.append(format_map(row["official"]))
    elif "official" in row and not keyed:
        official.append(_cell(row["official"]))
    cited = [f"`{s}`" for s in sources(row)]
    if cited:
        official.append(("at " if official else "") + ", ".join(cited))
    official.append(_cell(row.get("official_text")))
    ours = [format_map(row["ours"]) if keyed and "ours" in row else _cell(row.get("ours"))]
    ours.append(_cell(row.get("ours_text")))
    cells = [parameter, _cell(row.get("paper")) or "–", " ".join(p for p in official if p) or "–",
             " ".join(p for p in ours if p) or "–", _cell(row.get("why")) or "–"]
    if keyed and "official" not in row and cells[2] == "–":
        cells[2] = "not in the code"
    return "| " + " | ".join(cells) + " |"


def begin_marker(section: str) -> str:
    return (f"<!-- ledger:{section} generated from docs/ledger/{section}.yaml by "
            f"`python -m backdoorbench.ledger --write`; edit the YAML, not this -->")


def end_marker(section: str) -> str:
    return f"<!-- /ledger:{section} -->"


def render(section: str, data: dict[str, Any] | None = None) -> str:
    """The section as docs/fidelity.md holds it, markers included."""
    data = load(section) if data is None else data
    out = [begin_marker(section), f"### {section}", ""]
    if data.get("text"):
        out += [data["text"].strip(), ""]
    if data.get("rows"):
        out += ["| parameter | paper | official code | ours | why |", "|---|---|---|---|---|"]
        out += [render_row(row) for row in data["rows"]]
        out.append("")
    if data.get("after"):
        out += [data["after"].strip(), ""]
    out.append(end_marker(section))
    return "\n".join(out)


def _block(text: str, section: str) -> re.Match | None:
    return re.search(rf"^{re.escape(begin_marker(section))}\n.*?^{re.escape(end_marker(section))}$",
                     text, flags=re.M | re.S)


def _handwritten(text: str, section: str) -> re.Match | None:
    """A section not yet generated: its heading up to the next heading (or a ledger marker)."""
    return re.search(rf"^### {re.escape(section)}\n.*?(?=^#{{2,3}} |^<!-- ledger:|\Z)", text, flags=re.M | re.S)


def replace_section(text: str, section: str, rendered: str) -> str:
    if match := _block(text, section):
        return text[:match.start()] + rendered + text[match.end():]
    if match := _handwritten(text, section):
        return text[:match.start()] + rendered + "\n\n" + text[match.end():]
    raise LedgerError(f"docs/fidelity.md has no section '### {section}' to replace; add its heading where it belongs")


def stale(text: str | None = None) -> list[str]:
    """The sections whose block in docs/fidelity.md is not what their YAML renders to."""
    text = FIDELITY.read_text() if text is None else text
    out = []
    for section in section_names():
        match = _block(text, section)
        if match is None or match.group(0) != render(section):
            out.append(section)
    return out


@contextmanager
def _locked() -> Iterator[None]:
    with open(FIDELITY.with_name(".fidelity.md.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write(sections: Iterable[str]) -> list[str]:
    """Render `sections` into docs/fidelity.md (atomically, under a lock); the ones changed."""
    changed = []
    with _locked():
        text = FIDELITY.read_text()
        for section in sections:
            new = replace_section(text, section, render(section))
            if new != text:
                changed.append(section)
            text = new
        if changed:
            atomic_write_text(FIDELITY, text)
    return changed


# ---------------------------------------------------------------------------------------- checking

def lookup(config: Mapping[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def leaf_keys(node: Any, prefix: str) -> list[str]:
    if isinstance(node, Mapping) and node:
        return [k for name, value in node.items() for k in leaf_keys(value, f"{prefix}.{name}")]
    return [prefix]


def static_problems(section: str) -> list[str]:
    """What is wrong with a section without resolving any config: sources, departures, ours."""
    problems = []
    for row in rows(section):
        for source in sources(row):
            if not SOURCE.match(source):
                problems.append(f"{row.where}: source {source!r} is not owner/repo@<40-hex commit>:path:line")
        if row.key is None:
            continue
        if "ours" not in row.data:
            problems.append(f"{row.where}: a keyed row states `ours`")
            continue
        if "official" in row.data and not sources(row):
            problems.append(f"{row.where}: an official value names its source")
        missing = [f"{p}/{d}" for p in PROTOCOLS for d in DATASETS if row.ours(p, d) is MISSING]
        if missing:
            problems.append(f"{row.where}: `ours` gives no value for {', '.join(missing)}")
        why = _cell(row.data.get("why"))
        departs = row.departs()
        if (departs or "official" not in row.data) and why.lower().rstrip(".") in ("", "same"):
            at = ", ".join(f"{p}/{d}" for p, d in departs) or "every dataset (no official value)"
            problems.append(f"{row.where}: ours differs from official at {at} and `why` gives no reason")
    return problems


def config_problems(section: str, config: Mapping[str, Any], protocol: str, dataset: str) -> list[str]:
    """Where the resolved `config` (of `protocol` on `dataset`) differs from the section's rows."""
    problems = []
    for row in rows(section):
        if row.key is None:
            continue
        resolved = lookup(config, row.key)
        ours = row.ours(protocol, dataset)
        if ours == UNSET:
            if resolved is not MISSING:
                problems.append(f"{row.where}: {row.key} resolves to {format_value(resolved)} under {protocol} on "
                                f"{dataset}, the ledger says the config leaves it unset")
        elif resolved is MISSING:
            problems.append(f"{row.where}: the config has no key {row.key} ({protocol} on {dataset})")
        elif ours is not MISSING and not same_value(resolved, ours):
            problems.append(f"{row.where}: {row.key} resolves to {format_value(resolved)} under {protocol} on "
                            f"{dataset}, the ledger says {format_value(ours)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backdoorbench.ledger", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", nargs="*", metavar="SECTION",
                      help="render these sections (all when none is named) into docs/fidelity.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/fidelity.md differs from the YAML")
    args = parser.parse_args(argv)
    try:
        if args.check:
            if out := stale():
                print(f"error: docs/fidelity.md is stale for {', '.join(out)}; run python -m backdoorbench.ledger "
                      f"--write", file=sys.stderr)
                return 1
            print(f"docs/fidelity.md matches docs/ledger/ ({len(section_names())} sections)")
            return 0
        names = args.write or section_names()
        for name in names:
            for problem in static_problems(name):
                print(f"warning: {problem}", file=sys.stderr)
        changed = write(names)
        print(f"wrote {', '.join(changed)} into docs/fidelity.md" if changed else "docs/fidelity.md was up to date")
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
