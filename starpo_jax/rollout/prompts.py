"""RAGEN's prompts (ragen-reference.md §2.3): the text reference on the host, and the same prompts as token ids
assembled inside jit.

Text (plain Python, the oracle): ``env_instruction`` (the per-tag prefix), ``turn_user_text`` (what a
turn appends to the last user message), ``reward_text``, ``build_messages`` (RAGEN's message list for
one env's history) and ``chat_text`` (the chat-templated string, with the forced ``<think>`` /
``<answer>`` prefix after a generation prompt).

Tokens (in-graph): a BPE tokenizer only merges inside the chunks of its regex pre-tokenizer, so a
prompt can be cut wherever every tokenizer we support always starts a new chunk, each piece
tokenized once on the host into a table, and a prompt assembled by concatenating table rows.
``PromptTables.build`` makes those tables for one env tag from the env's contract
(``envs_jax.base.TextEnv``: instruction text, step rewards, observation pieces; nothing else of the
env is read); ``first_prompt_tokens`` and ``next_turn_tokens`` assemble a turn's tokens (jittable,
vmappable over the batch). The pieces of a turn, and the cuts between them (each one checked
against the tokenizer when the tables are built, and by the tests over many random states for
Qwen2.5 and SmolLM2):

    turn 1:   [chat head: system message, user start, prefix, "\\nTurn 1:\\nState:\\n"]
              [observation pieces: the env's text + "\\n", e.g. grid rows, each "row\\n"]
              [tail: "You have {n} actions left ... (tokens).\\n" + user end + assistant start +
              forced "<think>"]
    turn k>1: [assistant end, minus the stop token if the model emitted it]
              [user start + "Reward:\\n{acc}"]  ["\\n\\nTurn {k}:\\nState:\\n"]  [observation]  [tail]

Cuts sit after a newline that ends a chunk, before a special token, or between a digit and a
newline. Not every plausible cut is clean: Qwen's pre-tokenizer keeps ``".\\n\\n"`` in one chunk, so
the observation's pieces end with the newline that follows the state text (Bandit's text ends in
".\\n"); and the reward's trailing newline stays with ``"\\nTurn"``.

The chat-template pieces are found by rendering the model's template with sentinel contents and
splitting (``chat_glue``). The rollout keeps one KV cache per episode and only appends, so the
template must render earlier assistant messages verbatim (ChatML, as Qwen2.5 and SmolLM2 do);
a template that rewrites them (Qwen3's drops past ``<think>`` reasoning) is refused with a clear
error. Pass ``chat_template=`` to use another template.

Decisions on RAGEN details, documented:

- [quirk 1, replicated by default] The legend names the env's ``legend_symbols`` (RAGEN: its config
  class's defaults), so SokobanDifferentGridVocab's prompt explains ``# _ O √ X P S`` while its
  grid shows ``W . G C B A @``. ``legend_from_env_symbols=True`` explains the symbols the grid
  actually uses.
- The reward message shows the turn reward as RAGEN's es_manager accumulates it: ``acc = 0`` (an
  int), then ``acc += r`` for each executed action in order, printed with ``str``. A turn that
  executed nothing prints ``0``; three Sokoban steps print ``-0.30000000000000004``. (We add in a
  loop rather than with ``sum``, which compensates rounding from Python 3.12 on.) The per-step
  rewards an env can pay are its ``step_reward_values``; the rollout maps each float32 step
  reward to the nearest one and indexes the turn by the sequence (``reward_sequence_index``), since the
  printed double depends on the order of the additions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from starpo_jax.rollout.tokens import PieceTable, pack_runs, padded_table, piece_runs, tokenize_texts

SYSTEM_PROMPT = "You're a helpful assistant. "


# ---- text (host) --------------------------------------------------------------------------------


def env_instruction(env, max_actions_per_traj: int, legend_from_env_symbols: bool = False) -> str:
    """The per-tag prefix of the first user message (§2.3), as the env declares it; empty for Bandit.

    The legend names the env's ``legend_symbols`` (quirk 1) unless ``legend_from_env_symbols``.
    """
    return env.instruction_text(max_actions_per_traj, legend_from_env_symbols)


def turn_header_text(turn: int) -> str:
    """Appended to the last user message before turn ``turn`` (1-based) is described."""
    return f"\nTurn {turn}:\n"


TAIL_START = "You"  # the first word after the observation (``actions_left_text``)


def actions_left_text(actions_left: int, max_tokens: int, enable_think: bool) -> str:
    fmt = (
        "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
        if enable_think
        else "<answer> [your answer] </answer>"
    )
    return (
        f"You have {actions_left} actions left. Always output: {fmt} with no extra text. "
        f"Strictly follow this format. Max response length: {max_tokens} words (tokens).\n"
    )


def turn_user_text(turn: int, state_text: str, actions_left: int, max_tokens: int, enable_think: bool) -> str:
    """What turn ``turn`` (1-based) appends to the last user message: header, state, instructions."""
    return (
        turn_header_text(turn)
        + f"State:\n{state_text}\n"
        + actions_left_text(actions_left, max_tokens, enable_think)
    )


def accumulated_reward(step_rewards: Sequence[float]) -> float:
    """RAGEN's ``acc_reward``: int 0 plus each executed action's reward, in order."""
    acc: float = 0  # int 0 when no action ran, as RAGEN prints it
    for r in step_rewards:
        acc += r
    return acc


def reward_text(step_rewards: Sequence[float]) -> str:
    """The user message after a turn, e.g. ``"Reward:\\n-0.30000000000000004\\n"``."""
    return f"Reward:\n{accumulated_reward(step_rewards)}\n"


def build_messages(
    history: Sequence[dict[str, Any]],
    prefix: str,
    max_tokens: int,
    enable_think: bool,
    for_update: bool = False,
    system_prompt: str = SYSTEM_PROMPT,
) -> list[dict[str, str]]:
    """RAGEN's messages for one env (§2.3 / §2.6).

    ``history`` entries have ``state`` and ``actions_left``, and once played ``llm_response`` and
    ``reward`` (the turn's accumulated reward, see ``accumulated_reward``). ``for_update`` builds the
    training sequence: the final state-only entry is dropped, and so is the last reward message.
    """
    history = list(history)
    if for_update and history and "state" in history[-1]:  # the state after the last turn
        history = history[:-1]
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": prefix}]
    for idx, entry in enumerate(history):
        messages[-1]["content"] += turn_header_text(idx + 1)
        if "state" in entry:
            messages[-1]["content"] += f"State:\n{entry['state']}\n" + actions_left_text(
                entry["actions_left"], max_tokens, enable_think
            )
        if "llm_response" in entry:
            messages.append({"role": "assistant", "content": entry["llm_response"]})
        if "reward" in entry and not (for_update and idx == len(history) - 1):
            messages.append({"role": "user", "content": f"Reward:\n{entry['reward']}\n"})
    return messages


def forced_prefix(enable_think: bool) -> str:
    """The tag appended after the generation prompt; the model's response continues it."""
    return "<think>" if enable_think else "<answer>"


def chat_text(
    tokenizer,
    messages: Sequence[dict[str, str]],
    add_generation_prompt: bool,
    enable_think: bool,
    chat_template: str | None = None,
) -> str:
    """``apply_chat_template`` as RAGEN calls it, plus the forced prefix after a generation prompt."""
    text = tokenizer.apply_chat_template(
        list(messages),
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    return text + forced_prefix(enable_think) if add_generation_prompt else text


# ---- chat-template pieces ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChatGlue:
    """A chat template cut into the text between message contents (ChatML for Qwen and SmolLM2).

    A conversation renders as ``start + user_1 + to_assistant + assistant_1 + assistant_end +
    user_start + user_2 + to_assistant + ...``.
    """

    start: str  # everything before the first user content: system message and user start
    to_assistant: str  # user end, then the assistant start of the generation prompt
    assistant_end: str  # after an assistant message's content
    user_start: str  # before a later user message's content


# Plain ChatML. For a system message followed by user / assistant messages it renders exactly what
# Qwen2.5-Instruct's template renders (which differs only for tools and a missing system message).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _not_verbatim(name: str) -> str:
    return (
        f"The chat template of {name} does not render messages as fixed text around their verbatim "
        "contents (Qwen3's, for one, adds or drops <think> reasoning in assistant messages), which a "
        "rollout that only appends tokens cannot reproduce; pass chat_template= with a template "
        "that does, e.g. starpo_jax.rollout.prompts.CHATML_TEMPLATE (what Qwen2.5's renders)."
    )


_SENTINELS = ("\x1eUSER-ONE\x1e", "\x1eASSISTANT\x1e", "\x1eUSER-TWO\x1e")


def _split(text: str, sentinels: Sequence[str], template_name: str) -> list[str]:
    pieces, rest = [], text
    for s in sentinels:
        if rest.count(s) != 1:
            raise ValueError(_not_verbatim(template_name))
        head, rest = rest.split(s)
        pieces.append(head)
    return pieces + [rest]


def chat_glue(tokenizer, system_prompt: str = SYSTEM_PROMPT, chat_template: str | None = None) -> ChatGlue:
    """Derive the template pieces by rendering sentinel contents; check the template renders a
    two-turn conversation as their concatenation, with assistant contents verbatim."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    u1, a1, u2 = _SENTINELS

    def render(contents, generation_prompt):
        roles = ("user", "assistant", "user")
        messages = [{"role": "system", "content": system_prompt}]
        messages += [{"role": r, "content": c} for r, c in zip(roles, contents)]
        return tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=generation_prompt, tokenize=False
        )

    start, to_assistant = _split(render([u1], True), [u1], name)
    _, to_assistant_1, assistant_end = _split(render([u1, a1], False), [u1, a1], name)
    _, _, between, end = _split(render([u1, a1, u2], True), [u1, a1, u2], name)
    if to_assistant_1 != to_assistant or not between.startswith(assistant_end) or end != to_assistant:
        raise ValueError(_not_verbatim(name))
    glue = ChatGlue(start, to_assistant, assistant_end, between[len(assistant_end) :])
    probe = "<think>probe</think><answer>probe</answer>"
    expected = glue.start + u1 + glue.to_assistant + probe + glue.assistant_end + glue.user_start + u2
    if render([u1, probe, u2], True) != expected + glue.to_assistant:
        raise ValueError(_not_verbatim(name))
    return glue


# ---- token tables (host build, jittable assembly) ----------------------------------------------


class TokenRuns(struct.PyTreeNode):
    """Token runs keyed by an integer: run ``k`` is ``ids[k, :lengths[k]]``."""

    ids: jnp.ndarray  # int32[n, width]
    lengths: jnp.ndarray  # int32[n]

    @classmethod
    def from_texts(cls, tokenizer, texts: Sequence[str]) -> "TokenRuns":
        ids, lengths = padded_table(tokenize_texts(tokenizer, texts))
        return cls(jnp.asarray(ids), jnp.asarray(lengths))

    @classmethod
    def from_ids(cls, token_lists: Sequence[Sequence[int]]) -> "TokenRuns":
        ids, lengths = padded_table(token_lists)
        return cls(jnp.asarray(ids), jnp.asarray(lengths))

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def run(self, key):
        """Jittable: run ``key`` as a one-run stack for ``pack_runs``."""
        return self.ids[key][None], self.lengths[key][None]


def reward_sequence_index(categories: Sequence[int], num_categories: int) -> int:
    """Index of a turn's executed step-reward categories: ``sum((c_i + 1) * (C + 1) ** i)``.

    Digit 0 means "no action", so an empty turn is index 0 and differs from a turn that paid 0.0.
    ``starpo_jax.rollout.env_turn.execute_turn`` computes the same index in-graph.
    """
    return sum((c + 1) * (num_categories + 1) ** i for i, c in enumerate(categories))


def reward_sequence_of_index(index: int, values: Sequence[float], num_slots: int) -> list[float]:
    """The step rewards an index stands for (zero digits are skipped)."""
    base = len(values) + 1
    digits = [(index // base**i) % base for i in range(num_slots)]
    return [values[d - 1] for d in digits if d > 0]


class PromptTables(struct.PyTreeNode):
    """Token tables of one env tag's prompts; pass as a jit argument (the 8x8 row table is 4 MB).

    ``pieces`` in the functions below is the env's ``observation_pieces(state)``.
    """

    head: TokenRuns  # one run: chat start, prefix, "\nTurn 1:\nState:\n"
    observation: PieceTable  # the env's observation pieces
    tail: TokenRuns  # key: actions left n
    turn_end: TokenRuns  # key 0: full assistant end (response cut); 1: after the model's stop token
    reward: TokenRuns  # key: reward_sequence_index; user start + "Reward:\n{acc}"
    turn_header: TokenRuns  # key k: "\n\nTurn {k}:\nState:\n"
    reward_values: jnp.ndarray  # float32[C]: the env's per-step rewards, in category order
    max_actions_per_traj: int = struct.field(pytree_node=False)
    stop_token_id: int = struct.field(pytree_node=False)
    first_len: int = struct.field(pytree_node=False)  # static length of first_prompt_tokens' ids
    next_len: int = struct.field(pytree_node=False)  # static length of next_turn_tokens' ids

    @classmethod
    def build(
        cls,
        tokenizer,
        env,
        *,
        max_actions_per_traj: int,
        max_actions_per_turn: int,
        max_turn: int,
        max_tokens: int = 100,
        enable_think: bool = True,
        legend_from_env_symbols: bool = False,
        system_prompt: str = SYSTEM_PROMPT,
        chat_template: str | None = None,
    ) -> "PromptTables":
        """Tokenize every prompt piece of this env tag (LargerSokoban's room-row table is the largest)."""
        glue = chat_glue(tokenizer, system_prompt, chat_template)
        texts = PromptPieces.of(
            glue, env, max_actions_per_traj, max_actions_per_turn, max_turn, max_tokens, enable_think,
            legend_from_env_symbols,
        )
        end_ids = tokenize_texts(tokenizer, [glue.assistant_end])[0]
        if tokenizer.convert_ids_to_tokens(end_ids[0]) not in tokenizer.all_special_tokens:
            raise ValueError(
                f"The assistant end {glue.assistant_end!r} of this chat template does not start with "
                "a special stop token; the rollout cannot tell a finished response from a cut one."
            )
        observation = PieceTable.build(tokenizer, env.piece_texts, observation_budget(env), TAIL_START)
        check_cuts(tokenizer, texts.sample_prompts(env, observation.num_pieces), env.piece_texts, observation, getattr(env, "name", ""))

        head = TokenRuns.from_texts(tokenizer, [texts.head])
        tail = TokenRuns.from_texts(tokenizer, texts.tails)
        turn_end = TokenRuns.from_ids([end_ids, end_ids[1:]])
        reward = TokenRuns.from_texts(tokenizer, texts.rewards)
        turn_header = TokenRuns.from_texts(tokenizer, texts.turn_headers)
        obs_len = observation.max_len
        return cls(
            head=head,
            observation=observation,
            tail=tail,
            turn_end=turn_end,
            reward=reward,
            turn_header=turn_header,
            reward_values=jnp.asarray(env.step_reward_values, jnp.float32),
            max_actions_per_traj=max_actions_per_traj,
            stop_token_id=int(end_ids[0]),
            first_len=head.width + obs_len + tail.width,
            next_len=turn_end.width + reward.width + turn_header.width + obs_len + tail.width,
        )


def observation_budget(env) -> int:
    """How many pieces an observation of ``env`` has (the static length of ``observation_pieces``)."""
    state = jax.eval_shape(env.reset, jax.random.PRNGKey(0))[0]
    return int(np.prod(jax.eval_shape(env.observation_pieces, state).shape))


@dataclasses.dataclass(frozen=True)
class PromptPieces:
    """The texts of the prompt pieces of one env tag, in the order of their table keys."""

    head: str  # chat start + prefix + "\nTurn 1:\nState:\n"
    tails: list[str]  # by actions left n
    assistant_end: str
    rewards: list[str]  # by reward_sequence_index
    turn_headers: list[str]  # by turn k

    @classmethod
    def of(cls, glue, env, max_actions_per_traj, max_actions_per_turn, max_turn, max_tokens, enable_think,
           legend_from_env_symbols) -> "PromptPieces":
        tails = [
            actions_left_text(n, max_tokens, enable_think) + glue.to_assistant + forced_prefix(enable_think)
            for n in range(max_actions_per_traj + 1)
        ]
        values = env.step_reward_values
        slots = min(max_actions_per_turn, max_actions_per_traj)
        rewards = [  # without the message's final newline, which belongs with "\nTurn"
            glue.user_start + reward_text(reward_sequence_of_index(k, values, slots))[:-1]
            for k in range((len(values) + 1) ** slots)
        ]
        prefix = env_instruction(env, max_actions_per_traj, legend_from_env_symbols)
        return cls(
            head=glue.start + prefix + turn_header_text(1) + "State:\n",
            tails=tails,
            assistant_end=glue.assistant_end,
            rewards=rewards,
            turn_headers=["\n" + turn_header_text(k) + "State:\n" for k in range(max_turn + 1)],
        )

    def sample_prompts(self, env, num_pieces: int, samples: int = 24, seed: int = 0) -> list[list]:
        """Random first and later turns, as lists of pieces (texts, and ints for observation
        pieces); the observations are the env's ``sample_observation_pieces`` of ``num_pieces``
        (``observation_budget``)."""
        rng = np.random.default_rng(seed)
        pick = lambda options: options[rng.integers(len(options))]  # noqa: E731
        prompts = []
        for i in range(samples):
            observation = env.sample_observation_pieces(rng, num_pieces)
            if i % 2 == 0:
                prompts.append([self.head, *observation, pick(self.tails)])
            else:
                later = [self.assistant_end, pick(self.rewards), pick(self.turn_headers[2:] or [""])]
                prompts.append(later + observation + [pick(self.tails)])
        return prompts


class PieceCutError(ValueError):
    """Two prompt pieces whose tokens merge across their cut, so the in-graph prompts, joined from
    each piece's tokens, would not be the tokenizer's encoding."""


def check_cuts(
    tokenizer, prompts: Sequence[Sequence], piece_texts: Sequence[str] = (), pieces=None, env_name: str = ""
) -> None:
    """Raise ``PieceCutError`` naming the first cut of ``prompts`` (of env ``env_name``) that a token spans.

    A prompt is a list of pieces: texts, or ints standing for observation pieces (``piece_texts``
    and their token ids in the ``PieceTable`` ``pieces``). The env's pieces are cut in the wrong
    place, or the tokenizer's pre-tokenizer differs from Qwen2.5's and SmolLM2's.
    """
    text = lambda p: p if isinstance(p, str) else piece_texts[p]  # noqa: E731
    prompts = [[p for p in prompt if text(p)] for prompt in prompts]  # an empty piece has no cut
    whole = tokenize_texts(tokenizer, ["".join(map(text, prompt)) for prompt in prompts])
    for prompt, ids in zip(prompts, whole):
        parts = [tokenize_texts(tokenizer, [p])[0] if isinstance(p, str) else pieces.piece_ids(p) for p in prompt]
        if sum(parts, []) != ids:
            raise PieceCutError(cut_message(tokenizer, [text(p) for p in prompt], parts, ids, env_name))


def cut_message(
    tokenizer, texts: Sequence[str], parts: Sequence[Sequence[int]], ids: Sequence[int], env_name: str = ""
) -> str:
    """One sentence on the first cut between ``texts`` (tokenized apart: ``parts``) that a token of
    the whole text's encoding ``ids`` spans: the two pieces, the token, and where to cut instead."""
    joined = [t for part in parts for t in part]
    first = next((j for j, (a, b) in enumerate(zip(joined, ids)) if a != b), min(len(joined), len(ids)))
    ends = np.cumsum([len(part) for part in parts])
    k = int(np.searchsorted(ends, first, side="right"))  # the piece whose tokens first differ
    if k > 0 and (k >= len(parts) or first == ends[k] - len(parts[k])):
        k -= 1  # they differ from a piece's first token on: the cut before it
    k = min(k, len(texts) - 2)
    before, after = texts[k], texts[k + 1]
    token = tokenizer.decode([ids[min(first, len(ids) - 1)]])
    spans = [n for n in range(len(token) - 1, 0, -1) if before.endswith(token[:n]) and after.startswith(token[n:])]
    instead = f", for example {_tail(before[: -spans[0]])!r} + {_head(token[: spans[0]] + after)!r}" if spans else ""
    return (
        f"The prompt pieces {_tail(before)!r} and {_head(after)!r}{f' of env {env_name!r}' if env_name else ''} "
        "do not tokenize apart: the tokenizer "
        f"encodes {token!r} across the cut between them, so prompts joined from each piece's tokens would "
        "not be its encoding; cut after a newline that no other newline follows, or before a space-led "
        f"word or number (docs/environments.md){instead}."
    )


def _tail(text: str, width: int = 30) -> str:
    return text if len(text) <= width else "…" + text[-width:]


def _head(text: str, width: int = 30) -> str:
    return text if len(text) <= width else text[:width] + "…"


def _observation_runs(tables: PromptTables, pieces, actions_left):
    return [piece_runs(tables.observation, pieces), tables.tail.run(actions_left)]


def first_prompt_tokens(tables: PromptTables, pieces, actions_left):
    """Jittable, vmappable: the turn-1 generation prompt, ``(int32[tables.first_len], length)``.

    Equals the tokenizer's encoding of ``chat_text(build_messages([{state, actions_left}]),
    add_generation_prompt=True)``.
    """
    runs = [tables.head.run(0)] + _observation_runs(tables, pieces, actions_left)
    return pack_runs(runs, tables.first_len)


def next_turn_tokens(tables: PromptTables, reward_index, turn, pieces, actions_left, response_ended_with_stop):
    """Jittable, vmappable: what follows turn ``turn - 1``'s response, ``(int32[tables.next_len], length)``.

    The assistant end (only what follows the stop token if the response ended with it), the reward
    message of the previous turn (``reward_index``), and turn ``turn``'s (1-based, >= 2) state and
    generation prompt. Appended to the previous tokens, the sequence equals the tokenizer's encoding
    of the whole chat-templated conversation.
    """
    runs = [
        tables.turn_end.run(jnp.asarray(response_ended_with_stop, jnp.int32)),
        tables.reward.run(reward_index),
        tables.turn_header.run(turn),
    ] + _observation_runs(tables, pieces, actions_left)
    return pack_runs(runs, tables.next_len)
