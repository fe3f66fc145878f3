"""Template collapse (RAGEN-2's mutual information): the figures equal RAGEN-2's formulas, catch a
policy whose answers ignore the board, and the in-graph cross scores equal a plain forward pass."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starpo_jax.diagnostics.template_collapse import (
    CrossScores,
    cross_scores,
    distinct_prompts,
    rows_per_pass,
    template_collapse_metrics,
)
from starpo_jax.models import Decoder, ModelState, preset
from starpo_jax.rollout.multi_turn import Trajectories


def ragen2_figures(cross, cross_sum, own, signatures):
    """RAGEN-2's ``CollapseDetector`` (ragen/trainer/collapse_metrics.py: ``_compute_log_prob_stats``,
    ``_compute_mi_estimate``, ``mi_seq_estimate``, ``_compute_retrieval_accuracy`` with prompt
    signatures), transcribed in numpy as the oracle."""
    n = cross.shape[1]
    rows = np.arange(len(own))

    def stats(c):
        top = c.max(axis=1, keepdims=True)
        return c[rows, own], (np.log(np.exp(c - top).sum(axis=1)) + top[:, 0]) - math.log(n)

    matched, marginal = stats(cross)
    matched_sum, marginal_sum = stats(cross_sum)
    ids: dict[object, int] = {}
    col_sig = np.array([ids.setdefault(s, len(ids)) for s in signatures])
    predicted = cross.argmax(axis=1)
    counts = np.bincount(col_sig)
    return {
        "mi": matched.mean() - marginal.mean(),
        "mi_seq": (matched_sum - marginal_sum).mean(),
        "retrieval_acc": (col_sig[predicted] == col_sig[own]).mean(),
        "retrieval_chance": (counts[col_sig[own]] / n).mean(),
    }


def scores(per_token, per_sequence, own, signatures):
    same = np.array([[a == b for b in signatures] for a in signatures])
    return CrossScores(jnp.asarray(per_token, jnp.float32), jnp.asarray(per_sequence, jnp.float32),
                       jnp.asarray(own, jnp.int32), jnp.asarray(same))


def test_figures_equal_ragen2s_on_a_small_batch():
    rng = np.random.default_rng(0)
    own = np.repeat(np.arange(4), 3)
    cross = rng.normal(-2.0, 1.0, (12, 4)).astype(np.float32)
    cross[np.arange(12), own] += 1.0  # answers somewhat more likely under their own prompt
    cross_sum = cross * rng.integers(3, 9, (12, 1))
    signatures = ("a", "b", "a", "c")  # prompts 0 and 2 are the same board
    ours = template_collapse_metrics(scores(cross, cross_sum, own, signatures))
    theirs = ragen2_figures(cross.astype(np.float64), cross_sum.astype(np.float64), own, signatures)
    for key, value in theirs.items():  # float32 sums of a dozen terms against float64
        assert float(ours[key]) == pytest.approx(value, rel=1e-5, abs=1e-5), key


def test_answers_that_ignore_the_prompt_score_zero_mi_and_chance_retrieval():
    own = np.repeat(np.arange(8), 4)
    per_answer = np.random.default_rng(1).normal(-3.0, 1.0, (32, 1))
    cross = np.broadcast_to(per_answer, (32, 8))  # every prompt gives an answer the same score
    figures = template_collapse_metrics(scores(cross, 5 * cross, own, tuple(range(8))))
    assert abs(float(figures["mi"])) < 1e-6 and abs(float(figures["mi_seq"])) < 1e-5
    assert float(figures["retrieval_acc"]) == pytest.approx(float(figures["retrieval_chance"])) == pytest.approx(1 / 8)


def test_answers_that_are_a_function_of_the_prompt_score_clearly_above():
    own = np.repeat(np.arange(8), 4)
    cross = np.where(np.arange(8)[None] == own[:, None], -0.5, -6.0)  # likely only after their own prompt
    figures = template_collapse_metrics(scores(cross, 5 * cross, own, tuple(range(8))))
    assert float(figures["mi"]) > 0.9 * math.log(8)  # the ceiling is log 8
    assert float(figures["mi_seq"]) > float(figures["mi"])
    assert float(figures["retrieval_acc"]) == 1.0


GROUPS, GROUP_SIZE, LENGTH, ANSWER = 3, 2, 40, 6


def fake_batch(seed: int, same_last_token: bool = False, prompt_of=tuple(range(GROUPS))) -> Trajectories:
    """Rows of 3 groups x 2: a group's rows share a first prompt (of 9, 12 or 15 tokens), then each
    row's own first answer of 3 to 6 tokens, then whatever follows. Group g's prompt is group
    ``prompt_of[g]``'s (the same tokens)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, 200, (GROUPS * GROUP_SIZE, LENGTH)).astype(np.int32)
    prompt_length = np.repeat(np.array([9, 12, 15])[list(prompt_of)], GROUP_SIZE)
    for g in range(GROUPS):
        rows = slice(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)
        source = prompt_of[g] * GROUP_SIZE
        tokens[rows, : prompt_length[source]] = tokens[source, : prompt_length[source]]
    if same_last_token:
        tokens[np.arange(len(tokens)), prompt_length - 1] = 7
    answer_length = rng.integers(3, ANSWER + 1, len(tokens))
    zeros = {f.name: jnp.zeros((len(tokens),)) for f in dataclasses.fields(Trajectories)}
    return Trajectories(**zeros).replace(
        tokens=jnp.asarray(tokens), turn_start=jnp.asarray(prompt_length[:, None], jnp.int32),
        turn_end=jnp.asarray((prompt_length + answer_length)[:, None], jnp.int32),
    )


def score(model: ModelState, traj: Trajectories) -> CrossScores:
    return cross_scores(model.graphdef, model.params, traj, group_size=GROUP_SIZE, groups=(0, 1, 2), width=16,
                        response_length=ANSWER, micro_batch=2, temperature=1.0)


@pytest.fixture(scope="module")
def model():
    return ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0)))


def test_cross_scores_equal_a_forward_pass_over_each_prompt_and_answer(model):
    """Answer r after prompt p, scored by one forward pass over the concatenated tokens."""
    traj = fake_batch(2)
    got = score(model, traj)
    tokens, start, end = (np.asarray(x) for x in (traj.tokens, traj.turn_start[:, 0], traj.turn_end[:, 0]))
    pairs = [(r, p) for r in range(len(tokens)) for p in range(GROUPS)]
    sequences = [np.concatenate([tokens[p * GROUP_SIZE, : start[p * GROUP_SIZE]], tokens[r, start[r] : end[r]]])
                 for r, p in pairs]
    # Every pair in one forward pass (one compile, not one per length): padding after a sequence
    # changes none of its causal logits.
    padded = np.zeros((len(pairs), max(map(len, sequences))), np.int32)
    for i, sequence in enumerate(sequences):
        padded[i, : len(sequence)] = sequence
    positions = np.broadcast_to(np.arange(padded.shape[1]), padded.shape)
    logp = np.asarray(jax.nn.log_softmax(model.merge()(jnp.asarray(padded), jnp.asarray(positions)), axis=-1))
    for (r, p), sequence, row in zip(pairs, sequences, logp):
        prompt = start[p * GROUP_SIZE]
        # the answer's tokens, each predicted at the position before it
        expected = float(row[np.arange(prompt - 1, len(sequence) - 1), sequence[prompt:]].sum())
        # float32 over a 2-layer model, summed over <= 6 tokens, by two differently compiled programs
        assert float(got.per_sequence[r, p]) == pytest.approx(expected, rel=1e-4, abs=1e-4), (r, p)
        assert float(got.per_token[r, p]) == pytest.approx(expected / (end[r] - start[r]), rel=1e-4, abs=1e-4)
    np.testing.assert_array_equal(got.own, np.repeat(np.arange(GROUPS), GROUP_SIZE))
    np.testing.assert_array_equal(got.same_prompt, np.eye(GROUPS, dtype=bool))


def test_answers_are_scored_once_after_each_distinct_prompt(model):
    """Groups 0 and 2 share a prompt: it is scored after once, and both take those scores, which
    equal scoring after every prompt."""
    traj = fake_batch(5, prompt_of=(0, 1, 0))
    np.testing.assert_array_equal(distinct_prompts(traj, np.arange(GROUPS), GROUP_SIZE), [0, 1])
    np.testing.assert_array_equal(distinct_prompts(fake_batch(5), np.arange(GROUPS), GROUP_SIZE), [0, 1, 2])
    np.testing.assert_array_equal(distinct_prompts(traj, np.arange(1, GROUPS), GROUP_SIZE), [0, 1])
    every = score(model, traj)
    once = cross_scores(model.graphdef, model.params, traj, group_size=GROUP_SIZE, groups=(0, 1, 2), width=16,
                        response_length=ANSWER, micro_batch=2, temperature=1.0, scored=np.array([0, 1], np.int32))
    np.testing.assert_array_equal(once.per_sequence[:, 2], once.per_sequence[:, 0])
    # two programs (two prompts' passes against three): the same sums, compiled apart
    np.testing.assert_allclose(once.per_sequence, every.per_sequence, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(once.per_token, every.per_token, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(once.same_prompt, every.same_prompt)
    assert bool(every.same_prompt[0, 2]) and not bool(every.same_prompt[0, 1])


def test_a_model_that_cannot_read_its_prompt_scores_zero_mi(model):
    """Attention's output weights zeroed: each position sees only its own token, so an answer scores
    the same after every prompt (which all end in the same token). The intact model reads them."""
    traj = fake_batch(3, same_last_token=True)
    blind = Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0))  # the fixture's weights, a copy of its own
    blind.layers.o_proj.value = jnp.zeros_like(blind.layers.o_proj.value)
    blind_figures = template_collapse_metrics(score(ModelState.split(blind), traj))
    reading_figures = template_collapse_metrics(score(model, traj))
    assert abs(float(blind_figures["mi_seq"])) < 1e-5
    assert float(reading_figures["mi_seq"]) > 100 * abs(float(blind_figures["mi_seq"])) + 1e-4


def test_collapse_metrics_per_env_tag(model):
    """The driver's figures: per tag, named ``prefix/tag/...``; a tag of one group (one prompt) has none."""
    import envs_jax
    from starpo_jax.diagnostics.template_collapse import collapse_metrics
    from starpo_jax.rollout.multi_turn import RolloutPlan, TagPlan

    traj = fake_batch(4)
    bandit = envs_jax.make("Bandit")  # the tags' env is not read
    plan = RolloutPlan(tags=(TagPlan("A", bandit, 2, 5), TagPlan("B", bandit, 1, 5)), group_size=GROUP_SIZE,
                       response_length=ANSWER, max_len=LENGTH)
    got = collapse_metrics(model, traj, plan, "val-env", max_prompts=8, positions=1, temperature=1.0)
    expected = template_collapse_metrics(cross_scores(
        model.graphdef, model.params, traj, group_size=GROUP_SIZE, groups=(0, 1), width=16, response_length=ANSWER,
        micro_batch=2, temperature=1.0))
    assert set(got) == {f"val-env/A/{key}" for key in expected}
    for key, value in expected.items():  # another micro-batch and prompt width: the same sums, reordered
        assert got[f"val-env/A/{key}"] == pytest.approx(float(value), rel=1e-5, abs=1e-6), key


def test_a_scoring_pass_holds_the_fewest_rows_that_reach_its_positions():
    assert rows_per_pass(64, 48, 512) == 16  # 8 rows hold 384 positions, 16 hold 768
    assert rows_per_pass(64, 16, 512) == 32
    assert rows_per_pass(12, 48, 512) == 12  # no divisor of 12 reaches 512: every row at once
    assert rows_per_pass(4, 6, 1) == 1
