"""Countdown: tasks drawn in JAX or read from a file as RAGEN filters them, RAGEN's observation text
and its pieces, answers scored from their bytes, exact prompt tokens."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs_jax.countdown import Countdown, has_solution
from envs_jax.countdown_score import ragen_score
from helpers import TINY_MODEL_FLAGS, command_env
from starpo_jax.rollout import prompts as P
from starpo_jax.runtime.contract import EnvContractError, check_env


@pytest.fixture(scope="module")
def env():
    return Countdown()


@pytest.fixture(scope="module")
def states(env):
    return jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(0), 64))[0]


def row(states, i):
    return jax.tree.map(lambda x: x[i], states)


def answer(text: str, width: int = 64):
    data = np.zeros(width, np.uint8)
    data[: len(text)] = list(text.encode())
    return jnp.asarray(data), jnp.int32(len(text))


def task_of(state):
    return [int(n) for n in np.asarray(state.nums)[: int(state.num_count)]], int(state.target)


def test_drawn_tasks_are_solvable_with_signs_like_ragens(states):
    counts = np.asarray(states.num_count)
    assert set(counts.tolist()) == {3, 4}
    for i in range(64):
        nums, target = task_of(row(states, i))
        assert has_solution(nums, target) and 1 <= target <= 99 and all(1 <= n <= 99 for n in nums)


def test_observation_text_and_pieces(env, states):
    state = row(states, 0)
    nums, target = task_of(state)
    assert env.render_text(state) == f"Target: {target}, nums: {nums}"  # the list as Python prints it
    for i in range(16):
        s = row(states, i)
        pieces = np.asarray(env.observation_pieces(s))
        assert "".join(env.piece_texts[p] for p in pieces if p >= 0) == env.render_text(s) + "\n"


def test_answers_are_scored_from_their_bytes(env, states):
    step = jax.jit(env.step)
    for i in range(8):
        state = row(states, i)
        nums, target = task_of(state)
        # The sign solution RAGEN's filter guarantees, found by brute force.
        signs = next(s for s in np.ndindex(*(2,) * len(nums)) if sum((1 - 2 * b) * n for b, n in zip(s, nums)) == target)
        right = " ".join(("- " if b else "+ ") + str(n) for b, n in zip(signs, nums)).lstrip("+ ")
        for text in (right, " + ".join(map(str, nums)) + " + 0", "(" + right, str(nums[0])):
            after, ts = step(state, answer(text))
            want = ragen_score(text, nums, target)
            assert float(ts.reward) == pytest.approx(want), text
            assert bool(ts.extras["success"]) == (want == 1.0) and int(ts.step_type) == 2
            assert env.render_text(after) == f"Your answer get {want} points."
            pieces = np.asarray(env.observation_pieces(after))
            assert "".join(env.piece_texts[p] for p in pieces if p >= 0) == env.render_text(after) + "\n"


def test_tasks_from_a_file_follow_ragens_rows(tmp_path):
    rows = [
        {"target": 4, "nums": [3, 5, 2]},
        {"target": 24, "nums": [2, 3, 4]},  # only 2 * 3 * 4: not +- solvable, dropped as RAGEN does
        {"target": 10, "nums": [1, 2, 3, 4]},
        {"target": 7, "nums": [9, 1, 1]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    env = Countdown(tasks=str(path), max_instances=3)  # the first 3 rows, then the filter
    assert [task_of(env.reset_from_seed(s)) for s in range(3)] == [([3, 5, 2], 4), ([1, 2, 3, 4], 10), ([3, 5, 2], 4)]
    drawn = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(1), 16))[0]
    assert {tuple(task_of(row(drawn, i))[0]) for i in range(16)} == {(3, 5, 2), (1, 2, 3, 4)}
    as_json = tmp_path / "train.json"
    as_json.write_text(json.dumps(rows))
    assert task_of(Countdown(tasks=str(as_json)).reset_from_seed(1)) == ([1, 2, 3, 4], 10)


def test_bad_task_sources_are_one_clear_error(tmp_path, monkeypatch):
    from huggingface_hub import constants

    with pytest.raises(ValueError, match="does not exist"):
        Countdown(tasks=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"target": 5}))
    with pytest.raises(ValueError, match="row 0 needs integer 'target' and a 'nums' list"):
        Countdown(tasks=str(bad))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # a cached copy must not hide the error
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once, as offline
    with pytest.raises(ValueError, match="Could not download .* offline, download it elsewhere and pass the local file"):
        Countdown(tasks="hub:Jiayi-Pan/Countdown-Tasks-3to4")


@pytest.mark.parametrize("which", ["qwen", "smollm2"])
def test_prompt_tokens_equal_tokenized_chat(which, request, env, states):
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    template = P.CHATML_TEMPLATE if which == "qwen" else None
    tables = P.PromptTables.build(
        tokenizer, env, max_actions_per_traj=1, max_actions_per_turn=1, max_turn=1, chat_template=template
    )
    prefix = P.env_instruction(env, 1)
    assert prefix.startswith("You are solving the Countdown puzzle.") and "available actions" not in prefix
    pieces = jax.vmap(env.observation_pieces)(states)
    ids, lengths = jax.jit(jax.vmap(P.first_prompt_tokens, in_axes=(None, 0, None)))(tables, pieces, 1)
    for b in range(16):
        history = [{"state": env.render_text(row(states, b)), "actions_left": 1}]
        text = P.chat_text(tokenizer, P.build_messages(history, prefix, 100, True), True, True, template)
        assert np.asarray(ids[b, : lengths[b]]).tolist() == tokenizer(text)["input_ids"], b


def test_contract_accepts_language_actions_and_names_a_bad_declaration(env):
    check_env(env, "Countdown")
    from configs import base
    from starpo_jax.runtime.experiment import rollout_plan

    config = base.with_overrides(base.get_config(), {"envs.train.tags": ("Countdown",)})
    assert rollout_plan(config, "train").answer_width == env.answer_width == 64

    class Named(Countdown):
        action_names = ("add", "sub")

    with pytest.raises(EnvContractError, match="language-action env declares answer_width > 0 .* and no action names"):
        check_env(Named(), "Named")


TINY_RUN = [
    "--config=configs/countdown.py",
    *TINY_MODEL_FLAGS,
    "--config.envs.train.n_groups=(2,)",
    "--config.envs.train.group_size=2",
    "--config.envs.val.n_groups=(2,)",
    "--config.rollout.response_length=6",
    "--config.rollout.max_model_len=512",
    "--config.filter.ratio=0.5",
    "--config.actor.ppo_mini_batch_size=2",
    "--config.actor.micro_batch_size=2",
    "--config.trainer.total_steps=1",
    "--config.trainer.test_freq=1",
    "--config.trainer.save_freq=-1",
    "--config.trainer.log_trajectories=1",
    "--config.trainer.export_hf=False",
]


def test_a_training_step_on_countdown_through_the_run_entry_point(tmp_path):
    """``python -m experiments.run --config configs/countdown.py`` trains a tiny random model for a
    step and validates it: Countdown's metrics and dumped trajectories (its task as the observation)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = command_env(devices=1)
    proc = subprocess.run([sys.executable, "-m", "experiments.run", *TINY_RUN, f"--config.trainer.output_dir={tmp_path}"],
                          cwd=repo, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/Countdown/success" in r]
    assert [r["step"] for r in train] == [1] and np.isfinite(train[0]["actor/grad_norm"])
    assert [r["step"] for r in rows if "val-env/Countdown/success" in r] == [0, 1]
    dump = [json.loads(line) for line in (tmp_path / "val" / "step_1.jsonl").read_text().splitlines()]
    assert len(dump) == 2 and all(len(d["turns"]) == 1 for d in dump)
    assert "Target: " in dump[0]["turns"][0]["observation"] and ", nums: [" in dump[0]["turns"][0]["observation"]


def test_evaluate_the_bundled_model_on_countdown(tmp_path):
    """``experiments.evaluate --suite countdown`` like the other suites: RAGEN's fixed tasks."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", "--model", "smollm2-135m-instruct", "--suite", "countdown",
         "--levels", "2", "--batch", "2", "--max-turn", "1", "--response-length", "16", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=900,
        env=command_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["Countdown"] and results["Countdown"]["levels"] == 2
    assert "Countdown" in proc.stdout and "success %" in proc.stdout
