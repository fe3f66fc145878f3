"""One self-contained HTML page per run: curves, every validation trajectory and the dumped
training samples, drawn.

    python -m experiments.report runs/quickstart                       # writes runs/quickstart/report.html
    python -m experiments.report runs/starpo runs/starpo_s -o cmp.html  # several runs overlaid
    python -m experiments.report runs/sokoban --serve                   # http://127.0.0.1:8000, refreshes

Reads what ``experiments/run.py`` writes: ``metrics.jsonl`` (curves: success per env tag for train
and validation, reward mean and in-group std, entropy, the answers' mutual information with the
board (template collapse), gradient norm, response and think length,
reasoning diversity, throughput; collapse warnings marked), ``val/step_N.jsonl`` (each trajectory as
a dialogue, turn by turn, with the board drawn, and why a penalised reply broke the format),
``train/step_N.jsonl`` (the first ``trainer.log_trajectories`` training trajectories of step N:
the same records, drawn the same way in a section of their own, labelled as training samples) and
``config.json`` (env overrides, for the board's symbols; the rollout's parse settings). What success
means, the symbols' roles and the action names come from each env's contract (``envs_jax.base``).
The page holds its data, script and style inline: no network, it opens offline and as an e-mail
attachment. Missing or partial inputs (a run still writing, a truncated line, no
validation) give a page of what exists with a note saying what was skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import math
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

import envs_jax
from envs_jax.base import GridEnv
from starpo_jax.diagnostics.diversity import distinct_ngrams, think_texts
from starpo_jax.rollout.parsing import parse_response_text
from starpo_jax.runtime.settings import setting_defaults

ASSETS = Path(__file__).with_name("report_assets")
STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")
SUCCESS_KEY = re.compile(r"^(?:train|val-env)/([^/]+)/success$")


# ---- reading a run (tolerant: a run may be still writing) ----------------------------------------


def read_jsonl(path: Path, notes: list[str], gaps: list | None = None) -> list[dict]:
    """The JSON objects of a JSONL file. A line that does not parse is skipped with a note saying
    which and why: the last lines cut short (the run may still be writing them), or broken lines
    among complete ones (what they logged is lost). Each of the latter adds to ``gaps`` the
    ``step`` of the rows either side of it: the curves that may have lost a point there break."""
    rows, broken = [], []  # broken: (line number, why, how many complete rows precede it)
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            why = None if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
        except json.JSONDecodeError as err:
            why = f"column {err.colno}: {err.msg.removesuffix(' starting at')}"
        if why is None:
            rows.append(row)
        else:
            broken.append((i, why, len(rows)))
    inside = [b for b in broken if b[2] < len(rows)]  # complete lines follow them
    if inside:
        notes.append(f"{path}: skipped broken {_lines(inside)} among complete ones, so not a line still being "
                     "written: what it logged is missing, a gap in the curves.")
    if len(inside) < len(broken):
        notes.append(f"{path}: skipped the last {_lines(broken[len(inside):])}, cut short: the run may still be "
                     "writing it.")
    if gaps is not None:
        either_side = [[rows[n - 1].get("step"), rows[n].get("step")] for _, _, n in inside if n > 0]
        gaps += [g for g in either_side if all(isinstance(s, (int, float)) for s in g)]
    return rows


def _lines(broken: list[tuple]) -> str:
    """"line 3 (column 17: Expecting ',' delimiter)", or "lines 3, 7 (line 3: ...)"."""
    numbers = ", ".join(str(i) for i, _, _ in broken[:5]) + (", …" if len(broken) > 5 else "")
    (first, why, _) = broken[0]
    return f"line {first} ({why})" if len(broken) == 1 else f"lines {numbers} (line {first}: {why})"


def finite(value):
    """JSON-safe: NaN and infinities become null (JavaScript's JSON.parse rejects them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def make_env(tag: str, overrides: dict):
    """The env of a tag as the run built it, or None for one this version does not know (its boards
    are then shown as text, and its format failures without a reason)."""
    try:
        return envs_jax.make(tag, **overrides)
    except Exception:
        return None


def board_spec(env) -> dict:
    """How to draw an env's observation: a grid with a role per glyph (its ``symbol_meanings``,
    "box on target" as "box_on_target"), the Bandit's arms, or text."""
    if isinstance(env, GridEnv) and env.symbol_meanings:
        return {"kind": "grid", "roles": {s: m.replace(" ", "_") for s, m in zip(env.symbols, env.symbol_meanings)}}
    if type(env).__name__ == "Bandit":
        return {"kind": "bandit"}
    return {"kind": "text"}


def env_spec(env) -> dict:
    """What the page says of a tag's env: how to draw its boards and what its success means."""
    return {"board": board_spec(env), "success": env.success_meaning if env is not None else None}


def parse_settings(config: dict) -> tuple[int, bool]:
    """``(max_actions_per_turn, enable_think)`` the run parsed replies with (config defaults if unsaid)."""
    defaults, rollout = setting_defaults("RolloutPlan"), config.get("rollout") or {}
    return (rollout.get("max_actions_per_turn", defaults["max_actions_per_turn"]),
            rollout.get("enable_think", defaults["enable_think"]))


def format_failure(response: str, env, settings: tuple[int, bool]) -> str:
    """Why a reply earned the format penalty, by the rollout's own parser (``parse_response_text``,
    the oracle of the in-graph one): no closing tag, an answer that is not an action name, or no
    answer at all. "" when the env is unknown or the text parses clean."""
    if env is None:
        return ""
    max_actions, think = settings
    parsed = parse_response_text(response, None if env.answer_width else env.action_names, max_actions, think)
    if not parsed.matched:
        return "no closing tag: the reply never completes " + (
            "<think>…</think><answer>…</answer>" if think else "<answer>…</answer>")
    unknown = [a for a, i in zip(parsed.actions, parsed.action_ids) if i < 0]
    if unknown:
        return "not an action name: " + ", ".join(repr(a) for a in unknown)
    return "" if parsed.actions else "empty answer: no action"


def observed_state(observation: str) -> str:
    """The state text of a turn's observation (the grid, or the Bandit's description)."""
    return observation.split("State:\n")[-1].split("\nYou have")[0].strip("\n")


def prompt_text(observation: str) -> str:
    """A first observation's instructions: everything before the first state (the same for every
    level of a tag, so the page keeps it once per tag)."""
    return observation.split("State:\n")[0].strip("\n")


def compact_turn(turn: dict, env, settings: tuple[int, bool]) -> dict:
    response, penalty = str(turn.get("response") or ""), bool(turn.get("format_error"))
    return {
        "state": observed_state(str(turn.get("observation", ""))),
        "think": turn.get("think") or "",
        "answer": turn.get("answer") or "",
        "actions": list(turn.get("actions") or []),
        "reward": finite(turn.get("reward")),
        "penalty": penalty,
        "why": format_failure(response, env, settings) if penalty else "",
        "response": response,
    }


def compact_record(record: dict, step: int, env, settings: tuple[int, bool]) -> dict:
    """A dumped trajectory without its repeated prompt text; each penalised turn says why."""
    return {
        "step": step,
        "tag": str(record.get("tag", "?")),
        "group": record.get("group"),
        "seed": record.get("seed"),
        "success": bool(record.get("success")),
        "reward": finite(record.get("env_reward")),
        "penalty": finite(record.get("format_penalty_sum")),
        "actions": record.get("num_actions"),
        "turns": [compact_turn(t, env, settings) for t in record.get("turns") or [] if isinstance(t, dict)],
    }


def think_opening(text: str, words: int = 8) -> str:
    return " ".join(text.lower().split()[:words])


def diversity_of(records: list[dict]) -> dict:
    """Per tag: distinct 1- and 2-grams of the think texts, and the most repeated think opening."""
    by_tag: dict[str, list[str]] = {}
    for r in records:
        by_tag.setdefault(str(r.get("tag", "?")), []).extend(think_texts(r))
    table = {}
    for tag, texts in sorted(by_tag.items()):
        openings = Counter(think_opening(t) for t in texts)
        top, count = openings.most_common(1)[0] if openings else ("", 0)
        table[tag] = {
            "texts": len(texts),
            "distinct_1gram": distinct_ngrams(texts, 1),
            "distinct_2gram": distinct_ngrams(texts, 2),
            "top_opening": top,
            "top_share": count / len(texts) if texts else None,
        }
    return table


DUMPS = {"val": "validation", "train": "training"}  # folder of step_N.jsonl dumps -> what they hold


def step_dumps(run_dir: Path, folder: str = "val") -> list[tuple[int, Path]]:
    """``(step, path)`` of the run's ``<folder>/step_N.jsonl`` files (``val``: validations, ``train``:
    training samples), by step (temporary files left out)."""
    found = ((STEP_FILE.match(p.name), p) for p in (run_dir / folder).glob("step_*.jsonl"))
    return sorted((int(m.group(1)), p) for m, p in found if m)


def read_dumps(run_dir: Path, folder: str, env_of, settings: tuple[int, bool], max_levels: int | None,
               notes: list[str], prompts: dict) -> tuple[list[dict], dict]:
    """The compact trajectories of a run's ``<folder>/step_N.jsonl`` dumps (each marked with its
    ``kind``, the folder) and, per step, the diversity of their think texts. Each tag's prompt text goes
    to ``prompts`` (tag -> text, None while no dump of it had one)."""
    step_files = step_dumps(run_dir, folder)
    trajectories, diversity = [], {}
    for step, path in tqdm(step_files, desc=f"report {run_dir.name} {folder}", unit="file",
                           disable=len(step_files) < 20):
        records = read_jsonl(path, notes)
        diversity[step] = diversity_of(records)
        kept: Counter[str] = Counter()
        shown = 0
        for record in records:
            tag = str(record.get("tag", "?"))
            if max_levels is not None and kept[tag] >= max_levels:
                continue
            kept[tag] += 1
            shown += 1
            trajectories.append(compact_record(record, step, env_of(tag), settings) | {"kind": folder})
            first = (record.get("turns") or [{}])[0]
            if prompts.get(tag) is None and isinstance(first, dict) and first.get("observation"):
                prompts[tag] = prompt_text(str(first["observation"]))
            else:
                prompts.setdefault(tag, None)
        if shown < len(records):
            what = "" if folder == "val" else f"{DUMPS.get(folder, folder)} "
            notes.append(f"{what}step {step}: showing {shown} of {len(records)} trajectories "
                         f"(--max-levels {max_levels}).")
    return trajectories, diversity


def load_run(run_dir: Path, max_levels: int | None = None) -> dict:
    """Everything the page shows of one run, with notes on what is missing or was skipped."""
    notes: list[str] = []
    config = {}
    if (run_dir / "config.json").exists():
        try:
            config = json.loads((run_dir / "config.json").read_text())
        except json.JSONDecodeError:
            notes.append(f"{run_dir / 'config.json'} is not valid JSON; boards use the envs' default symbols.")
    config = config if isinstance(config, dict) else {}
    overrides = (config.get("envs") or {}).get("overrides") or {}
    settings = parse_settings(config)
    envs: dict = {}  # tag -> its env (None: unknown), built once

    def env_of(tag: str):
        if tag not in envs:
            envs[tag] = make_env(tag, overrides.get(tag, {}))
        return envs[tag]

    metrics_path = run_dir / "metrics.jsonl"
    metrics: list[dict] = []
    gaps: list[list[float]] = []  # [step before, step after] of each broken metrics line
    if metrics_path.exists():
        rows = read_jsonl(metrics_path, notes, gaps)
        metrics = [{k: finite(v) for k, v in r.items()} for r in rows if isinstance(r.get("step"), (int, float))]
        if not metrics:
            notes.append(f"{metrics_path} has no metric lines yet: no curves.")
    else:
        notes.append(f"No metrics.jsonl in {run_dir}: no curves.")

    if not step_dumps(run_dir, "val"):
        notes.append(f"No validation dumps (val/step_N.jsonl) in {run_dir}: no trajectories "
                     "(validation off, trainer.test_freq=0, or not reached yet).")
    tags: dict = {}  # tag -> its prompt text
    trajectories, diversity = read_dumps(run_dir, "val", env_of, settings, max_levels, notes, tags)
    # Training samples (train/step_N.jsonl, trainer.log_trajectories): none in runs from before them.
    train_trajectories, _ = read_dumps(run_dir, "train", env_of, settings, max_levels, notes, tags)

    for tag in {m.group(1) for r in metrics for m in map(SUCCESS_KEY.match, r) if m}:  # curves, no dump yet
        env_of(tag)
    collapse = [r["step"] for r in metrics if r.get("collapse/warning")]
    if collapse:
        notes.append(f"Collapse warning (reward std and entropy falling, a gradient spike, or the answers' "
                     f"mutual information with the board falling) at step(s) "
                     f"{', '.join(str(int(s)) for s in collapse)}.")
    return {
        "name": run_dir.resolve().name,
        "path": str(run_dir),
        "metrics": metrics,
        "gaps": gaps,  # [step before, step after] of each broken metrics line among complete ones
        "collapse_steps": collapse,
        "trajectories": trajectories,  # validation
        "train_trajectories": train_trajectories,  # training samples (no level seed)
        "diversity": {str(k): v for k, v in diversity.items()},
        "envs": {tag: env_spec(env) for tag, env in sorted(envs.items())},
        "prompts": {tag: prompt for tag, prompt in tags.items() if prompt},
        "notes": notes,
    }


def build_data(run_dirs: list[Path], max_levels: int | None = None) -> dict:
    runs = [load_run(d, max_levels) for d in run_dirs]
    names = [r["name"] for r in runs]
    for r in runs:  # two folders with one name (a/run, b/run) are told apart by their paths
        if names.count(r["name"]) > 1:
            r["name"] = r["path"]
    return {"generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": runs}


# ---- the page ------------------------------------------------------------------------------------


def render_html(data: dict, live: dict | None = None) -> str:
    """The whole page: data as inline JSON, script and style inline. ``live`` ({interval,
    signature}): the page is served by ``--serve`` and reloads when the inputs change."""
    data = {**data, "live": live}
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    payload = payload.replace("</", "<\\/")  # a think text with "</script>" must not end the block
    title = "starpo-jax report: " + ", ".join(r["name"] for r in data["runs"])
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        "<link rel=\"icon\" href=\"data:,\">"  # no favicon request, served or not
        f"<title>{_escape(title)}</title><style>{(ASSETS / 'report.css').read_text()}</style></head>"
        "<body><div id=\"app\"><p class=\"loading\">Drawing the report…</p></div>"
        f"<script type=\"application/json\" id=\"report-data\">{payload}</script>"
        f"<script>{(ASSETS / 'report.js').read_text()}</script></body></html>\n"
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_report(run_dirs: list[Path], out: Path, max_levels: int | None = None, live: dict | None = None,
                 data: dict | None = None) -> Path:
    html = render_html(data or build_data(run_dirs, max_levels), live)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(html)
    tmp.replace(out)  # a browser reloading the file never sees half a page
    return out


# ---- --serve: regenerate while a run goes on ------------------------------------------------------


def inputs_signature(run_dirs: list[Path]) -> str:
    """Changes whenever a run writes a metric line, a validation dump or a training-sample dump."""
    parts = []
    for d in run_dirs:
        dumps = [p for folder in DUMPS for p in (d / folder).glob("step_*.jsonl")]
        for p in sorted([d / "metrics.jsonl", d / "config.json", *dumps]):
            if p.exists():
                st = p.stat()
                parts.append(f"{p}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def make_server(run_dirs: list[Path], out: Path, port: int, interval: float, max_levels: int | None):
    """An HTTP server on 127.0.0.1 for the page; the page asks for /version every ``interval``
    seconds and reloads when the run has written something (the page is rebuilt on that request)."""
    state: dict[str, str | None] = {"signature": None}  # the inputs the page was last built from
    lock = threading.Lock()

    def refresh() -> str:
        with lock:
            signature = inputs_signature(run_dirs)
            if signature != state["signature"]:
                write_report(run_dirs, out, max_levels, live={"interval": interval, "signature": signature})
                state["signature"] = signature
            return signature

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path = self.path.split("?")[0]
            if path == "/version":
                body, kind = refresh().encode(), "text/plain"
            elif path in ("/", "/index.html", "/" + out.name):
                refresh()
                body, kind = out.read_bytes(), "text/html; charset=utf-8"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Cache-Control", "no-store")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # one line per poll would drown the terminal
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)  # a taken port fails before the build
    refresh()
    return server


def serve(run_dirs: list[Path], out: Path, port: int, interval: float, max_levels: int | None) -> int:
    try:
        server = make_server(run_dirs, out, port, interval, max_levels)
    except OSError as err:  # the port is taken, or not this user's to open
        print(f"error: --port {port} cannot be opened: {err.strerror or err}.", file=sys.stderr)
        return 2
    print(f"serving {out} at http://127.0.0.1:{server.server_address[1]}/ (refreshes every {interval:g} s "
          "while the run writes; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


# ---- command line --------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.report",
        description="Write one self-contained HTML report (curves, trajectories drawn turn by turn, "
                    "reasoning diversity) for one or several run folders.",
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="trainer.output_dir of a run (several: overlaid curves)")
    parser.add_argument("-o", "--out", type=Path, default=None,
                        help="HTML file (default: RUN_DIR/report.html for one run, ./report.html for several)")
    parser.add_argument("--max-levels", type=int, default=None,
                        help="show at most this many trajectories per env tag and step (default: all)")
    parser.add_argument("--serve", action="store_true", help="serve the report on 127.0.0.1 and refresh it")
    parser.add_argument("--port", type=int, default=8000, help="port for --serve (0: any free port)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between refresh checks for --serve")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.run_dirs if not d.is_dir()]
    if missing:
        parser.error(f"not a run folder: {', '.join(missing)}")
    if args.max_levels is not None and args.max_levels < 1:
        parser.error("--max-levels must be at least 1")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, not {args.port}")
    if not args.interval > 0:
        parser.error(f"--interval must be positive, not {args.interval:g}")
    if args.out is None:
        args.out = args.run_dirs[0] / "report.html" if len(args.run_dirs) == 1 else Path("report.html")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args.run_dirs, args.out, args.port, args.interval, args.max_levels)
    data = build_data(args.run_dirs, args.max_levels)
    for run in data["runs"]:  # what the page's notes say, on the terminal too
        for note in run["notes"]:
            print(f"note: {run['name'] + ': ' if len(data['runs']) > 1 else ''}{note}", file=sys.stderr)
    out = write_report(args.run_dirs, args.out, args.max_levels, data=data)
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")
    if size > 20 * 2**20:
        print("the page is large (every validation trajectory is in it); --max-levels N keeps N per env and step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
