"""StarPO-S uncertainty-based rollout filtering (ragen-reference.md §3.2), plus RAGEN-2's top-p variant.

Input: the raw env reward of each trajectory as [G, N] (G groups of N rollouts from the same
initial state, in env order: trajectory b = g·N + n). A group's uncertainty is the unbiased std of
its rewards; StarPO-S trains on the groups the policy is least sure about.

Modes: "std" keeps the k = clip(floor(ratio·G), 1, G) groups with the largest std, "std_rev" the k
smallest, "top_p_var" (RAGEN-2) the largest-std groups until they cover a fraction `ratio` of the
summed std.

Decisions and departures (docs/design.md's quirks table):
- Quirk 6 (replicated): the filter sees raw env rewards (no format penalty, no normalisation) and
  the unbiased std.
- Ties are broken deterministically: equal stds rank by lower group index (RAGEN's `torch.topk`
  breaks them arbitrarily). With group size 1 every std is 0, so the first k groups are kept.
- k is at least 1 (RAGEN v1 would build an empty batch). `ratio` may be traced, so k is computed
  in float32: floor(ratio·G) can differ from Python's int(ratio * G) only when ratio·G lies within
  float32 rounding of an integer.
- Static shapes: `select_groups` returns a keep mask [G], and `gather_kept_groups` compacts the
  batch to a static number of groups (the most a setting can keep). Slots left over when fewer
  are kept (a traced ratio in a sweep, or "top_p_var") hold padding rows marked invalid; the
  trainer keeps them out of every statistic, gradient and optimiser step.
- RAGEN-2's `rollout_filter_metric: reward_variance` in fact ranks by the std; "top_p_var" does
  the same (its "linear" probability mode, selection_eps 0.01). Groups with std 0 are never
  selected by it unless ratio ≥ 1, which keeps everything.
"""

import jax
import jax.numpy as jnp

from starpo_jax.algo.masked import masked_mean, masked_std

MODES = ("std", "std_rev", "top_p_var")
#: What a group's spread is measured on: RAGEN's raw env reward, or the score the advantages read
#: (format penalties included, so a group whose members differ only in format has a spread).
RANK_BY = ("env_reward", "score")


def group_reward_stats(rewards):
    """Per-group unbiased std, max and mean of rewards [G, N]."""
    everything = jnp.ones(rewards.shape, bool)
    return {
        "std": masked_std(rewards, everything, axis=-1),
        "max": rewards.max(axis=-1),
        "mean": rewards.mean(axis=-1),
    }


def num_kept_groups(ratio, num_groups):
    """k = clip(floor(ratio · G), 1, G). Works traced; `int(num_kept_groups(0.25, 8))` gives 2."""
    k = jnp.floor(jnp.asarray(ratio, jnp.float32) * num_groups)
    return jnp.clip(k, 1, num_groups).astype(jnp.int32)


def descending_rank(score):
    """Rank of each entry when sorted largest first (0 = largest); ties: lower index first."""
    index = jnp.arange(score.shape[0])
    beats = (score[None, :] > score[:, None]) | (
        (score[None, :] == score[:, None]) & (index[None, :] < index[:, None])
    )
    return beats.sum(axis=1)


def _top_p_keep(std, p, selection_eps):
    """RAGEN-2 linear top-p: largest stds first, until their sum reaches p·Σstd − eps."""
    rank = descending_rank(std)
    sorted_std = jnp.zeros_like(std).at[rank].set(std)
    covered_before = jnp.cumsum(sorted_std) - sorted_std
    keep_sorted = (covered_before < p * std.sum() - selection_eps) & (sorted_std > 0)
    return keep_sorted[rank] | (p >= 1)


def select_groups(rewards, ratio, mode="std", selection_eps=0.01, rank_by=None):
    """Which groups of rewards [G, N] to train on: (keep mask [G] bool, metrics).

    `ratio` (the keep fraction, or p for "top_p_var") may be a traced scalar. The groups are ranked
    by the spread of ``rank_by`` [G, N] (default: ``rewards`` themselves). Metrics are RAGEN's
    rollout/in_group_{std,max,mean} of ``rewards`` (mean over all groups) and
    rollout/chosen_in_group_* (mean over kept groups), plus rollout/filter_kept_groups.
    """
    if mode not in MODES:
        raise ValueError(f"Unknown rollout filter mode {mode!r}: use one of {MODES}.")
    stats = group_reward_stats(rewards)
    spread = stats["std"] if rank_by is None else group_reward_stats(rank_by)["std"]
    num_groups = rewards.shape[0]
    if mode == "top_p_var":
        keep = _top_p_keep(spread, ratio, selection_eps)
    else:
        score = spread if mode == "std" else -spread
        keep = descending_rank(score) < num_kept_groups(ratio, num_groups)
    metrics = {f"rollout/in_group_{name}": value.mean() for name, value in stats.items()}
    metrics |= {f"rollout/chosen_in_group_{name}": masked_mean(value, keep) for name, value in stats.items()}
    metrics["rollout/filter_kept_groups"] = keep.sum()
    return keep, metrics


def gather_kept_groups(batch, keep, num_kept, group_size):
    """Compact a batch (pytree, leaves [G·N, ...] in env order) to the kept groups.

    num_kept is a static int (for the top-k modes: `int(num_kept_groups(ratio, G))`). Returns
    (compact batch with leaves [num_kept·N, ...], valid [num_kept·N] bool). Kept groups stay in
    group order. If fewer than num_kept groups are kept, the empty slots repeat group 0 and are
    marked invalid; if more are kept, the extra (highest-index) groups are dropped.
    """
    batch_size = keep.shape[0] * group_size
    for leaf in jax.tree.leaves(batch):
        if leaf.shape[:1] != (batch_size,):
            raise ValueError(
                f"gather_kept_groups needs leaves with leading size G·N = {batch_size}, got shape {leaf.shape}."
            )
    groups = jnp.nonzero(keep, size=num_kept, fill_value=0)[0]
    rows = (groups[:, None] * group_size + jnp.arange(group_size)).reshape(-1)
    valid_groups = jnp.arange(num_kept) < keep.sum()
    return jax.tree.map(lambda leaf: leaf[rows], batch), jnp.repeat(valid_groups, group_size)
