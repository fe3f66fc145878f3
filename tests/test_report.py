"""``python -m experiments.report``: a tiny real run's report opened in a real headless browser
(Debian's chromium, driven by playwright; no browser download), malformed and partial inputs, and
``--serve`` refreshing while a run writes."""

import json
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

import envs_jax
from envs_jax.base import GridEnv, TextEnv
from envs_jax.sokoban import Sokoban
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
        self.requests: list[str] = []
        self.errors: list[str] = []
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

    # The training samples (train/step_N.jsonl, trainer.log_trajectories=1): a section of their own.
    samples = {int(f.stem.split("_")[1]): read_jsonl(f) for f in (tiny_run / "train").glob("step_*.jsonl")}
    assert sorted(samples) == [1, 2] and [len(samples[s]) for s in (1, 2)] == [1, 1]
    train_cards = page.articles("#training")
    assert train_cards.count() == 2
    for i, step in enumerate((1, 2)):
        (record,) = samples[step]
        card = train_cards.nth(i)
        assert card.get_attribute("data-step") == str(step) and card.get_attribute("data-kind") == "train"
        assert card.get_attribute("data-tag") == record["tag"] and record["seed"] is None
        assert card.locator(".turn").count() == len(record["turns"]) > 0
        assert card.locator(".badge.kind-train").text_content() == "training sample"

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
        f.write('{"step": 3, "train/rew\n')  # a broken line among complete ones: a gap in the curves
        f.write(json.dumps({"step": 4, "train/reward/mean": 0.1, "collapse/warning": 1.0}) + "\n")
        f.write('{"step": 5, "train/reward/me')
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
            "with the board falling) at step(s) 4.") in notes
    marks = page.page.locator("#curves line.collapse")
    assert marks.count() > 0 and marks.first.locator("title").text_content() == "collapse warning at step 4 (writing)"
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


@pytest.mark.parametrize("args, message", [
    (["--port", "-5"], "--port must be in 0..65535, not -5"),
    (["--interval", "0"], "--interval must be positive, not 0"),
])
def test_bad_serve_flags_are_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        report.main([str(tmp_path), "--serve", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err


def test_a_taken_port_is_one_line(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert report.main([str(tmp_path), "--serve", "--port", str(port), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --port {port} cannot be opened") and len(err.splitlines()) == 1


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


# ---- what the page says of envs and replies: synthetic runs, no training -------------------------


def turn_of(response, format_error, state="P_G", actions=(), reward=0.0):
    return {"observation": f"State:\n{state}\nYou have 3 actions left.", "response": response, "think": "",
            "answer": "", "actions": list(actions), "format_error": format_error, "reward": reward}


def write_dump(run_dir, step, records, folder="val"):
    """``<folder>/step_<step>.jsonl``: validation levels have seeds, training samples (``train``) none."""
    (run_dir / folder).mkdir(parents=True, exist_ok=True)
    full = [{"group": g, "seed": 123 + g if folder == "val" else None, "env_reward": 0.0, "format_penalty_sum": 0.0,
             "num_actions": 0} | r for g, r in enumerate(records)]
    (run_dir / folder / f"step_{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full))


BANDIT_STATE = "1. There are 2 arms, named Phoenix and Dragon\n2. Each arm has its own reward distribution."


def test_format_failures_say_why_by_the_rollouts_parser(tmp_path, browser):
    """A penalised turn says why, from its recorded reply parsed by ``parse_response_text``: no
    closing tag, not an action name (the env's, Bandit's arms included), or no answer."""
    turns = [
        turn_of("go left</think><answer>Left", True),  # </answer> never comes
        turn_of("hmm</think><answer>Jump || Left</answer>", True, actions=["Left"]),
        turn_of("hmm</think> <answer> </answer>", True),
        turn_of("ok</think><answer>Left</answer>", False, actions=["Left"]),
    ]
    write_dump(tmp_path, 1, [{"tag": "FrozenLake", "success": False, "turns": turns},
                             {"tag": "Bandit", "success": False, "turns": [
                                 turn_of("</think><answer>Tiger</answer>", True, BANDIT_STATE)]}])
    (run,) = report.build_data([tmp_path])["runs"]
    lake, bandit = run["trajectories"]
    assert [t["why"] for t in lake["turns"]] == [
        "no closing tag: the reply never completes <think>…</think><answer>…</answer>",
        "not an action name: 'Jump'", "empty answer: no action", ""]
    assert bandit["turns"][0]["why"] == "not an action name: 'Tiger'"

    out = tmp_path / "r.html"
    report.write_report([tmp_path], out)
    page = Page(browser, out.as_uri())
    whys = page.articles().first.locator(".format-why")
    assert whys.count() == 3 and whys.nth(1).text_content() == "not an action name: 'Jump'"
    assert page.errors == []

    # config.json's rollout settings are the parser's: without thinking, "<answer>" alone is the format
    (tmp_path / "config.json").write_text(json.dumps({"rollout": {"enable_think": False}}))
    (run,) = report.build_data([tmp_path])["runs"]
    assert run["trajectories"][0]["turns"][0]["why"] == "no closing tag: the reply never completes <answer>…</answer>"
    assert run["trajectories"][1]["turns"][0]["why"] == "not an action name: 'Tiger'"


def test_training_samples_are_drawn_beside_the_validation_ones(tmp_path, browser):
    """``train/step_N.jsonl`` (the first ``trainer.log_trajectories`` trajectories of a training step,
    validation's records without a level seed) are drawn by the same code in a section of their own,
    labelled as training samples and filtered by step; ``--serve`` notices a new one; a run from before
    them (no ``train/``) still renders."""
    write_dump(tmp_path, 0, [{"tag": "FrozenLake", "success": False, "turns": [turn_of("validation reply", False)]}])
    write_dump(tmp_path, 1, [
        {"tag": "FrozenLake", "success": True, "env_reward": 1.0, "num_actions": 1,
         "turns": [turn_of("step one</think><answer>Right</answer>", False, "P_G", ["Right"], 1.0)]},
        {"tag": "Bandit", "success": False, "turns": [turn_of("</think><answer>Tiger</answer>", True, BANDIT_STATE)]}],
        folder="train")
    write_dump(tmp_path, 2, [{"tag": "FrozenLake", "success": False, "turns": [turn_of("step two</think>", True)]}],
               folder="train")
    signature = report.inputs_signature([tmp_path])
    (run,) = report.build_data([tmp_path])["runs"]
    assert [(t["kind"], t["step"]) for t in run["trajectories"]] == [("val", 0)]
    train = run["train_trajectories"]
    assert [(t["kind"], t["step"], t["tag"], t["seed"]) for t in train] == [
        ("train", 1, "FrozenLake", None), ("train", 1, "Bandit", None), ("train", 2, "FrozenLake", None)]
    assert train[1]["turns"][0]["why"] == "not an action name: 'Tiger'"
    assert train[2]["turns"][0]["why"] == "no closing tag: the reply never completes <think>…</think><answer>…</answer>"

    out = tmp_path / "r.html"
    report.write_report([tmp_path], out)
    page = Page(browser, out.as_uri())
    p = page.page
    assert page.articles().count() == 1 and p.locator("#trajectories .badge.kind-train").count() == 0
    section = p.locator("#training")
    assert section.locator("h2").text_content() == "Trajectories (training samples)"
    assert "not the fixed validation levels" in section.locator("p.about").text_content()
    cards = page.articles("#training")
    assert cards.count() == 3
    first = cards.first
    assert first.locator(".badge.kind-train").text_content() == "training sample"
    assert "training step 1" in first.inner_text() and "group 0" in first.inner_text()
    assert not any("level seed" in cards.nth(i).inner_text() for i in range(3))
    assert "step one</think><answer>Right</answer>" in first.locator("details.raw pre").text_content()
    assert cards.nth(1).locator(".format-why").text_content() == "not an action name: 'Tiger'"
    page.choose("tf-step", "2")  # pick a training step: its samples only
    assert cards.count() == 1 and cards.first.get_attribute("data-step") == "2"
    assert cards.first.locator(".format-why").text_content().startswith("no closing tag")
    assert page.articles().count() == 1  # the validation section's filters are its own
    page.choose("tf-step", "all")
    page.choose("tf-env", "Bandit")
    assert cards.count() == 1 and cards.first.get_attribute("data-tag") == "Bandit"
    assert "3 training samples" in p.locator("header").inner_text()
    assert p.locator('nav a[href="#training"]').count() == 1
    assert page.errors == []

    with (tmp_path / "train" / "step_2.jsonl").open("a") as f:  # a run writing its next training dump
        f.write(json.dumps(train[0] | {"turns": []}) + "\n")
    assert report.inputs_signature([tmp_path]) != signature

    shutil.rmtree(tmp_path / "train")  # a run from before training samples were dumped
    (run,) = report.build_data([tmp_path])["runs"]
    assert run["train_trajectories"] == [] and len(run["trajectories"]) == 1
    report.write_report([tmp_path], out)
    page = Page(browser, out.as_uri())
    assert page.articles("#training").count() == 0 and page.articles().count() == 1
    assert "No training samples to show" in page.page.locator("#training .note").text_content()
    assert "training samples" not in page.page.locator("header ul.runs").inner_text()
    assert page.errors == []


def test_the_page_says_what_success_means_in_each_env(tmp_path, browser):
    """From the env's contract (``success_meaning``): a Bandit pull of the safe arm pays 0.1 and is a
    failure, and the page says why."""
    write_dump(tmp_path, 1, [
        {"tag": "Bandit", "success": False, "env_reward": 0.1, "num_actions": 1,
         "turns": [turn_of("</think><answer>Phoenix</answer>", False, BANDIT_STATE, ["Phoenix"], 0.1)]},
        {"tag": "FrozenLake", "success": True, "env_reward": 1.0, "turns": [turn_of("", False, "P_G")]}])
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "val-env/Bandit/success": 0.0}) + "\n")
    (run,) = report.build_data([tmp_path])["runs"]
    bandit = envs_jax.make("Bandit")
    assert run["envs"]["Bandit"]["success"] == bandit.success_meaning
    assert "Dragon" in bandit.success_meaning and "0.1" in bandit.success_meaning
    assert run["envs"]["FrozenLake"]["success"] == "the player reaches the goal"

    out = tmp_path / "r.html"
    report.write_report([tmp_path], out)
    page = Page(browser, out.as_uri())
    p = page.page
    card = page.articles().first
    assert card.locator(".badge").text_content() == "failure" and "reward 0.1" in card.inner_text()
    assert card.locator(".badge").get_attribute("title") == f"success in Bandit: {bandit.success_meaning}"
    key = p.locator("#trajectories .success-key li")
    assert [key.nth(i).get_attribute("data-tag") for i in range(key.count())] == ["Bandit", "FrozenLake"]
    assert bandit.success_meaning in key.first.text_content()
    assert p.locator("#curves .panel .caption").first.text_content() == f"success: {bandit.success_meaning}"
    assert page.errors == []


def test_a_broken_training_line_leaves_the_validation_curve_whole(tmp_path, browser):
    """Validation every 2 steps, the training line of step 3 broken: the training curve breaks there,
    the validation curve (0, 2, 4: nothing of it lost) stays one line. A lost validation breaks it."""
    train, val = "train/reward/mean", "val-env/reward/mean"
    line = lambda step, key: json.dumps({"step": step, key: 0.1 * step})  # noqa: E731
    lines = [line(0, val), line(1, train), line(2, train), line(2, val), '{"step": 3, "train/rew', line(4, train),
             line(4, val), line(5, train), line(6, train), '{"step": 6, "val-env/rew', line(7, train), line(8, train),
             line(8, val)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run,) = report.build_data([tmp_path])["runs"]
    assert run["gaps"] == [[2, 4], [6, 7]]

    out = tmp_path / "r.html"
    report.write_report([tmp_path], out)
    page = Page(browser, out.as_uri())
    path = lambda key: page.page.locator(f'#curves path.series[data-key="{key}"]').first.get_attribute("d")  # noqa: E731
    assert path("train/reward/mean").count("M") == 2  # 1 2 | 4 5 6 7 8
    assert path("val-env/reward/mean").count("M") == 2  # 0 2 4 | 8: step 6's validation is the lost line
    assert path("val-env/reward/mean").count("L") == 2
    assert page.errors == []


def test_a_flat_series_gets_an_axis_around_its_value(tmp_path, browser):
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "train/reward/mean": 0.25, "actor/entropy_loss": 0.0}) + "\n" for s in range(1, 5)))
    out = tmp_path / "r.html"
    report.write_report([tmp_path], out)
    page = Page(browser, out.as_uri())
    for key, value in (("train/reward/mean", 0.25), ("actor/entropy_loss", 0.0)):
        panel = page.page.locator(f'#curves .panel:has(path.series[data-key="{key}"])').first
        y_ticks = [float(t) for t in panel.locator('text.tick[text-anchor="end"]').all_text_contents()]
        assert len(set(y_ticks)) >= 2 and min(y_ticks) < value < max(y_ticks), (key, y_ticks)
        ys = {float(d.split(" ")[1]) for d in panel.locator("path.series").get_attribute("d").replace("M", "L")
              .split("L")[1:]}
        (y,) = ys  # one height, inside the plot, not on its edge
        assert 10 + 20 < y < 230 - 34 - 20, (key, y)
    assert page.errors == []


class Warehouse(Sokoban):
    """A new grid env (a new class name): the report draws it from its symbol_meanings."""


def test_boards_draw_each_glyph_by_the_envs_symbol_meanings(tmp_path, monkeypatch):
    monkeypatch.setitem(envs_jax.VARIANTS, "Warehouse", (Warehouse, {"dim_room": (6, 6), "num_boxes": 1}))
    (tmp_path / "config.json").write_text(json.dumps(
        {"envs": {"overrides": {"Warehouse": {"grid_symbols": ["W", ".", "G", "C", "B", "A", "@"]}}}}))
    write_dump(tmp_path, 1, [{"tag": "Warehouse", "success": False, "turns": [turn_of("", False, "WWW\nWA.\nWWW")]}])
    (run,) = report.build_data([tmp_path])["runs"]
    assert run["envs"]["Warehouse"]["board"] == {"kind": "grid", "roles": {
        "W": "wall", ".": "empty", "G": "target", "C": "box_on_target", "B": "box", "A": "player",
        "@": "player_on_target"}}
    assert report.board_spec(envs_jax.make("FrozenLake"))["roles"] == dict(zip(
        "P_OGX√", ("player", "empty", "hole", "goal", "player_in_hole", "player_on_goal")))


def test_every_shipped_env_says_what_success_means_and_what_its_symbols_are():
    """What the report reads from the env contract: ``success_meaning`` (each shipped env its own, an
    env that declares none the base class's default) and, for grid envs, a meaning per glyph."""
    for name in sorted(envs_jax.VARIANTS):
        env = envs_jax.make(name)
        assert env.success_meaning and env.success_meaning != TextEnv.success_meaning, name
        if isinstance(env, GridEnv):
            assert len(env.symbol_meanings) == len(env.symbols), name
    assert "success" in TextEnv.success_meaning
