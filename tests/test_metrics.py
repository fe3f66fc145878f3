"""The collapse watch needs 5 steps of history, as the README says."""

from starpo_jax.metrics import CollapseWatch

HEALTHY = {"rollout/in_group_std": 1.0, "actor/entropy_loss": 1.0, "actor/grad_norm": 1.0}
COLLAPSED = {"rollout/in_group_std": 0.01, "actor/entropy_loss": 0.01, "actor/grad_norm": 1.0}


def test_collapse_warning_needs_five_steps_of_history():
    watch = CollapseWatch()
    for _ in range(4):
        assert watch.update(HEALTHY) == []
    assert watch.update(COLLAPSED) == []  # step 5: only 4 steps of history
    watch = CollapseWatch()
    for _ in range(5):
        watch.update(HEALTHY)
    assert any("Echo Trap" in w for w in watch.update(COLLAPSED))  # step 6
