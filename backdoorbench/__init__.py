"""backdoorbench: a benchmark toolkit for backdoor attacks and defenses on image classifiers."""

__version__ = "0.1.0"
