"""bench_peer: TRL's settings come from the config, the reward is the env's rule, the prompt is the
rollout's. The end-to-end run trains both sides (slow; needs trl, which only ``.[peer]`` installs).
Its scorer of an exported folder is tested in tests/test_run.py, on the tiny run the tests there share."""

import json
import sys

import jax
import jax.numpy as jnp
import pytest

from experiments.bench import peer as bench_peer
from experiments.bench.common import load_config

QUICKSTART = "configs/quickstart.py"


def settings(*overrides):
    return bench_peer.trl_settings(load_config(QUICKSTART, list(overrides)))[0]


def test_trl_settings_follow_the_config():
    kw = settings("--config.actor.lr=3e-6", "--config.actor.weight_decay=0.05", "--config.actor.betas=(0.8,0.99)",
                  "--config.actor.grad_clip=0.5", "--config.rollout.temperature=0.7", "--config.rollout.top_p=0.9",
                  "--config.rollout.response_length=40", "--config.actor.clip_ratio_low=0.1",
                  "--config.actor.clip_ratio_high=0.3", "--config.actor.entropy_coeff=0.002",
                  "--config.envs.train.group_size=8", "--config.envs.train.n_groups=(3,)",
                  "--config.actor.ppo_mini_batch_size=12", "--config.actor.micro_batch_size=4",
                  "--config.trainer.seed=7")
    assert kw["num_generations"] == 8  # group size
    # 3 groups x 8 = 24 per rollout, mini-batches of 12 in micro-batches of 4: 2 optimizer steps per rollout
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["steps_per_generation"]) == (4, 3, 6)
    assert kw["num_iterations"] == 1
    assert kw["learning_rate"] == 3e-6 and kw["weight_decay"] == 0.05 and kw["max_grad_norm"] == 0.5
    assert (kw["adam_beta1"], kw["adam_beta2"], kw["adam_epsilon"]) == (0.8, 0.99, 1e-8)
    assert kw["lr_scheduler_type"] == "constant" and kw["warmup_steps"] == 0
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["max_completion_length"]) == (0.7, 0.9, 0, 40)
    assert (kw["epsilon"], kw["epsilon_high"]) == (0.1, 0.3)
    assert kw["entropy_coef"] == 0.002 and kw["seed"] == 7
    # StarPO-S's maths: seq-mean-token-mean, no KL, group std scaling, trained truncations
    assert (kw["loss_type"], kw["beta"], kw["scale_rewards"], kw["mask_truncated_completions"]) == ("grpo", 0.0, "group", False)


def test_trl_settings_of_other_maths_and_refusals():
    assert settings("--config.actor.loss_agg_mode=token-mean")["loss_type"] == "dapo"
    assert settings("--config.actor.loss_agg_mode=seq-mean-token-sum-norm")["loss_type"] == "dr_grpo"
    assert settings("--config.algorithm.grpo_norm_by_std=False")["scale_rewards"] == "none"
    assert settings("--config.actor.use_kl_loss=True", "--config.actor.kl_loss_type=low_var_kl",
                    "--config.actor.kl_loss_coef=0.01")["beta"] == 0.01
    assert settings("--config.rollout.top_k=20")["top_k"] == 20
    assert settings()["gradient_checkpointing"] and not settings("--config.model.remat=none")["gradient_checkpointing"]
    from starpo_jax.runtime.experiment import ConfigError

    for bad in ("--config.actor.loss_agg_mode=seq-mean-token-sum", "--config.algorithm.adv_estimator=gae",
                "--config.actor.use_kl_loss=True", "--config.algorithm.kl_in_reward=True",
                "--config.reward.method=asym_clip"):
        with pytest.raises(ConfigError, match="no TRL"):
            settings(bad)
    # the sampler's log-probs are TRL's maths only where one optimizer step per rollout keeps the ratio 1
    assert settings("--config.rollout.use_sampler_logprobs=True")["steps_per_generation"] == 2  # 8 rows, 1 step
    with pytest.raises(ConfigError, match="more than one optimizer step per rollout"):
        settings("--config.rollout.use_sampler_logprobs=True", "--config.actor.ppo_mini_batch_size=4")


def test_the_starpo_side_starts_from_the_repository():
    """``run_starpo`` starts ``experiments.run`` in ``ROOT`` with the config path as the user gave it
    (relative to the repository), so ROOT must be the repository wherever bench_peer.py lives."""
    assert (bench_peer.ROOT / bench_peer.DEFAULT_CONFIG).is_file()
    assert (bench_peer.ROOT / "experiments" / "run.py").is_file()


def test_a_misspelt_override_is_a_config_error_naming_it():
    from starpo_jax.runtime.experiment import ConfigError

    with pytest.raises(ConfigError, match="--config.actor.lrr: config key 'lrr' does not exist"):
        load_config(QUICKSTART, ["--config.actor.lrr=1e-5"])


def test_an_override_without_its_config_prefix_is_a_config_error_not_ignored():
    from starpo_jax.runtime.experiment import ConfigError

    with pytest.raises(ConfigError, match="an override is --config.KEY=VALUE, not 'model.dtype=bfloat16'"):
        load_config(QUICKSTART, ["model.dtype=bfloat16"])


def test_bench_overrides_set_steps_checkpoints_and_filter(tmp_path):
    config = load_config(QUICKSTART, ["--config.filter.ratio=0.5"])
    args = bench_peer.parse_args(["--steps", "7", "--points", "3"])
    sets = dict(o.removeprefix("--config.").split("=", 1) for o in bench_peer.bench_overrides(config, args, tmp_path))
    assert (sets["trainer.total_steps"], sets["trainer.save_freq"], sets["filter.ratio"]) == ("7", "3", "1.0")
    assert sets["trainer.save_every_minutes"] == "0"  # only the step points: they are the 3 checkpoints kept
    with pytest.raises(SystemExit):
        bench_peer.parse_args(["--val-levels", "100"])  # validated 64 at a time
    assert bench_peer.parse_args(["--val-levels", "128"]).val_levels == 128
    args = bench_peer.parse_args(["--keep-filter", "--config.actor.lr=1e-5"])
    assert args.overrides == ["--config.actor.lr=1e-5"]
    assert "filter.ratio" not in dict(o.removeprefix("--config.").split("=", 1)
                                      for o in bench_peer.bench_overrides(config, args, tmp_path))


def _plan_and_env():
    from starpo_jax.runtime.experiment import rollout_plan

    plan = rollout_plan(load_config(QUICKSTART, []), "train")
    return plan, plan.tags[0].env


@pytest.mark.parametrize("hi_first", [False, True])
def test_reward_is_the_env_rule(hi_first):
    plan, env = _plan_and_env()
    assert env.lo_hi_names == ("Phoenix", "Dragon") and plan.format_penalty == -0.1
    score = lambda text, u: bench_peer.score_completion(text, hi_first, env, plan, u)  # noqa: E731
    # Dragon, the risky arm: 1.0 when the draw is below 0.25, else 0.0 (envs_jax/bandit.py payout)
    assert score(" Dragon </answer>", 0.1) == (1.0, True)
    assert score(" dragon</answer>", 0.9) == (0.0, True)
    assert score(" Dragon </answer>", 0.1) == (float(env.payout(True, 0.1)), True)
    # Phoenix, the safe arm: 0.1 always (float32, as the rollout pays it)
    assert score(" Phoenix </answer>", 0.1) == (float(jnp.float32(0.1)), False)
    # no answer, no arm, an unknown arm: the format penalty only
    for text in ("I choose Dragon", " Unicorn </answer>", "", " </answer>"):
        assert score(text, 0.1) == (-0.1, False)
    # one action per turn: the first named arm counts
    assert score(" Phoenix || Dragon </answer>", 0.1)[1] is False


def test_reward_function_reads_the_arm_order_per_row():
    config = load_config(QUICKSTART, [])
    reward = bench_peer.reward_function(config, seed=0)
    texts = [" Phoenix </answer>", " Dragon</answer>", "nonsense"]
    values = reward(prompts=["p"] * 3, completions=texts, hi_first=[True, False, True])
    assert values[0] == pytest.approx(0.1) and values[1] in (0.0, 1.0) and values[2] == pytest.approx(-0.1)
    assert reward.successes == [False, True, False] and reward.rewards == values


def test_prompts_are_the_rollouts_first_turn():
    from envs_jax.bandit import BanditState
    from starpo_jax.models.loading import smollm2_tokenizer
    from starpo_jax.rollout import prompts

    config = load_config(QUICKSTART, [])
    tokenizer = smollm2_tokenizer()
    texts = bench_peer.bandit_prompts(config, tokenizer)
    _, env = _plan_and_env()
    for hi_first, text in texts.items():
        state = BanditState(hi_first=jnp.asarray(hi_first), key=jax.random.PRNGKey(0))  # the text reads no key
        messages = prompts.build_messages([{"state": env.render_text(state), "actions_left": 1}], "", 100, False)
        assert text == prompts.chat_text(tokenizer, messages, add_generation_prompt=True, enable_think=False)
        assert text.endswith("<|im_start|>assistant\n<answer>")
        assert ("Dragon and Phoenix" if hi_first else "Phoenix and Dragon") in text
    # TRL tokenizes a text prompt with the tokenizer's defaults: the same ids as the rollout's
    from starpo_jax.rollout.multi_turn import build_tables, first_prompts
    from starpo_jax.runtime.experiment import rollout_plan

    plan = rollout_plan(config, "train", tokenizer)
    tables = build_tables(tokenizer, plan, max_tokens=config.envs.prompt_max_tokens)
    ids, lengths = first_prompts(plan, tables, (BanditState(hi_first=jnp.asarray([True]), key=jnp.zeros((1, 2), jnp.uint32)),))
    assert tokenizer(texts[True])["input_ids"] == [int(t) for t in ids[0, : int(lengths[0])]]


def test_rounds_alternate_the_sides_and_report_each_rounds_ratio(tmp_path):
    """``--rounds 2`` is A B B A: a drift in the machine's load during the benchmark falls on both
    sides alike; the ratio is of each round's warm medians (the first step, compiling, left out)."""
    assert bench_peer.round_order(3) == [("starpo_jax", "trl"), ("trl", "starpo_jax"), ("starpo_jax", "trl")]
    assert bench_peer.round_folder(tmp_path, 0) == tmp_path and bench_peer.round_folder(tmp_path, 1) == tmp_path / "round_1"
    timing = bench_peer.timing_report([
        {"order": ("starpo_jax", "trl"), "starpo_jax": [90.0, 10.0, 12.0, 11.0], "trl": [50.0, 40.0, 44.0, 42.0]},
        {"order": ("trl", "starpo_jax"), "starpo_jax": [80.0, 20.0, 20.0, 20.0], "trl": [55.0, 30.0, 30.0, 30.0]},
    ])
    assert [row["trl_over_starpo"] for row in timing["rounds"]] == [pytest.approx(42 / 11), pytest.approx(1.5)]
    assert timing["median_ratio"] == pytest.approx((42 / 11 + 1.5) / 2)
    assert timing["ratio_range"] == [pytest.approx(1.5), pytest.approx(42 / 11)]
    with pytest.raises(SystemExit):
        bench_peer.parse_args(["--rounds", "0"])


def test_help_and_missing_trl(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        bench_peer.main(["--help"])
    assert exit_.value.code == 0 and "--val-levels" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl raises ImportError
    assert bench_peer.main(["--steps", "1"]) == 2
    assert "pip install -e '.[peer]'" in capsys.readouterr().err


@pytest.mark.slow
def test_two_steps_of_both_sides(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "peer"
    assert bench_peer.main(["--config", QUICKSTART, "--steps", "2", "--val-levels", "2", "--points", "2",
                            "--out", str(out)]) == 0
    report = json.loads((out / "bench_peer.json").read_text())
    assert (out / "bench_peer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for side in ("starpo_jax", "trl"):
        r = report[side]
        assert len(r["step_s"]) == 2 and r["first_step_s"] > 0 and r["median_warm_step_s"] > 0
        assert len(r["train_success"]) == len(r["train_reward"]) == 2 and r["wall_s"] > sum(r["step_s"])
        assert [row["step"] for row in r["curve"]] == [0, 1, 2]
        assert r["curve"][0]["success"] == report["trl"]["curve"][0]["success"]  # one base model, scored once
    assert report["trl_settings"]["loss_type"] == "grpo" and report["filter"]["filter.ratio"] == 1.0
    [timing] = report["timing"]["rounds"]
    assert timing["order"] == ["starpo_jax", "trl"] and timing["trl_step_s"] == report["trl"]["step_s"]
