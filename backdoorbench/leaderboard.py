"""`python -m backdoorbench.leaderboard`: the leaderboard's command line (backdoorbench.report.leaderboard).

The report wing, backdoorbench/report/, makes the tables; this module keeps the command and the
names other code imports from here."""

import sys

from backdoorbench.report.derived import build_rows
from backdoorbench.report.leaderboard import HELP, USAGE, LeaderboardFiles, main, parse_args, write_leaderboard
from backdoorbench.report.markdown import to_markdown
from backdoorbench.report.query import filter_records, load_records, load_records_with_paths

__all__ = ["HELP", "USAGE", "LeaderboardFiles", "build_rows", "filter_records", "load_records",
           "load_records_with_paths", "main", "parse_args", "to_markdown", "write_leaderboard"]

if __name__ == "__main__":
    sys.exit(main())
