import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo_jax.algo import filtering

# unbiased stds: 0, 1, 2, √3 (biased: 0, 0.82, 1.63, 1.41); by std, largest first: 2, 3, 1, 0
REWARDS = jnp.array([[0.0, 0.0, 0.0], [0.0, 1.0, 2.0], [0.0, 2.0, 4.0], [0.0, 0.0, 3.0]])


def kept(keep):
    return set(np.flatnonzero(np.asarray(keep)).tolist())


@pytest.mark.parametrize(
    "mode,ratio,expected",
    [
        ("std", 0.25, {2}),
        ("std", 0.5, {2, 3}),
        ("std", 1.0, {0, 1, 2, 3}),
        ("std_rev", 0.25, {0}),
        ("std_rev", 0.5, {0, 1}),
        ("std_rev", 1.0, {0, 1, 2, 3}),
    ],
)
def test_keeps_the_groups_with_the_largest_or_smallest_std(mode, ratio, expected):
    keep, _ = filtering.select_groups(REWARDS, ratio, mode)
    assert kept(keep) == expected


def test_ties_go_to_the_lower_group_index():
    # stds √2, 2√2, √2, 2√2, 1/√2, each computed exactly, so the ties are real
    rewards = jnp.array([[0.0, 2.0], [0.0, 4.0], [5.0, 3.0], [9.0, 5.0], [1.0, 0.0]])
    assert kept(filtering.select_groups(rewards, 0.2, "std")[0]) == {1}
    assert kept(filtering.select_groups(rewards, 0.4, "std")[0]) == {1, 3}
    assert kept(filtering.select_groups(rewards, 0.6, "std")[0]) == {0, 1, 3}
    assert kept(filtering.select_groups(rewards, 0.4, "std_rev")[0]) == {0, 4}
    # group size 1: every std is 0, so the first k groups are kept
    assert kept(filtering.select_groups(jnp.arange(8.0)[:, None], 0.25, "std")[0]) == {0, 1}


def test_metrics_over_all_and_over_kept_groups():
    _, metrics = filtering.select_groups(REWARDS, 0.5, "std")
    np.testing.assert_allclose(metrics["rollout/in_group_std"], (0 + 1 + 2 + np.sqrt(3)) / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["rollout/in_group_max"], (0 + 2 + 4 + 3) / 4)
    np.testing.assert_allclose(metrics["rollout/in_group_mean"], (0 + 1 + 2 + 1) / 4)
    np.testing.assert_allclose(metrics["rollout/chosen_in_group_std"], (2 + np.sqrt(3)) / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["rollout/chosen_in_group_max"], (4 + 3) / 2)
    np.testing.assert_allclose(metrics["rollout/chosen_in_group_mean"], (2 + 1) / 2)
    assert metrics["rollout/filter_kept_groups"] == 2
    _, everything = filtering.select_groups(REWARDS, 1.0, "std")
    for name in ("std", "max", "mean"):
        chosen, overall = everything[f"rollout/chosen_in_group_{name}"], everything[f"rollout/in_group_{name}"]
        np.testing.assert_allclose(chosen, overall)


def test_ratio_is_traced_under_jit_and_vmap():
    select = jax.jit(lambda ratio: filtering.select_groups(REWARDS, ratio, "std")[0])
    keeps = jax.vmap(select)(jnp.array([0.25, 0.5, 0.75, 1.0]))
    np.testing.assert_array_equal(keeps.sum(axis=1), [1, 2, 3, 4])
    assert kept(keeps[2]) == {1, 2, 3}


def test_num_kept_groups_is_floor_of_ratio_times_groups_and_at_least_one():
    assert [int(filtering.num_kept_groups(r, 8)) for r in (0.25, 0.5, 0.75, 1.0, 0.3, 0.01)] == [2, 4, 6, 8, 2, 1]


@pytest.mark.parametrize("p,expected", [(0.3, {2}), (0.5, {2, 3}), (0.99, {1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_largest_stds_covering_p_of_their_sum(p, expected):
    # stds 2, √3, 1 cover 42 %, 79 %, 100 % of the total; a zero-std group only when p ≥ 1
    assert kept(filtering.select_groups(REWARDS, p, "top_p_var")[0]) == expected


def test_unknown_mode_is_named():
    with pytest.raises(ValueError, match="'max_mean'"):
        filtering.select_groups(REWARDS, 0.5, "max_mean")


def test_compact_gather_follows_env_order_and_marks_padding():
    keep = jnp.array([False, True, False, True])
    batch = {"ids": jnp.arange(12), "mask": jnp.arange(24).reshape(12, 2)}
    compact, valid = filtering.gather_kept_groups(batch, keep, num_kept=2, group_size=3)
    np.testing.assert_array_equal(compact["ids"], [3, 4, 5, 9, 10, 11])
    np.testing.assert_array_equal(compact["mask"], batch["mask"][np.array([3, 4, 5, 9, 10, 11])])
    assert bool(valid.all())
    padded, valid = filtering.gather_kept_groups(batch, keep, num_kept=3, group_size=3)
    np.testing.assert_array_equal(valid, [True] * 6 + [False] * 3)
    with pytest.raises(ValueError, match="leading size"):
        filtering.gather_kept_groups({"ids": jnp.arange(10)}, keep, num_kept=2, group_size=3)
