"""User-facing errors: one line that says what is wrong and what to do; the CLI exits with code 2."""


class KVConvertError(Exception):
    """A problem with the user's input or environment (not a bug). Printed without traceback."""

    exit_code = 2


class UnsupportedModelError(KVConvertError):
    """The checkpoint's architecture or options are not supported (yet)."""


class CheckpointError(KVConvertError):
    """A checkpoint folder or file is missing, unreadable or corrupt."""


class OutputExistsError(KVConvertError):
    """The output path exists and --overwrite was not given."""
