"""User-facing errors: one line that says what is wrong and what to do; the CLI exits with code 2."""

import signal
import threading


class KVConvertError(Exception):
    """A problem with the user's input or environment (not a bug). Printed without traceback."""

    exit_code = 2


class UnsupportedModelError(KVConvertError):
    """The checkpoint's architecture or options are not supported (yet)."""


class CheckpointError(KVConvertError):
    """A checkpoint folder or file is missing, unreadable or corrupt."""


class OutputExistsError(KVConvertError):
    """The output path exists and --overwrite was not given."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C: `with` blocks unwind (CheckpointWriter removes its temp folder)
    and the CLI prints its one-line "Interrupted" message instead of dying mid-write."""


_interrupted = threading.Event()


def _on_sigterm(signum, frame):
    _interrupted.set()
    raise Terminated("terminated (SIGTERM)")


def _on_sigint(signum, frame):
    _interrupted.set()
    raise KeyboardInterrupt


def interrupted_by_signal() -> bool:
    """True once SIGTERM or SIGINT reached a handler above. A signal that lands inside C code (torch
    building a tensor for safetensors, say) can have its exception replaced by an ordinary error
    (ValueError, then our CheckpointError); the CLI asks this to still report it as an interrupt."""
    return _interrupted.is_set()


def record_sigint() -> None:
    """Ctrl-C raises KeyboardInterrupt as before, and is also remembered for interrupted_by_signal."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def raise_on_sigterm():
    """Make SIGTERM raise Terminated. Main thread only (Python runs handlers there); returns the
    previous handler for restore_sigterm (None when nothing was changed)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_IGN, _on_sigterm):
        return None
    signal.signal(signal.SIGTERM, _on_sigterm)
    return previous


def restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
