"""One filter on the errors Python cannot raise and only reports (``sys.unraisablehook``: an exception in
a finaliser, a garbage-collector callback, a coroutine closed late). Parts of the run say which of
those they know to be harmless; the rest go on to the hook that was there before.

The filter stays installed for the life of the process: the errors it drops surface whenever the
objects behind them are collected, which can be long after the code that caused them has returned.
"""

import sys
from typing import Any, Callable

_harmless: list[Callable[[Any], bool]] = []
_passed_on: Callable[[Any], object] = sys.unraisablehook  # the hook before ours, for everything else


def ignore(is_harmless: Callable[[Any], bool]) -> None:
    """From now on, drop the unraisable errors for which ``is_harmless(unraisable)`` is true."""
    global _passed_on
    if sys.unraisablehook is not _report:
        _passed_on = sys.unraisablehook
        sys.unraisablehook = _report
    if is_harmless not in _harmless:
        _harmless.append(is_harmless)


def _report(unraisable) -> None:
    if not any(is_harmless(unraisable) for is_harmless in _harmless):
        _passed_on(unraisable)
