"""Errors meant for people: the command line prints them as one line and exits with code 2."""


class UserError(Exception):
    """A bad value, name or file supplied by the user; its message names it and what would be right."""


class ConfigError(UserError):
    """A configuration value is invalid (unknown name, out-of-range rate or target, ...)."""


class DataError(UserError):
    """A dataset or pattern file is missing, truncated or malformed."""


class StorageError(UserError):
    """A result, checkpoint or cache file could not be written: a full disk, a quota, a read-only
    or removed folder, a permission taken away during the run."""
