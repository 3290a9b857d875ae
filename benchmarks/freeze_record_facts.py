"""Freeze what this commit knows of its methods into backdoorbench/records_v2_facts.json, which the
record upgrade from schema version 2 reads (records.frozen_facts), so that an old record's `report`
never changes with a later default, sensitivity key or threat model. Run once, at the commit
that introduced schema version 3, from the repository root:

    python -m benchmarks.freeze_record_facts

It refuses to replace the file: the frozen facts are the code of that commit, not of today.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from backdoorbench import records
from backdoorbench.fileio import write_new_bytes
from backdoorbench.run_facts import current_facts

COMMAND = "python -m benchmarks.freeze_record_facts"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(records.__file__).with_name(records.FROZEN_FACTS))
    args = parser.parse_args(argv)
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    commit = git.stdout.strip() or None
    facts = {"frozen": {"commit": commit, "command": COMMAND,
                        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "for": "records of schema versions 1 and 2 (records.upgrade)"},
             **current_facts()}
    try:
        write_new_bytes(args.out, (json.dumps(facts, indent=1) + "\n").encode("utf-8"))
    except FileExistsError:
        print(f"{args.out} exists: the facts are frozen once; delete it by hand only to freeze again", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
