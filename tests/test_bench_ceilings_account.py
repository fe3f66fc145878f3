"""``experiments.bench.ceilings --config``: one iteration's phases, counted from the shapes and by
XLA, timed, and read against the machine's ceilings; and ``hlo_bytes.hlo_flops``, which counts a
compiled program's products with its loops' trip counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench import ceilings
from experiments.bench.hlo_bytes import KERNEL_PRODUCTS, hlo_flops
from helpers import TINY_MODEL_FLAGS, fake_decode_state, recording_step
from starpo_jax.models import cpu_kernels, decoder, preset
from starpo_jax.rollout import sampling


def _compiled_scan(layers: int, rows: int = 8, width: int = 128):
    def f(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    args = jax.ShapeDtypeStruct((rows, width), jnp.float32), jax.ShapeDtypeStruct((layers, width, width), jnp.float32)
    return jax.jit(f).lower(*args).compile()


def test_hlo_flops_counts_every_trip_of_a_loop_where_cost_analysis_counts_one():
    compiled = _compiled_scan(6)
    one_product = 2 * 8 * 128 * 128
    assert hlo_flops(compiled.as_text()) == 6 * one_product
    counts = ceilings.xla_counts(compiled)
    assert counts["flops"] == 6 * one_product and counts["cost_analysis_flops"] == pytest.approx(one_product, rel=0.05)


def test_a_loop_without_a_known_trip_count_counts_as_told():
    def f(x, w):
        return jax.lax.while_loop(lambda c: jnp.sum(c[0]) < 1e9, lambda c: (jnp.tanh(c[0] @ w) + 1, c[1]), (x, w))[0]

    args = jax.ShapeDtypeStruct((8, 128), jnp.float32), jax.ShapeDtypeStruct((128, 128), jnp.float32)
    text = jax.jit(f).lower(*args).compile().as_text()
    assert text is not None
    assert hlo_flops(text, unknown_trips=5) == 5 * hlo_flops(text) == 5 * 2 * 8 * 128 * 128


@pytest.mark.skipif(not cpu_kernels.available(cpu_kernels.PRODUCT), reason="the CPU products kernel could not be built")
def test_hlo_flops_counts_the_products_the_cpu_kernel_computes():
    assert KERNEL_PRODUCTS == cpu_kernels.PRODUCT
    two = jax.jit(lambda x, a, b: cpu_kernels.row_products(x, [a, b]))
    text = two.lower(jnp.ones((16, 8)), jnp.ones((8, 5)), jnp.ones((8, 3))).compile().as_text()
    assert text is not None and hlo_flops(text) == 2 * 16 * 8 * (5 + 3)
    # vmap's members each multiply their own weights, in a loop of 3 trips
    members = jax.vmap(lambda x, a: cpu_kernels.row_products(x, [a])[0])

    def looped(x, a):
        return jax.lax.fori_loop(0, 3, lambda _, y: jnp.tanh(members(y, a)), x)

    text = jax.jit(looped).lower(jnp.ones((2, 16, 8)), jnp.ones((2, 8, 8))).compile().as_text()
    assert text is not None and hlo_flops(text) == 3 * 2 * (2 * 16 * 8 * 8)


def test_one_token_is_two_flops_per_weight_of_its_products_and_a_pair_four_per_head_feature():
    config = preset("tiny-llama")
    c = config
    per_layer = (2 * c.hidden_size * c.num_heads * c.head_dim + 2 * c.hidden_size * c.num_kv_heads * c.head_dim
                 + 3 * c.hidden_size * c.intermediate_size)
    assert ceilings.product_flops(config, 1, 0) == 2 * c.num_layers * per_layer
    assert ceilings.product_flops(config, 0, 1) == 2 * c.hidden_size * c.vocab_size
    assert ceilings.attention_flops(config, 1) == 4 * c.num_layers * c.num_heads * c.head_dim
    assert ceilings._triangle([0, 10], [3, 1]) == (1 + 2 + 3) + 11


def test_a_prefix_groups_shared_slots_are_read_once_a_pass_for_its_rows():
    # rows 0 and 2 share 10 slots and pass over them 3 and 5 times (decode steps): 5 passes of the
    # group's 10 slots, not 8; row 1 alone shares nothing; rows 3, 4 share 4 slots, one pass each
    group, shared = [0, 1, 0, 2, 2], [10, 0, 10, 4, 4]
    assert ceilings.shared_reads_saved([3, 7, 5, 1, 1], group, shared) == 10 * 3 + 4
    assert ceilings.shared_reads_saved([0, 7, 0, 1, 0], group, shared) == 0  # a group with one row left


def test_the_least_time_overlaps_the_two_kinds_of_work_or_runs_them_in_sequence():
    """A decode-like phase: products bound by the peak (2 s), attention by the cache's bytes (1 s)."""
    phase = ceilings.work(products=(200, 10), attention=(20, 100))
    assert phase["flops"] == 220 and phase["least_bytes"] == 110
    least, in_sequence = ceilings.least_seconds(phase, peak_flops=100.0, bandwidth=100.0)
    assert least == pytest.approx(2.2)  # the sums at the binding ceiling: 220 FLOPs at 100 per second
    assert in_sequence == pytest.approx(2.0 + 1.0)  # each kind at its own ceiling, one after the other
    alone = ceilings.work(products=(200, 10))
    assert ceilings.least_seconds(alone, 100.0, 100.0) == pytest.approx((2.0, 2.0))  # one kind: the same bound


def test_in_sequence_the_products_may_run_at_the_rate_of_their_rows():
    phase = ceilings.work(products=(200, 10), attention=(20, 100))
    assert ceilings.in_sequence_seconds(phase, 100.0, 100.0) == pytest.approx(2.0 + 1.0)
    # products of few rows at half the peak take twice as long; the attention keeps its bound
    assert ceilings.in_sequence_seconds(phase, 100.0, 100.0, products_flops=50.0) == pytest.approx(4.0 + 1.0)


def test_the_decode_schedule_is_the_rows_the_decode_loop_computes():
    """``decode_schedule`` against ``sampling.decode_loop`` itself, with a step that records the
    batch each live row ran in."""
    steps, sizes = 12, (16, 8, 4)
    answers = np.array([12, 1, 2, 3, 12, 1, 1, 2, 12, 3, 3, 1, 2, 6, 2, 1])
    loop = jax.jit(lambda s: sampling.decode_loop(recording_step, s, jnp.zeros(16), steps, sizes, 1))
    ran = np.asarray(loop(fake_decode_state(answers, steps)).tokens)
    want = [(int(ran[:, t].max()), int((ran[:, t] > 0).sum())) for t in range(steps)]
    # live rows 16, 11, 7, then 4 until the 6-token answer ends: a half holds them from step 2, a quarter from 3
    assert ceilings.decode_schedule(answers, steps, sizes) == want == [(16, 16), (16, 11), (8, 7)] + [(4, 4)] * 3 + [(4, 3)] * 6
    # a rate per batch: the live rows of each step at their batch's rate
    assert ceilings.products_rate([(16, 16), (4, 4)], {16: 2.0, 4: 1.0}) == pytest.approx(20 / (16 / 2e9 + 4 / 1e9))


@pytest.mark.parametrize("rows", [4, decoder.KERNEL_PRODUCT_ROWS[0]])
def test_a_decode_steps_products_are_timed_at_the_rows_asked_by_the_decodes_program(rows, monkeypatch):
    """At the rows where a decode step takes the CPU kernel's products, the kernel computes every
    block product of the timed step (q|k|v, o, gate|up, down: 4 calls a layer); below them, XLA."""
    calls = []
    kernel_products = decoder.kernel_products

    def recorded(x, weights):
        calls.append(len(weights))
        return kernel_products(x, weights)

    monkeypatch.setattr(decoder, "kernel_products", recorded)
    config = preset("tiny-llama")
    rate = ceilings.products_at_rows(config, rows=rows, repeats=2)
    assert rate["rows"] == rows and len(rate["runs_s"]) == 2
    assert rate["flops"] == ceilings.product_flops(config, rows, rows)  # every block's products and the logits, per row
    assert rate["gflop_per_s"] == pytest.approx(rate["flops"] / min(rate["runs_s"]) / 1e9)  # its fastest run
    kernel = rows >= decoder.KERNEL_PRODUCT_ROWS[0] and cpu_kernels.available(cpu_kernels.PRODUCT)
    assert rate["products"] == ("kernel" if kernel else "xla")
    assert calls == ([3, 1, 2, 1] * config.num_layers if kernel else [])  # traced once


def test_account_of_a_tiny_multi_turn_iteration(tmp_path, monkeypatch):
    """Two FrozenLake turns of a tiny model: every phase counted, timed and read against a ceiling."""
    init_keys = []
    init = ceilings.init_train_state

    def recorded_init(settings, model, key):
        init_keys.append(key)
        return init(settings, model, key)

    monkeypatch.setattr(ceilings, "init_train_state", recorded_init)
    phase_calls = []  # (timed, the phases) of each rollout_phases call, in order
    phases_of = ceilings.rollout_phases

    def recorded_phases(exp, state, traj, repeats, timed=True):
        phase_calls.append((timed, result := phases_of(exp, state, traj, repeats, timed)))
        return result

    monkeypatch.setattr(ceilings, "rollout_phases", recorded_phases)
    report = ceilings.main([
        "--quick", "--size", "64", "--copy-mib", "4", "--repeats", "2", "--steps", "1", "--out", str(tmp_path / "c.json"),
        "--config", "configs/learn_frozen_lake.py", *TINY_MODEL_FLAGS, "--config.envs.train.n_groups=(8,)",
        "--config.filter.ratio=0.125", "--config.actor.ppo_mini_batch_size=8", "--config.rollout.max_turn=2",
        "--config.rollout.response_length=4", "--config.rollout.max_model_len=512", "--config.trainer.seed=5",
    ])  # fmt: skip
    (account,) = report["accounts"]
    # the run's own batches: its seed's first train state (and rollout key)
    assert account["seed"] == 5 and [k.tolist() for k in init_keys] == [jax.random.PRNGKey(5).tolist()]
    phases = [(p["phase"], p["turn"]) for p in account["phases"]]
    assert phases[:2] == [("prefill", 1), ("decode", 1)] and phases[-1] == ("update", None)
    assert set(phases) <= {("prefill", 1), ("decode", 1), ("appends", 2), ("decode", 2), ("update", None)}
    for p in account["phases"]:
        assert p["seconds"] > 0 and 0 < p["of_ceiling"] <= p["of_ceiling_in_sequence"] and 0 < p["xla_of_ceiling"]
        assert p["flops"] == sum(f for f, _ in p["kinds"].values())
        assert p["xla"]["flops"] >= p["xla"]["cost_analysis_flops"] * 0.9  # loops counted in full
        assert 0.3 < p["flops"] / p["xla"]["flops"]  # the shapes' count against what XLA computes
        # XLA computes at least the real tokens' weight products: every trip of a prompt block's chunk
        # loop and of the decode's counted (the attention may be the kernel's, which XLA does not see)
        assert p["xla"]["flops"] >= p["kinds"]["products"][0]
        if p["phase"] == "prefill":  # the head's append and the rows', each loop counted with its own trips
            assert p["xla"]["flops"] < 1.5 * p["kinds"]["products"][0]
        if p["phase"] == "update" or not cpu_kernels.available():  # the CPU kernel's sums are not in XLA's
            assert p["flops"] / p["xla"]["flops"] < 1.5
    # the rollout's phases timed --repeats times (their median), the update once an iteration (--steps)
    assert [len(p["runs_s"]) for p in account["phases"]] == [2] * (len(phases) - 1) + [1]
    update = account["phases"][-1]
    parts = update["flops_parts"]
    assert parts["backward"] == 2 * parts["forward"] and update["flops"] == sum(parts.values())
    rollout = [p for p in account["phases"] if p["phase"] != "update"]
    assert account["rollout_phases_s"] == pytest.approx(sum(p["seconds"] for p in rollout))
    assert account["rollout_of_ceiling"] == pytest.approx(sum(p["least_s"] for p in rollout) / account["rollout_phases_s"])
    assert account["rollout_of_ceiling"] <= account["rollout_of_ceiling_in_sequence"]
    rates = {r["rows"]: r["gflop_per_s"] for r in account["decode_products"]}
    # the batch's 64 rows and the half it may move to (a quarter would be fewer than MIN_LIVE_ROWS)
    assert set(rates) == {64, 32} == set(sampling.live_batch_sizes(64, sampling.MIN_LIVE_ROWS)) and min(rates.values()) > 0
    # read against the faster of the ceilings measured before the account and after it
    after = account["ceilings_after"]
    assert account["peak_gflop_per_s"] == max(report["matmul"]["gflop_per_s"], after["matmul"]["gflop_per_s"])
    assert account["bandwidth_gb_per_s"] == max(report["copy"]["gb_per_s"], after["copy"]["gb_per_s"])
    assert after["matmul"]["size"] == 64 and len(after["copy"]["runs_s"]) == 2  # measured as the command asked
    assert after["read"]["bytes"] == after["copy"]["bytes"] and len(after["read"]["runs_s"]) == 2  # reported beside
    peak, bandwidth = account["peak_gflop_per_s"] * 1e9, account["bandwidth_gb_per_s"] * 1e9
    for p in account["phases"]:
        assert p["least_s"] == pytest.approx(ceilings.least_seconds(p, peak, bandwidth)[0])
    for p in rollout:  # the decode's products at its rows' rates, the other phases' at the peak
        products = ceilings.products_rate(p["schedule"], rates) if p["phase"] == "decode" else None
        assert p["reachable_s"] == pytest.approx(ceilings.in_sequence_seconds(p, peak, bandwidth, products))
        assert p["of_reachable"] == pytest.approx(p["reachable_s"] / p["seconds"])
    assert account["rollout_of_reachable"] == pytest.approx(sum(p["reachable_s"] for p in rollout) / account["rollout_phases_s"])
    # the phases were timed on the first (warm-up) batch, before the one timed iteration was counted
    assert [timed for timed, _ in phase_calls] == [True, False]
    # the rollout as run: that iteration's own shapes at the ceilings
    (it,) = account["rollout_as_run"]["iterations"]
    as_run = phase_calls[1][1]
    assert it["rollout_s"] == account["runs_s"]["rollout"][0]
    assert it["in_sequence_s"] == pytest.approx(sum(ceilings.in_sequence_seconds(p, peak, bandwidth) for p in as_run))
    assert it["reachable_s"] == pytest.approx(sum(ceilings.reachable_seconds(p, peak, bandwidth, rates) for p in as_run))
    assert account["rollout_as_run"]["of_reachable"] == pytest.approx(it["reachable_s"] / it["rollout_s"])
    assert "of ceiling" in (text := (tmp_path / "c.md").read_text()) and "in sequence" in text and "at its rows" in text
