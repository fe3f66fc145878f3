"""What every benchmark shares: the machine it ran on, its memory bandwidth, the clock (``timed``),
and writing the report (the JSON, its table drawn as a PNG chart beside it
(``experiments/bench/charts.py``), and a markdown table where the benchmark has one)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
from absl import flags
from ml_collections import config_flags

from experiments.bench.charts import write_chart
from experiments.cli import CONFIG_ERRORS, flag_error_message, last_overrides_only
from starpo_jax.models import PRESETS
from starpo_jax.runtime import allocator
from starpo_jax.runtime.experiment import ConfigError, build_experiment, check_config

# Peak memory bandwidth of known accelerators (vendor figures), bytes/s. Order matters: "H100 PCIe"
# is matched before "H100" (the SXM part). A device not listed has no roofline unless declared.
HBM_BYTES_PER_S = {"H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12, "A100": 2.04e12}


def hbm_bandwidth(device_kind: str) -> float | None:
    """Peak memory bandwidth of a device kind (``jax.Device.device_kind``), or None if unknown."""
    for name, bandwidth in HBM_BYTES_PER_S.items():
        if name in device_kind:
            return bandwidth
    return None


def timed(fn):
    """``fn()``, blocked on until its arrays are ready, and the seconds that took."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def machine(note: str = "") -> dict:
    """The device and host a figure was measured on (with the load: other work skews rates)."""
    device = jax.devices()[0]
    return {
        "jax_platform": device.platform, "device_kind": device.device_kind,
        "device_count": jax.device_count(), "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
        "jax": jax.__version__, "allocator": "tcmalloc" if allocator.loaded() else "glibc's malloc",
        "heap_limit_mib": allocator.current_heap_limit(),
        "tcmalloc_release_rate": os.environ.get(allocator.RELEASE_RATE) if allocator.loaded() else None,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"), "note": note,
    }  # fmt: skip


def write_report(report: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"[bench] wrote {path}")

    png = write_chart(report, path.with_suffix(".png"))
    if png:
        print(f"[bench] wrote {png}")
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; cells are printed with ``str``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(text: str, json_path: str | os.PathLike) -> Path:
    """Write ``text`` next to a report's JSON, with the suffix ``.md``."""
    path = Path(json_path).with_suffix(".md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(f"[bench] wrote {path}")
    return path


def load_config(path: str, overrides: list[str]):
    """The config as ``experiments.run`` reads it: file[:preset] plus ``--config.KEY=VALUE`` overrides."""
    unprefixed = [o for o in overrides if not o.startswith("--config.")]
    if unprefixed:  # absl would read them as positional arguments and drop them
        raise ConfigError(f"an override is --config.KEY=VALUE, not {unprefixed[0]!r}")
    argv = ["bench", f"--config={path}", *overrides]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", path, "config", flag_values=values, sys_argv=argv)
    try:
        values(last_overrides_only(argv))
        values.config.keys()  # a config file that failed to load raises only when read
        return values.config
    except CONFIG_ERRORS as err:
        raise ConfigError(flag_error_message(err, argv)) from None


def parse_with_overrides(parser, argv=None):
    """``parser``'s arguments, and the ``--config.KEY=VALUE`` overrides beside them as
    ``args.overrides`` (anything else is an error)."""
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        parser.error(f"unrecognised arguments: {' '.join(bad)}")
    args.overrides = rest
    return args


def or_exit(make, *args):
    """``make(*args)``; a bad config (a ``ConfigError`` is a ``ValueError``) or a file that does not
    load is one line on stderr and exit status 2."""
    try:
        return make(*args)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def checked_or_exit(path: str, overrides: list[str]):
    """The checked config of a file plus overrides (no model loaded: a check to make before slow
    work), or one line and exit status 2."""
    return or_exit(lambda: check_config(load_config(path, overrides)))


def build_or_exit(path: str, overrides: list[str]):
    """The experiment of a config file plus overrides, its model loaded, or one line and exit status 2."""
    return built_or_exit(checked_or_exit(path, overrides))


def built_or_exit(config):
    """``build_experiment(config)``, or one line and exit status 2 (a bad config, a model that does not load)."""
    return or_exit(build_experiment, config)


def require_positive(parser, args, *names: str) -> None:
    """``parser.error`` for the first of the options ``names`` (as ``args`` spells them) set to 0 or
    less: a count or size the benchmark would only trip over once it has loaded or compiled."""
    for name in names:
        value = getattr(args, name)
        if value is not None and not value > 0:
            kind = "a positive whole number" if isinstance(value, int) else "positive"
            parser.error(f"--{name.replace('_', '-')} must be {kind}, not {value}")


def require_presets(parser, names: list[str], flag: str = "--model") -> None:
    """``parser.error`` for the first of ``names`` that is no model preset (``starpo_jax.models.PRESETS``)."""
    unknown = [name for name in names if name not in PRESETS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r} in {flag}; choose from: {', '.join(sorted(PRESETS))}")


def whole_numbers(parser, text: str, flag: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32], each at least 1; anything else is ``parser.error``."""
    try:
        numbers = [int(n) for n in text.split(",")]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        parser.error(f"{flag} takes positive whole numbers separated by commas, not {text!r}")
    return numbers
