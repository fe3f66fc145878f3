"""Command-line plumbing shared by ``run`` and ``sweep``: ``--help`` exits 0, and a bad flag or
config override (a misspelt key, an unknown section, a value of the wrong type) is one line on
stderr with exit status 2, found before anything slow starts."""

from __future__ import annotations

import re
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments.bootstrap import HELP_FLAGS, join_processes
from starpo_jax.runtime import distributed

# What reading a config file and its overrides raises for bad input (ml_collections and absl).
CONFIG_ERRORS = (flags.Error, KeyError, AttributeError, TypeError, ValueError, OSError)


def define_config_flag(default: str = "configs/quickstart.py"):
    """The command's ``--config`` flag, ``default`` when the command line names no config file.
    ml_collections reads that default, with the command line's overrides, as the flag is defined,
    at import: a misspelt override is then one line and exit status 2 here, not a traceback."""
    try:
        return config_flags.DEFINE_config_file("config", default, "Config file (configs/*.py[:preset]).")
    except CONFIG_ERRORS as err:
        print(f"error: {flag_error_message(err, sys.argv)}", file=sys.stderr)
        sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """``app.run``'s flags parser with one-line errors (absl prints tracebacks or exits 1)."""
    if HELP_FLAGS & set(argv[1:]):
        app.usage(shorthelp="--helpfull" not in argv, writeto_stdout=True)
        sys.exit(0)
    try:
        rest = flags.FLAGS(last_overrides_only(argv))
        if "config" in flags.FLAGS:
            flags.FLAGS.config.keys()  # a config file that failed to load raises only when read
        return rest
    except CONFIG_ERRORS as err:
        print(f"error: {flag_error_message(err, argv)}", file=sys.stderr)
        sys.exit(2)


def last_overrides_only(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config.KEY=VALUE`` override given more than once kept only where it
    was given last: the last value wins, as for any flag (absl would join two tuple values)."""
    name = lambda arg: arg.split("=", 1)[0] if arg.startswith("--config.") and "=" in arg else None  # noqa: E731
    last = {name(arg): i for i, arg in enumerate(argv) if name(arg)}
    return [arg for i, arg in enumerate(argv) if name(arg) is None or last[name(arg)] == i]


# What Python or absl says when a value does not parse as the key's type -> what the key takes.
WRONG_TYPE = (("invalid literal for int()", "a whole number"), ("could not convert string to float", "a number"),
              ("Non-boolean argument", "True or False"))


def flag_error_message(err: Exception, argv: list[str]) -> str:
    """One line for a flag error; a missing config key is named with its full path and
    ml_collections' "Did you mean" suggestion."""
    text = str(err.args[0]) if err.args else str(err)
    if isinstance(err, (KeyError, AttributeError)):
        # ml_collections: "'max_trun'\nDid you mean ..." (sometimes repr'd once more).
        text = text.strip("'\"").replace("\\n", "\n").replace("\\'", "'")
        missing, _, hint = text.partition("\n")
        missing = missing.strip("'\"")
        paths = [a.split("=", 1)[0].removeprefix("--") for a in argv[1:] if a.startswith("--config.")]
        path = next((p for p in paths if missing in p.split(".")[1:]), f"config.{missing}")
        return f"--{path}: config key {missing!r} does not exist (see configs/base.py). {hint}".strip()
    if isinstance(err, OSError):  # ml_collections: "Failed loading config file ...\n ... [Errno 2] ..."
        return f"--config: {text.strip().splitlines()[-1].strip()}"
    wrong_type = re.match(r"flag --(config\.(\S+?))=(.*?): (.*)", text, re.S)
    if wrong_type:  # a value the key's type cannot parse: say the type, not Python's wording
        flag, key, value, why = wrong_type.groups()
        expected = next((kind for marker, kind in WRONG_TYPE if marker in why), None)
        if expected:
            return f"--{flag}={value}: {key} takes {expected}, not {value!r}."
    if "Traceback (most recent call last)" in text:  # an exception inside the config file: its last line
        return f"{text.split(':', 1)[0]}: {text.strip().splitlines()[-1].strip()}"
    return re.sub(r"\s+", " ", text).strip()


def runtime_agrees(config) -> bool:
    """Whether ``config``'s ``distributed`` section is what ``bootstrap.join_processes`` started from
    the command line (a config file cannot set it: it loads after the start); if not, one line on
    stderr, and the command exits with status 2."""
    try:
        distributed.check_started(config.distributed, distributed.from_argv(sys.argv))
    except distributed.DistributedError as err:
        print(f"{distributed.tag()}error: {err}", file=sys.stderr)
        return False
    return True


def run(main) -> None:
    """``app.run(main)`` with the parser above, the processes of a multi-host run joined first (by
    ``bootstrap.command`` already, or here for a launcher that imported the command); ``main``
    returns the exit status."""
    join_processes(sys.argv)
    app.run(lambda argv: sys.exit(interruptible(main, argv)), flags_parser=parse_flags)


def interruptible(main, argv) -> int:
    """``main(argv)``, a Ctrl-C it does not handle itself one line and status 130, not a traceback."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("interrupted (SIGINT)", file=sys.stderr)
        return 130
