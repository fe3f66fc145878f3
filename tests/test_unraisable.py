"""The one filter on the errors Python can only report (``starpo_jax.runtime.unraisable``)."""

import sys

from starpo_jax.runtime import unraisable


class RaisesWhenCollected:
    def __init__(self, error):
        self.error = error

    def __del__(self):
        raise self.error


def test_harmless_errors_are_dropped_and_the_others_reach_the_hook_before(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda error: reported.append(type(error.exc_value)))
    monkeypatch.setattr(unraisable, "_harmless", [])
    monkeypatch.setattr(unraisable, "_passed_on", unraisable._passed_on)

    def is_key_error(error):
        return isinstance(error.exc_value, KeyError)

    unraisable.ignore(is_key_error)
    unraisable.ignore(is_key_error)  # twice is once
    unraisable.ignore(lambda error: isinstance(error.exc_value, KeyboardInterrupt))
    assert len(unraisable._harmless) == 2
    RaisesWhenCollected(KeyError("dropped"))
    RaisesWhenCollected(ValueError("reported"))
    RaisesWhenCollected(KeyboardInterrupt())
    assert reported == [ValueError]
