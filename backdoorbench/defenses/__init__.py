"""Backdoor defenses, one per file; `conf/defense/<name>.yaml` selects one as `defense=<name>`."""

from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult

__all__ = ["Defense", "DefenseContext", "DefenseResult"]
