"""GiGPO (``starpo_jax.algo.advantages.gigpo``) against a plain-Python transcription of verl-agent's
``gigpo/core_gigpo.py`` on hand-built trajectories, and the env state key its step groups compare
(``TextEnv.state_key``, recorded per turn by the rollout as ``Trajectories.turn_state_key``)."""

import dataclasses
import uuid
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs_jax
from helpers import ScriptedResponder
from starpo_jax.algo import advantages
from starpo_jax.rollout.multi_turn import (
    RolloutPlan,
    TagPlan,
    build_tables,
    initial_states_from_key,
    initial_states_from_seeds,
    make_rollout,
    state_keys,
    stop_tokens_for,
)

# ---- the oracle: verl-agent's algorithm, one batch row per played turn, dicts keyed by anchor state ----


def oracle_gigpo(steps, gamma, step_weight, mode, cross_steps=False, eps=1e-6):
    """verl-agent's ``compute_gigpo_outcome_advantage`` on its flat batch: ``steps`` is one dict per
    played turn, in turn order within each trajectory, with ``uid`` (the level group), ``traj``,
    ``anchor`` (the observation the turn starts from), ``reward`` (the turn's env reward) and
    ``score`` (the trajectory's outcome). Returns each step's advantage, float64.

    ``cross_steps`` is verl-agent's ``compute_mean_std_cross_steps`` (its default True: a
    trajectory's score enters its group once per step); starpo-jax's episode level is GRPO's, one
    score per trajectory, which is verl-agent's False."""
    n = len(steps)
    remove_std = {"mean_norm": True, "mean_std_norm": False}[mode]

    # compute_step_discounted_returns: per trajectory, back to front
    returns = np.zeros(n)
    by_traj = defaultdict(list)
    for i, s in enumerate(steps):
        by_traj[s["traj"]].append(i)
    for rows in by_traj.values():
        running = 0.0
        for i in reversed(rows):
            running = steps[i]["reward"] + gamma * running
            returns[i] = running

    # episode_norm_reward
    id2score, seen = defaultdict(list), set()
    for s in steps:
        if (s["uid"], s["traj"]) in seen:
            continue
        id2score[s["uid"]].append(s["score"])
        if not cross_steps:
            seen.add((s["uid"], s["traj"]))
    id2mean, id2std = {}, {}
    for uid, scores in id2score.items():
        if len(scores) == 1:
            id2mean[uid], id2std[uid] = 0.0, 1.0
        else:
            id2mean[uid], id2std[uid] = np.mean(scores), np.std(scores, ddof=1)
    episode = np.array([
        s["score"] - id2mean[s["uid"]] if remove_std else (s["score"] - id2mean[s["uid"]]) / (id2std[s["uid"]] + eps)
        for s in steps
    ])

    # build_step_group: identical anchors within one uid form a step group (a fresh uuid each)
    step_group: list[str | None] = [None] * n
    for uid in {s["uid"] for s in steps}:
        clusters = defaultdict(list)
        for i, s in enumerate(steps):
            if s["uid"] == uid:
                clusters[s["anchor"]].append(i)
        for members in clusters.values():
            name = str(uuid.uuid4())
            for i in members:
                step_group[i] = name

    # step_norm_reward: a singleton's mean is its own return and its std 1
    id2ret: defaultdict[str | None, list[float]] = defaultdict(list)
    for i in range(n):
        id2ret[step_group[i]].append(returns[i])
    step_mean = {g: np.mean(v) for g, v in id2ret.items()}
    step_std = {g: 1.0 if len(v) == 1 else np.std(v, ddof=1) for g, v in id2ret.items()}
    step = np.array([
        returns[i] - step_mean[step_group[i]] if remove_std
        else (returns[i] - step_mean[step_group[i]]) / (step_std[step_group[i]] + eps)
        for i in range(n)
    ])
    return episode + step_weight * step


# ---- hand-built trajectories ----------------------------------------------------------------------

T, L = 4, 64


def build(rows, seed=0):
    """Arrays for ``advantages.gigpo`` and the oracle's steps from ``rows``: each a tuple
    ``(group, [(state key, turn reward), ...], score)``. A row is a 3-token prompt, then per turn
    a response of 2-4 policy tokens and 2 observation tokens."""
    rng = np.random.default_rng(seed)
    B = len(rows)
    arrays = {
        "score": np.zeros(B, np.float32), "turn_reward": np.zeros((B, T), np.float32),
        "turn_state_key": np.zeros((B, T), np.uint32), "turn_start": np.zeros((B, T), np.int32),
        "turn_end": np.zeros((B, T), np.int32), "turn_played": np.zeros((B, T), bool),
        "group_id": np.zeros(B, np.int32), "mask": np.zeros((B, L), bool),
    }
    steps = []
    for b, (group, turns, score) in enumerate(rows):
        arrays["score"][b], arrays["group_id"][b] = score, group
        position = 3
        for t, (key, reward) in enumerate(turns):
            length = int(rng.integers(2, 5))
            arrays["turn_start"][b, t], arrays["turn_end"][b, t] = position, position + length
            arrays["mask"][b, position:position + length] = True
            arrays["turn_reward"][b, t], arrays["turn_state_key"][b, t] = reward, key
            arrays["turn_played"][b, t] = True
            steps.append({"uid": group, "traj": b, "anchor": key, "reward": np.float32(reward),
                          "score": np.float32(score), "row": b, "turn": t})
            position += length + 2
    return {k: jnp.asarray(v) for k, v in arrays.items()}, steps


def run_gigpo(arrays, gamma, step_weight, mode, valid=None):
    adv, ret = advantages.gigpo(
        arrays["score"], arrays["turn_reward"], arrays["turn_state_key"], arrays["turn_start"], arrays["turn_end"],
        arrays["turn_played"], arrays["group_id"], arrays["mask"], gamma, step_weight,
        norm_by_std=mode == "mean_std_norm", valid=valid,
    )
    np.testing.assert_array_equal(adv, ret)  # verl-agent: returns = advantages
    return np.asarray(adv)


def per_turn(adv, arrays, steps):
    """Each step's advantage, read from its turn's tokens (all equal); nothing outside the mask."""
    mask = np.asarray(arrays["mask"])
    assert not np.any(adv[~mask])
    out = []
    for s in steps:
        b, t = s["row"], s["turn"]
        tokens = adv[b, int(arrays["turn_start"][b, t]):int(arrays["turn_end"][b, t])]
        np.testing.assert_array_equal(tokens, tokens[0])
        out.append(tokens[0])
    return np.array(out)


# Group 0: every row starts from state 7; state 11 is reached by three rows, row 1 comes back to 7
# (a step group with two turns of one row), 12, 13 and 5 are seen once or twice. Group 1 uses the
# same keys, which must not join group 0's step groups; row 5 meets state 12 twice in a row.
REPEATED = [
    (0, [(7, 0.0), (11, 0.0), (13, 1.0)], 0.9),
    (0, [(7, 0.0), (11, 0.5), (7, 0.0)], 0.4),
    (0, [(7, -0.1), (12, 1.0)], 0.8),
    (0, [(7, 0.0), (11, 0.0), (13, 0.0), (5, 1.0)], 1.0),
    (1, [(7, 1.0), (11, 0.0)], 1.0),
    (1, [(7, 0.0), (12, 0.0), (12, 1.0)], 0.9),
    (1, [(7, 0.3)], 0.3),
]
# Every state of each group is distinct, even the first (so no step group has two turns).
DISTINCT = [
    (0, [(1, 0.0), (2, 1.0)], 1.0),
    (0, [(3, 0.5), (4, 0.0), (5, 0.0)], 0.5),
    (0, [(6, 0.0)], -0.1),
    (1, [(1, 0.2), (2, 0.0)], 0.2),
    (1, [(7, 1.0)], 0.9),
]
SETTINGS = [(1.0, 1.0, "mean_norm"), (0.9, 0.5, "mean_norm"), (0.9, 1.0, "mean_std_norm"), (0.95, 2.0, "mean_std_norm")]


@pytest.mark.parametrize("gamma,step_weight,mode", SETTINGS)
def test_repeated_states_match_verl_agent(gamma, step_weight, mode):
    """(a) step groups of several turns, of several rows and of one row twice; (b) states seen once."""
    arrays, steps = build(REPEATED)
    adv = run_gigpo(arrays, gamma, step_weight, mode)
    expected = oracle_gigpo(steps, gamma, step_weight, mode)
    np.testing.assert_allclose(per_turn(adv, arrays, steps), expected, rtol=1e-5, atol=1e-6)
    # (b) a turn whose state its group saw once gets its episode advantage alone
    episode = oracle_gigpo(steps, gamma, 0.0, mode)
    once = [i for i, s in enumerate(steps) if sum(o["uid"] == s["uid"] and o["anchor"] == s["anchor"] for o in steps) == 1]
    assert len(once) == 3
    np.testing.assert_allclose(per_turn(adv, arrays, steps)[once], episode[once], rtol=1e-5, atol=1e-6)
    # and the step part does something elsewhere
    assert not np.allclose(expected, episode)


@pytest.mark.parametrize("gamma,step_weight,mode", SETTINGS)
def test_distinct_states_give_grpo(gamma, step_weight, mode):
    """(c) no two turns of a group start from one state: step advantage 0, GiGPO = GRPO."""
    arrays, steps = build(DISTINCT)
    adv = run_gigpo(arrays, gamma, step_weight, mode)
    np.testing.assert_allclose(per_turn(adv, arrays, steps), oracle_gigpo(steps, gamma, step_weight, mode),
                               rtol=1e-5, atol=1e-6)
    grpo, _ = advantages.grpo_outcome(arrays["score"], arrays["group_id"], arrays["mask"], mode == "mean_std_norm")
    np.testing.assert_array_equal(adv, np.asarray(grpo))


@pytest.mark.parametrize("gamma,step_weight,mode", SETTINGS)
def test_padding_rows_change_nothing(gamma, step_weight, mode):
    """(d) rows that are not ``valid`` (a compacted batch's padding) in both groups, with the real
    rows' states and wild rewards: the real rows' advantages are unchanged, theirs are 0."""
    padding = [
        (0, [(7, 50.0), (11, -30.0), (13, 9.0)], 100.0),
        (1, [(7, -20.0), (12, 40.0)], -100.0),
        (0, [(7, 3.0)], 7.0),
    ]
    arrays, _ = build(REPEATED)
    padded, _ = build(REPEATED + padding)
    # the same token layout for the real rows: build draws their lengths first
    np.testing.assert_array_equal(padded["mask"][: len(REPEATED)], arrays["mask"])
    valid = jnp.arange(len(REPEATED) + len(padding)) < len(REPEATED)
    padded["mask"] = padded["mask"] & valid[:, None]  # as train.py masks them (loss_mask & valid)
    alone = run_gigpo(arrays, gamma, step_weight, mode)
    with_padding = run_gigpo(padded, gamma, step_weight, mode, valid=valid)
    np.testing.assert_array_equal(with_padding[: len(REPEATED)], alone)
    assert not np.any(with_padding[len(REPEATED):])


def test_row_order_does_not_matter():
    """Groups are found by ``group_id``, not by position: shuffled rows give shuffled advantages."""
    arrays, _ = build(REPEATED)
    order = np.random.default_rng(1).permutation(len(REPEATED))
    shuffled = {k: v[order] for k, v in arrays.items()}
    np.testing.assert_allclose(run_gigpo(shuffled, 0.9, 1.0, "mean_std_norm"),
                               run_gigpo(arrays, 0.9, 1.0, "mean_std_norm")[order], rtol=1e-6, atol=1e-7)


def test_traced_gamma_and_weight_and_equal_turn_counts():
    """gamma and ω may be traced (a sweep varies them); with every trajectory as long, verl-agent's
    default episode statistics (each score counted once per step) have GRPO's mean, so under its
    default "mean_norm" the two agree."""
    rows = [
        (0, [(7, 0.0), (11, 0.0), (13, 1.0)], 1.0),
        (0, [(7, 0.0), (11, 0.5), (7, 0.0)], 0.5),
        (0, [(7, 0.0), (12, 0.0), (14, 0.0)], -0.1),
        (1, [(7, 1.0), (8, 0.0), (9, 0.0)], 1.0),
        (1, [(7, 0.0), (8, 0.0), (8, 0.2)], 0.2),
    ]
    arrays, steps = build(rows)
    fn = jax.jit(lambda a, gamma, w: advantages.gigpo(
        a["score"], a["turn_reward"], a["turn_state_key"], a["turn_start"], a["turn_end"], a["turn_played"],
        a["group_id"], a["mask"], gamma, w)[0])
    adv = np.asarray(fn(arrays, jnp.float32(0.8), jnp.float32(1.5)))
    expected = oracle_gigpo(steps, 0.8, 1.5, "mean_norm", cross_steps=True)
    np.testing.assert_allclose(per_turn(adv, arrays, steps), expected, rtol=1e-5, atol=1e-6)


def test_turn_returns_discount_over_the_remaining_turns():
    rewards = jnp.array([[0.0, 0.5, 1.0, 9.0], [2.0, 0.0, 0.0, 0.0]])
    played = jnp.array([[True, True, True, False], [True, False, False, False]])
    np.testing.assert_allclose(advantages.turn_returns(rewards, played, 0.5),
                               [[0.5 * (0.5 + 0.5 * 1.0), 0.5 + 0.5 * 1.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]])


def test_gigpo_is_an_estimator_without_a_critic():
    assert "gigpo" in advantages.ESTIMATORS and "gigpo" not in advantages.CRITIC_ESTIMATORS


# ---- the state key ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frozen_lake():
    return envs_jax.make("FrozenLake")


@pytest.fixture(scope="module")
def sokoban():
    return envs_jax.make("SimpleSokoban")


def keys_of(env, states):
    return np.asarray(jax.jit(jax.vmap(env.state_key))(states))


def reset_batch(env, seeds):
    return jax.vmap(env.reset)(jnp.stack([jax.random.PRNGKey(s) for s in seeds]))[0]


@pytest.mark.parametrize("which", ["frozen_lake", "sokoban"])
def test_same_board_same_key_other_board_other_key(which, request):
    env = request.getfixturevalue(which)
    states = reset_batch(env, [0, 0, 1, 2])
    boards = np.asarray(jax.vmap(env.render_symbols)(states))
    keys = keys_of(env, states)
    assert keys.dtype == np.uint32
    assert keys[0] == keys[1]
    assert not np.array_equal(boards[0], boards[2]) and not np.array_equal(boards[0], boards[3])
    assert len({int(keys[0]), int(keys[2]), int(keys[3])}) == 3


def test_frozen_lake_key_ignores_the_slip_key_and_step_count(frozen_lake):
    """The state carries a slip key that changes every step: the key is the board's alone."""
    env = frozen_lake
    state = env.state_from_text("____\n_P__\n____\n___G")
    reseeded = state.replace(key=jax.random.PRNGKey(99))
    moved, _ = env.step_in_direction(state, 2)  # right, no slip: player at (1, 2), one step taken
    there = env.state_from_text("____\n__P_\n____\n___G")
    assert int(moved.step_count) != int(there.step_count)
    key = jax.jit(env.state_key)
    assert int(key(state)) == int(key(reseeded))
    assert int(key(moved)) == int(key(there)) != int(key(state))


def test_sokoban_key_is_the_board(sokoban):
    """Walking into a wall leaves the board (not the step count) as it was: same key; a move changes it."""
    env, step = sokoban, jax.jit(sokoban.step)
    state = env.reset_from_seed(10000)
    bumped, _ = step(state, 1)  # down, into the wall (tests/envs/test_sokoban.py)
    assert int(bumped.step_count) == 1
    moved, _ = step(state, 0)  # up
    key = jax.jit(env.state_key)
    assert int(key(bumped)) == int(key(state)) != int(key(moved))


def test_rollout_keys_every_row_by_its_own_env(frozen_lake, sokoban):
    """``state_keys``, what the rollout records per turn: each tag's rows keyed by its env, and the
    rows of a group (one level) share their first key."""
    plan = RolloutPlan(tags=(TagPlan("FrozenLake", frozen_lake, 2, 10), TagPlan("SimpleSokoban", sokoban, 2, 10)),
                       group_size=3, max_turn=2, max_actions_per_turn=2, response_length=8, max_len=256,
                       enable_think=False)
    init = initial_states_from_key(plan, jax.random.PRNGKey(0))
    keys = np.asarray(jax.jit(lambda s: state_keys(plan, s))(init))
    np.testing.assert_array_equal(keys, np.concatenate([keys_of(frozen_lake, init[0]), keys_of(sokoban, init[1])]))
    groups = keys.reshape(4, 3)
    assert np.all(groups == groups[:, :1]) and len(set(groups[:, 0].tolist())) == 4


def test_the_rollout_records_the_key_each_turn_starts_from(smollm2_tokenizer, sokoban):
    """Two rows of one SimpleSokoban level (seed 10001, solved by Right, Up, Left): row 0 plays
    Right, Up, Left and is done; row 1 first answers nothing (the board stays), then Right, Right
    (into the wall: the board stays again), Up. Each turn's key is the env's key of the board the
    turn starts from; a turn that is not played has 0."""
    env, tok = sokoban, smollm2_tokenizer
    plan = RolloutPlan(tags=(TagPlan("SimpleSokoban", env, 1, 10),), group_size=2, max_turn=4, max_actions_per_turn=1,
                       response_length=12, max_len=1024, enable_think=False)
    tables = build_tables(tok, plan)
    plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(tok, tables))
    stop = tables.tags[0].prompts.stop_token_id
    texts = [["<answer>Right</answer>", "<answer>Up</answer>", "<answer>Left</answer>", "<answer>Up</answer>"],
             ["nothing", "<answer>Right</answer>", "<answer>Right</answer>", "<answer>Up</answer>"]]
    script, lengths = np.zeros((2, 4, 12), np.int32), np.zeros((2, 4), np.int32)
    for b, turns in enumerate(texts):
        for t, text in enumerate(turns):
            ids = tok.encode(text, add_special_tokens=False) + [stop]
            script[b, t, :len(ids)], lengths[b, t] = ids, len(ids)
    traj = make_rollout(plan, ScriptedResponder(script, lengths))(None, tables, initial_states_from_seeds(plan, 10001),
                                                         jax.random.PRNGKey(0), 1.0)
    step, key = jax.jit(env.step), jax.jit(env.state_key)
    start = env.reset_from_seed(10001)
    right = step(start, 3)[0]
    up = step(right, 0)[0]
    assert bool(traj.success[0]) and int(traj.num_turns[0]) == 3  # the script went as intended
    assert np.asarray(traj.turn_state_key).dtype == np.uint32
    np.testing.assert_array_equal(traj.turn_state_key, [[key(start), key(right), key(up), 0],
                                                        [key(start), key(start), key(right), key(right)]])
    assert len({int(key(start)), int(key(right)), int(key(up))}) == 3
