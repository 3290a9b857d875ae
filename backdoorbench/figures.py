"""`python -m backdoorbench.figures`: the figures' command line (backdoorbench.report.figures).

The report wing, backdoorbench/report/, draws the figures; this module keeps the command and the
names other code imports from here."""

import sys

from backdoorbench.report.fig_defenses import reactivation_curves
from backdoorbench.report.figures import FIGURES, HELP, USAGE, main, write_figures
from backdoorbench.report.plot import ROWS_PER_PAGE, Run

__all__ = ["FIGURES", "HELP", "ROWS_PER_PAGE", "USAGE", "Run", "main", "reactivation_curves", "write_figures"]

if __name__ == "__main__":
    sys.exit(main())
