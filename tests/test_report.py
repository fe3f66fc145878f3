"""``python -m experiments.report``: a tiny real run's report opened in a real headless browser
(Debian's chromium, driven by playwright; no browser download), malformed and partial inputs, and
``--serve`` refreshing while a run writes."""

import json
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from experiments import report
from helpers import REPO, command_env, tiny_with
from starpo_jax.diagnostics.diversity import distinct_ngrams, think_diversity_metrics

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]  # containers often have a small /dev/shm

# test_run's tiny run, validating one level of every env at every step, without checkpoints or export
VAL_EVERY_STEP = {"envs.val.tags": "('SimpleSokoban','FrozenLake','Bandit')", "envs.val.n_groups": "(1,1,1)",
                  "trainer.test_freq": "1", "trainer.save_freq": "0", "trainer.export_hf": "False",
                  # two Sokoban groups, whose answers' mutual information with the board is scored every step
                  "envs.train.n_groups": "(2,1,1)", "trainer.mi_freq": "1",
                  "actor.format_warmup_steps": "1", "actor.format_warmup_lr": "1e-3"}  # and one format warm-up step
TINY_RUN = tiny_with(VAL_EVERY_STEP)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Two training steps, validations at steps 0, 1 and 2 on one level of each env."""
    out = tmp_path_factory.mktemp("run")
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", *TINY_RUN, f"--config.trainer.output_dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env=command_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def browser():
    # CI installs chromium (.ci/run); a missing browser is a failure, never a silent skip.
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install -y chromium"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A page with every request and script error recorded."""

    def __init__(self, browser, url):
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.requests, self.errors = [], []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.goto(url)
        self.page.wait_for_selector("body[data-ready]", timeout=20_000)

    def articles(self, section="#trajectories"):
        return self.page.locator(f"{section} article.trajectory")

    def choose(self, select_class, value):
        self.page.select_option(f"select.{select_class}", value)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_report_of_a_tiny_real_run_in_a_browser(tiny_run, browser, tmp_path):
    out = tmp_path / "report.html"
    assert report.main([str(tiny_run), "-o", str(out)]) == 0
    page = Page(browser, out.as_uri())
    p = page.page

    # Curves: one SVG path per logged series, with a point per logged step.
    metrics = read_jsonl(tiny_run / "metrics.jsonl")
    for key in ("train/reward/mean", "val-env/reward/mean", "rollout/in_group_std", "actor/entropy_loss",
                "actor/grad_norm", "train/response_length", "perf/generated_tokens_per_s",
                "train/SimpleSokoban/success", "val-env/FrozenLake/success", "val-env/Bandit/success"):
        steps = [r["step"] for r in metrics if key in r]
        d = p.locator(f'#curves path.series[data-key="{key}"]').first.get_attribute("d")
        assert d.count("M") == 1 and d.count("L") == len(steps) - 1, (key, d)
    assert len(steps) == 3  # validation at 0, 1, 2
    warmup = [r for r in metrics if "format_warmup/nll" in r]
    assert [r["step"] for r in warmup] == [0] and warmup[0]["format_warmup/nll"] > 0
    # Template collapse, scored on the training rollouts at every step: a series in its own panel.
    assert [r["step"] for r in metrics if "train/SimpleSokoban/mi" in r] == [1, 2]
    mi = p.locator('#curves path.series[data-key="train/SimpleSokoban/mi"]')
    assert mi.count() == 1 and mi.get_attribute("d").count("L") == 1

    # Every trajectory of every dump, turn by turn, each turn with its board.
    dumps = {int(f.stem.split("_")[1]): read_jsonl(f) for f in (tiny_run / "val").glob("step_*.jsonl")}
    records = [(step, r) for step in sorted(dumps) for r in dumps[step]]
    assert sorted(dumps) == [0, 1, 2] and len(records) == 9
    cards = page.articles()
    assert cards.count() == len(records)
    for i, (step, record) in enumerate(records):
        card = cards.nth(i)
        assert card.get_attribute("data-tag") == record["tag"] and card.get_attribute("data-step") == str(step)
        turns = card.locator(".turn")
        assert turns.count() == len(record["turns"]) > 0
        for j, turn in enumerate(record["turns"]):
            t = turns.nth(j)
            state = report.observed_state(turn["observation"])
            if record["tag"] == "Bandit":  # two arms, named as in the prompt
                arms = t.locator("svg.bandit-board g.arm")
                assert arms.count() == 2 and all(arms.nth(k).text_content() in state for k in range(2))
            else:  # one drawn cell per grid symbol, walls / holes among them
                rows = state.split("\n")
                cells = t.locator("svg.grid-board g.cell")
                assert cells.count() == sum(len(r) for r in rows)
                assert t.locator("g.cell.unknown").count() == 0
                assert t.locator("g.cell.wall" if "Sokoban" in record["tag"] else "g.cell.player, g.cell.player_on_goal, g.cell.player_in_hole").count() >= 1
            assert t.locator(".bubble.think").count() == 1 and t.locator(".bubble.answer").count() == 1
            assert turn["response"] in t.locator("details.raw pre").text_content()

    # Each env's prompt once, not repeated in every trajectory.
    prompts = p.locator("#trajectories details.prompt")
    assert prompts.count() == 3 and "Sokoban puzzle" in prompts.first.locator("pre").text_content()

    # Filters change what is shown.
    assert not {"null", "undefined"} & set(p.locator("#trajectories .filters").inner_text().split())
    page.choose("f-env", "FrozenLake")
    assert {page.articles().nth(i).get_attribute("data-tag") for i in range(page.articles().count())} == {"FrozenLake"}
    assert page.articles().count() == 3
    page.choose("f-step", "2")
    assert page.articles().count() == 1 and page.articles().first.get_attribute("data-step") == "2"
    successes = sum(r["success"] for r in dumps[2] if r["tag"] == "FrozenLake")
    page.choose("f-outcome", "success")
    assert page.articles().count() == successes
    page.choose("f-outcome", "failure")
    assert page.articles().count() == 1 - successes

    # The same level across steps: one column per validation.
    page.choose("c-env", "SimpleSokoban")
    cols = p.locator("#compare .compare-col")
    assert cols.count() == 3
    assert [cols.nth(i).locator("article").get_attribute("data-step") for i in range(3)] == ["0", "1", "2"]

    # Diversity table: a row per step and env (the random model writes no think text).
    assert p.locator("#diversity tbody tr").count() == 9
    assert not any("think_distinct" in k for r in metrics for k in r)

    p.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert (tmp_path / "report.png").stat().st_size > 50_000
    assert page.errors == []
    assert page.requests == [out.as_uri()]  # the page itself; nothing from the network


def test_partial_and_malformed_runs_give_a_report_with_notes(tiny_run, browser, tmp_path):
    writing = tmp_path / "writing"  # a run still writing: truncated last lines, a temporary dump
    shutil.copytree(tiny_run, writing, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    with (writing / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2.5, "train/rew\n')  # a broken line among complete ones: a gap in the curves
        f.write(json.dumps({"step": 3, "train/reward/mean": 0.1, "collapse/warning": 1.0}) + "\n")
        f.write('{"step": 4, "train/reward/me')
    with (writing / "val" / "step_2.jsonl").open("a") as f:
        f.write('{"tag": "FrozenLake", "turns": [{"obs')
    (writing / "val" / "step_3.tmp").write_text("{")
    (writing / "config.json").write_text("{not json")
    no_val = tmp_path / "no_val"
    no_val.mkdir()
    shutil.copy(tiny_run / "metrics.jsonl", no_val / "metrics.jsonl")
    empty = tmp_path / "empty"
    empty.mkdir()

    out = tmp_path / "r.html"
    assert report.main([str(writing), str(no_val), str(empty), "-o", str(out)]) == 0
    page = Page(browser, out.as_uri())
    notes = page.page.locator("#notes").inner_text()
    assert "metrics.jsonl: skipped the last line" in notes and "step_2.jsonl: skipped the last line" in notes
    assert "metrics.jsonl: skipped broken line" in notes
    assert "1 broken metrics line(s) missing" in page.page.locator("header").inner_text()
    assert "config.json is not valid JSON" in notes
    assert "no_val: No validation dumps" in notes
    assert "empty: No metrics.jsonl" in notes
    assert ("Collapse warning (reward std and entropy falling, a gradient spike, or the answers' mutual information "
            "with the board falling) at step(s) 3.") in notes
    marks = page.page.locator("#curves line.collapse")
    assert marks.count() > 0 and marks.first.locator("title").text_content() == "collapse warning at step 3 (writing)"
    # What exists is still drawn: the complete lines of each run.
    assert page.page.locator('#curves path.series[data-key="train/reward/mean"]').count() == 2
    curve = page.page.locator('#curves path.series[data-key="train/reward/mean"][data-run="writing"]')
    assert curve.get_attribute("d").count("M") == 2  # not drawn across the broken line
    assert page.articles().count() == 9
    assert page.errors == []


def test_broken_metrics_lines_are_told_apart_on_stderr(tmp_path, capsys):
    """A line cut short at the end (a run still writing) vs a broken line among complete ones (lost):
    each named on stderr with its line and why, and the curves break where the lost line was."""
    rows = [json.dumps({"step": s, "train/reward/mean": 0.1 * s}) for s in (1, 2)]
    rows += ['{"step": 3, "train/reward/mean" 0.3}', json.dumps({"step": 4, "train/reward/mean": 0.4})]
    rows += ['{"step": 5, "tr']
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows))
    assert report.main([str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert (f"note: {tmp_path / 'metrics.jsonl'}: skipped broken line 3 (column 33: Expecting ':' delimiter) among "
            "complete ones, so not a line still being written: what it logged is missing, a gap in the curves.") in err
    assert (f"note: {tmp_path / 'metrics.jsonl'}: skipped the last line 5 (column 13: Unterminated string), "
            "cut short: the run may still be writing it.") in err
    (run,) = report.build_data([tmp_path])["runs"]
    assert run["gaps"] == [[2, 4]] and [r["step"] for r in run["metrics"]] == [1, 2, 4]


def test_cli_errors_and_help(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.report", "--help"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "RUN_DIR" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "experiments.report", str(tmp_path / "nope")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "not a run folder" in proc.stderr and "nope" in proc.stderr


def test_serve_refreshes_the_page_while_the_run_writes(tiny_run, browser, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    server = report.make_server([run], tmp_path / "live.html", port=0, interval=0.2, max_levels=None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        page = Page(browser, url)
        assert "2 step(s) logged" in page.page.locator("header").inner_text()
        version = urllib.request.urlopen(url + "version").read().decode()
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 3, "train/reward/mean": 0.5}) + "\n")
        assert urllib.request.urlopen(url + "version").read().decode() != version
        page.page.wait_for_function("document.querySelector('header').innerText.includes('3 step(s) logged')",
                                    timeout=20_000)
        assert page.errors == []
        assert {u.split("/")[2] for u in page.requests} == {f"127.0.0.1:{server.server_address[1]}"}
    finally:
        server.shutdown()
        server.server_close()


def test_distinct_ngrams():
    assert distinct_ngrams(["a b c", "a b d"], 2) == pytest.approx(3 / 4)  # (a b) twice, (b c), (b d)
    assert distinct_ngrams(["Go up now", "go UP now"], 1) == pytest.approx(3 / 6)  # case-insensitive
    assert distinct_ngrams(["x", ""], 2) is None  # no bigram at all
    records = [
        {"tag": "SimpleSokoban", "turns": [{"think": "push the box up"}, {"think": "push the box up"}]},
        {"tag": "SimpleSokoban", "turns": [{"think": ""}]},
        {"tag": "Bandit", "turns": [{"think": "dragon is strong"}]},
        {"tag": "FrozenLake", "turns": [{"think": ""}]},
    ]
    assert think_diversity_metrics(records, "val-env") == {
        "val-env/SimpleSokoban/think_distinct_2gram": pytest.approx(3 / 6),
        "val-env/Bandit/think_distinct_2gram": 1.0,
    }


def test_max_levels_keeps_the_first_levels_of_each_env(tmp_path):
    turn = {"observation": "State:\nP_G\nYou have 3 actions left.", "think": "go right", "answer": "Right",
            "actions": ["Right"], "reward": 1.0, "format_error": False, "response": "go right</think>"}
    records = [{"tag": tag, "group": g, "seed": 123 + g, "success": True, "env_reward": 1.0, "format_penalty_sum": 0.0,
                "num_actions": 1, "turns": [turn]} for g, tag in enumerate(["FrozenLake"] * 3 + ["Bandit"])]
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "step_5.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run,) = report.build_data([tmp_path], max_levels=2)["runs"]
    assert [(t["tag"], t["group"]) for t in run["trajectories"]] == [("FrozenLake", 0), ("FrozenLake", 1), ("Bandit", 3)]
    assert run["trajectories"][0]["turns"][0]["state"] == "P_G"
    assert "step 5: showing 3 of 4 trajectories" in " ".join(run["notes"])
    assert run["diversity"]["5"]["FrozenLake"]["texts"] == 3  # measured over every level, not only those shown
