import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.utils import seeding

import envs_jax
from envs_jax.bandit import Bandit, BanditState
from starpo_jax.rollout import prompts
from starpo_jax.rollout.env_turn import execute_turn

# The observation (ragen-reference.md §1.2), written out by hand: trailing spaces after "pull." and
# "Rules:", a newline after every line.
DRAGON_FIRST_PROMPT = """\
You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. 
Game Rules: 
1. There are 2 arms, named Dragon and Phoenix
2. Each arm has its own reward distribution, related to their names. 
3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.
4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher rewards on average? Choose between Dragon and Phoenix, and output like <answer> Dragon </answer> or <answer> Phoenix </answer>.
"""


@pytest.fixture(scope="module")
def env():
    return envs_jax.make("Bandit")


def state(hi_first: bool, seed: int = 0) -> BanditState:
    return BanditState(hi_first=jnp.asarray(hi_first), key=jax.random.PRNGKey(seed))


@pytest.mark.parametrize("seed", [123, 124])
def test_golden_arm_order_and_prompt(env, seed):
    s = env.reset_from_seed(seed)
    assert env.arm_names(s) == ("Dragon", "Phoenix")
    assert bool(env.first_is_hi(s))
    assert env.render_text(s) == DRAGON_FIRST_PROMPT


def test_reset_from_seed_follows_first_draw(env):
    # A seed whose first draw is below 0.5 puts the safe arm first.
    seed = next(s for s in range(100) if seeding.np_random(s)[0].random() < 0.5)
    s = env.reset_from_seed(seed)
    assert env.arm_names(s) == ("Phoenix", "Dragon")
    assert "named Phoenix and Dragon\n" in env.render_text(s)


def test_golden_step_with_ragens_draw(env):
    # RAGEN: reset(124) then step(1) -> ("Dragon: 0.0 points", 0.0, True, success=True). RAGEN's
    # action 1 is our action 0; its payout draw is gymnasium's second draw of seed 124.
    s = env.reset_from_seed(124)
    rng = seeding.np_random(124)[0]
    rng.random()
    reward = env.payout(env.action_is_hi(s, 0), rng.random())
    assert float(reward) == 0.0
    _, ts = env.step(s, 0)
    assert bool(ts.extras["success"]) and ts.last() and float(ts.discount) == 0.0


def test_payout_rule(env):
    assert float(env.payout(True, 0.2499)) == 1.0
    assert float(env.payout(True, 0.25)) == 0.0
    assert float(env.payout(False, 0.0)) == pytest.approx(0.1)
    assert float(env.payout(False, 0.99)) == pytest.approx(0.1)


def test_a_pulls_reward_message_prints_the_configured_payout():
    """The rollout's path from a pull to its reward message: the float32 step reward becomes its
    category among ``step_reward_values`` (``execute_turn``), and the message prints that Python
    float, so 0.3 reads ``0.3``, not float32's ``0.30000001192092896``."""
    env = envs_jax.make("Bandit", lo_arm_score=0.3)
    values = env.step_reward_values
    pull = jax.jit(jax.vmap(
        lambda s, a: execute_turn(env, s, a[None], 1, 1, True, jnp.asarray(values, jnp.float32))[1]
    ))
    states = BanditState(hi_first=jnp.ones(32, bool), key=jax.random.split(jax.random.PRNGKey(0), 32))
    for action, payouts in ((1, {0.3}), (0, {0.0, 1.0})):  # Phoenix (safe), Dragon (risky)
        turns = pull(states, jnp.full(32, action))
        messages = [prompts.reward_text(prompts.reward_sequence_of_index(int(k), values, 1)) for k in turns.reward_index]
        paid = [next(p for p in payouts if np.float32(p) == r) for r in np.asarray(turns.reward)]
        assert messages == [f"Reward:\n{p}\n" for p in paid]
        assert set(paid) == payouts  # the risky arm's 32 pulls paid both ways


def test_payout_frequencies_vmapped(env):
    n = 20_000
    keys = jax.random.split(jax.random.PRNGKey(1), n)
    hi_first = jnp.arange(n) % 2 == 0
    states = BanditState(hi_first=hi_first, key=keys)
    step = jax.jit(jax.vmap(env.step))
    # Pull the risky arm in every row (its action id depends on the row's arm order).
    _, hi = step(states, jnp.where(hi_first, 0, 1))
    _, lo = step(states, jnp.where(hi_first, 1, 0))
    hi_rewards = np.asarray(hi.reward)
    assert set(np.unique(hi_rewards)) == {0.0, 1.0}
    sigma = np.sqrt(0.25 * 0.75 / n)
    assert abs(hi_rewards.mean() - 0.25) < 5 * sigma
    np.testing.assert_allclose(np.asarray(lo.reward), 0.1, rtol=1e-6)
    assert np.asarray(hi.extras["success"]).all() and not np.asarray(lo.extras["success"]).any()
    assert np.asarray(hi.last()).all() and (np.asarray(hi.discount) == 0).all()


def test_reset_order_is_a_fair_coin_and_deterministic(env):
    n = 20_000
    keys = jax.random.split(jax.random.PRNGKey(2), n)
    states, ts = jax.jit(jax.vmap(env.reset))(keys)
    share = np.asarray(states.hi_first).mean()
    assert abs(share - 0.5) < 5 * np.sqrt(0.25 / n)
    assert (np.asarray(ts.first())).all()
    again, _ = jax.jit(jax.vmap(env.reset))(keys)
    np.testing.assert_array_equal(np.asarray(states.hi_first), np.asarray(again.hi_first))
    np.testing.assert_array_equal(np.asarray(states.key), np.asarray(again.key))


def test_same_key_same_payout(env):
    s = state(hi_first=True, seed=7)
    a, ta = env.step(s, 0)
    b, tb = env.step(s, 0)
    assert float(ta.reward) == float(tb.reward)
    np.testing.assert_array_equal(np.asarray(a.key), np.asarray(b.key))
    assert not np.array_equal(np.asarray(a.key), np.asarray(s.key))  # the key advances


def test_action_names_follow_the_episodes_arm_order(env):
    assert env.action_names == ("Phoenix", "Dragon")  # every name; the episode picks the order
    for hi_first in (False, True):
        s = state(hi_first)
        ids = jax.jit(env.action_name_ids)(s)
        assert tuple(env.action_names[int(i)] for i in ids) == env.arm_names(s)
        assert env.render_text(s).count(f"named {env.arm_names(s)[0]} and") == 1
        assert env.piece_texts[int(env.observation_pieces(s)[0])] == env.render_text(s) + "\n"
        assert bool(env.action_is_hi(s, 0)) == hi_first
    assert env.lo_hi_names == ("Phoenix", "Dragon")
    test_env = envs_jax.make("BanditTest")
    assert test_env.arm_names(state(hi_first=False)) == ("Trader", "Librarian")
    with pytest.raises(ValueError, match="must differ"):
        Bandit(lo_arm_name="Dragon", hi_arm_name="dragon")
