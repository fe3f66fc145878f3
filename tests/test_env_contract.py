"""The environment contract: a user's env from a file outside the package (docs/examples/guess_digit.py,
the code docs/environments.md shows) registers, builds exact prompts and trains; broken envs get
one clear error."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs_jax
from helpers import TINY_MODEL, command_env, tiny_with
from starpo_jax.rollout import prompts as P
from starpo_jax.runtime.contract import EnvContractError, check_env

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples"
sys.path.insert(0, str(EXAMPLES))  # as a user's own package on the path

from guess_digit import PIECES, GuessDigit, GuessState  # noqa: E402


@pytest.fixture
def registry():
    """Registrations made by a test do not leak into others."""
    saved = dict(envs_jax.VARIANTS)
    yield
    envs_jax.VARIANTS.clear()
    envs_jax.VARIANTS.update(saved)


def test_register_and_class_path_build_the_same_env(registry):
    envs_jax.register("GuessDigit", GuessDigit)
    by_name = envs_jax.make("GuessDigit")
    by_path = envs_jax.make("guess_digit:GuessDigit")
    assert type(by_name) is type(by_path) is GuessDigit
    assert (by_name.name, by_path.name) == ("GuessDigit", "guess_digit:GuessDigit")
    check_env(by_name)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        envs_jax.make("no_such_module:Maze")
    with pytest.raises(ValueError, match="has no 'Maze'"):
        envs_jax.make("guess_digit:Maze")
    with pytest.raises(ValueError, match="Unknown env 'Maze'.*class path"):
        envs_jax.make("Maze")


def test_example_env_plays_by_its_text():
    env = GuessDigit()
    state = state0 = env.reset_from_seed(0)
    assert env.render_text(state) == "Guess the secret digit."
    secret = int(state.secret)
    wrong = (secret + 1) % 10
    state, ts = env.step(state, wrong)
    assert env.render_text(state) == f"Your guess {wrong} is too {'low' if wrong < secret else 'high'}."
    assert float(ts.reward) == 0.0 and int(ts.step_type) != 2
    _, ts = env.step(state0, secret)
    assert float(ts.reward) == 1.0 and bool(ts.extras["success"]) and int(ts.step_type) == 2


@pytest.mark.parametrize("which", ["qwen", "smollm2"])
def test_example_env_prompt_tokens_equal_tokenized_chat(which, request):
    """The in-graph prompt of every observation equals the tokenizer's encoding of RAGEN's chat."""
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    template = P.CHATML_TEMPLATE if which == "qwen" else None
    env = GuessDigit()
    tables = P.PromptTables.build(
        tokenizer, env, max_actions_per_traj=4, max_actions_per_turn=2, max_turn=3, chat_template=template
    )
    prefix = P.env_instruction(env, 4)
    assert "Your available actions are:\n0, 1, 2, 3, 4, 5, 6, 7, 8, 9\nYou can make up to 4 actions" in prefix
    states = [env.reset_from_seed(0)] + [
        GuessState(secret=jnp.asarray(s), last_guess=jnp.asarray(g)) for s in (0, 5, 9) for g in range(10) if g != s
    ]
    first = jax.jit(jax.vmap(P.first_prompt_tokens, in_axes=(None, 0, None)))
    pieces = jnp.stack([env.observation_pieces(s) for s in states])
    ids, lengths = first(tables, pieces, 3)
    for b, state in enumerate(states):
        history = [{"state": env.render_text(state), "actions_left": 3}]
        text = P.chat_text(tokenizer, P.build_messages(history, prefix, 100, True), True, True, template)
        assert np.asarray(ids[b, : lengths[b]]).tolist() == tokenizer(text)["input_ids"], b


class NoPieces(GuessDigit):
    piece_texts = ()


class Clash(GuessDigit):
    action_names = ("Up", "UP", "Down", "Left", "Right", "a", "b", "c", "d", "e")


class TooNarrow(GuessDigit):
    """Drops the verdict: its pieces no longer spell its text."""

    def observation_pieces(self, state):
        return super().observation_pieces(state)[:2]


class Leaky(GuessDigit):
    """Charges -0.1 for a wrong guess, a reward its step_reward_values (0.0, 1.0) do not list."""

    def step(self, state, action):
        state, ts = super().step(state, action)
        return state, ts.replace(reward=jnp.where(ts.reward > 0, ts.reward, -0.1))


class FloatKey(GuessDigit):
    def state_key(self, state):
        return jnp.asarray(state.last_guess, jnp.float32)


class ConstantKey(GuessDigit):
    """Keys every state alike: GiGPO would compare turns from different positions as one step group."""

    def state_key(self, state):
        return jnp.uint32(0)


@pytest.mark.parametrize(
    "cls,message",
    [
        (NoPieces, "piece_texts, the table of observation pieces, is empty"),
        (Clash, "action names clash .*UP, Up"),
        (TooNarrow, "an observation wider than its 2 pieces"),
        (Leaky, r"'Broken' .* paid a step reward of -0\.1, which its step_reward_values \(0\.0, 1\.0\) do not list"),
        (FloatKey, r"state_key\(state\) must be a uint32 scalar, got float32\[\]"),
        (ConstantKey, (r"state_key gives the state after action \d from seed 0 and the state of seed 0 the same key 0, "
                       "but they show different observations")),
    ],
)
def test_contract_violations_are_one_clear_error(cls, message):
    with pytest.raises(EnvContractError, match=message):
        check_env(cls(), "Broken")


@pytest.mark.parametrize("name", sorted(envs_jax.VARIANTS))
def test_every_shipped_env_keeps_the_contract(name):
    """Each registered env, state_key included (its default, a hash of the observation pieces)."""
    check_env(envs_jax.make(name), name)


class BadCut(GuessDigit):
    """Spells the same text as GuessDigit, but cut between " 5 " and "is too low.": " is" is one token."""

    piece_texts = (PIECES[0], "Your guess", *(f" {d} " for d in range(10)), "is too low.\n", "is too high.\n")


def test_a_bad_piece_cut_stops_the_run_in_one_sentence(registry):
    """The tables' cut check names the env, both pieces and the token; the run reports it as a
    config error (exit status 2 in experiments.run)."""
    from configs import base
    from starpo_jax.runtime.experiment import ConfigError, build_experiment
    from starpo_jax.runtime.planning import abstract_policy

    envs_jax.register("BadCut", BadCut)
    check_env(envs_jax.make("BadCut"))  # its pieces spell its text: only the tokenizer sees the cut
    config = base.with_overrides(base.get_config(), {
        **TINY_MODEL, "envs.train.tags": ("BadCut",), "envs.train.n_groups": (2,), "envs.train.group_size": 2,
        "envs.val.tags": ("BadCut",), "envs.val.n_groups": (2,), "rollout.max_turn": 2, "filter.ratio": 1.0,
        "actor.ppo_mini_batch_size": 4, "actor.micro_batch_size": 2,
    })
    with pytest.raises(ConfigError, match=(
        r"^envs\.train\.tags: The prompt pieces ' \d ' and '\w[^']*' of env 'BadCut' do not tokenize apart: the "
        r"tokenizer encodes ' \w+' across the cut between them, .* for example ' \d' \+ ' \w[^']*'\.$"
    )):
        build_experiment(config, load=abstract_policy)


def test_missing_declarations_are_named_when_made(registry):
    from envs_jax.base import TextEnv

    class Bare(TextEnv):  # no action names, rewards, pieces, text, nor jumanji methods
        pass

    envs_jax.register("Bare", Bare)
    with pytest.raises(ValueError, match="does not declare .*action_names.*observation_pieces.*piece_texts"):
        envs_jax.make("Bare")


def test_documented_run_trains_the_example_env_for_a_step(tmp_path):
    """docs/environments.md's command: the class path in the config, nothing registered, one step."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "experiments.run",
            *tiny_with({
                "envs.train.tags": "('guess_digit:GuessDigit',)", "envs.train.n_groups": "(2,)",
                "envs.val.tags": "('guess_digit:GuessDigit',)", "rollout.max_model_len": 512,
                "trainer.total_steps": 1, "trainer.test_freq": 0, "trainer.save_freq": 0,
            }),
            f"--config.trainer.output_dir={tmp_path}",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env=command_env(PYTHONPATH=f"{REPO}:{EXAMPLES}"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = (tmp_path / "metrics.jsonl").read_text()
    assert '"train/guess_digit:GuessDigit/success"' in metrics


def test_the_documented_code_is_the_tested_file():
    """Every line of docs/environments.md's worked example (its blocks of the class) is a line of
    docs/examples/guess_digit.py."""
    import re

    doc = (REPO / "docs" / "environments.md").read_text()
    source = set((EXAMPLES / "guess_digit.py").read_text().splitlines())
    examples = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "class GuessDigit" in b]
    assert len(examples) == 2 and "def step(self, state, action):" in examples[1]
    for example in examples:
        assert [line for line in example.splitlines() if line.strip() and line not in source] == []


def test_the_documented_launcher_gives_the_env_a_short_name():
    """docs/examples/train_guess_digit.py registers "GuessDigit" before experiments.run reads the
    config: the tag resolves (the run then stops at a later check, costing no model load)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_guess_digit.py"), "--config=configs/base.py",
         "--config.envs.train.tags=('GuessDigit',)", "--config.envs.val.tags=('GuessDigit',)",
         "--config.trainer.resume=True", "--config.trainer.overwrite=True"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
             "PYTHONPATH": f"{REPO}:{EXAMPLES}"},
    )
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: trainer.resume and trainer.overwrite exclude each other; set one of them."), proc.stderr
