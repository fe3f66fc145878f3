"""What every benchmark's JSON shares: the machine it ran on, and writing the report (the JSON and
its table drawn as a PNG chart beside it, ``experiments/bench_charts.py``)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import jax


def machine(note: str = "") -> dict:
    """The device and host a figure was measured on (with the load: other work skews rates)."""
    device = jax.devices()[0]
    return {
        "jax_platform": device.platform, "device_kind": device.device_kind,
        "device_count": jax.device_count(), "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
        "jax": jax.__version__, "note": note,
    }  # fmt: skip


def write_report(report: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"[bench] wrote {path}")
    from experiments.bench_charts import write_chart

    png = write_chart(report, path.with_suffix(".png"))
    if png:
        print(f"[bench] wrote {png}")
    return path
