"""Response parsing: the RAGEN oracle, the token→bytes table and the in-graph byte machine.

The byte machine is compiled once per tokenizer (fixed batch and length: ``B`` rows of ``T``
tokens, names per row) and checked against the oracle on random and adversarial replies.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from starpo_jax.models import bundled
from starpo_jax.models.loading import smollm2_tokenizer
from starpo_jax.rollout import parsing

SOKOBAN = ("Up", "Down", "Left", "Right")
FROZEN_LAKE = ("Left", "Down", "Right", "Up")
ARMS = ("Phoenix", "Dragon", "Trader", "Librarian")
NAME_SETS = (SOKOBAN, FROZEN_LAKE, ARMS)
NAME_BYTES = 9
B, T, K = 32, 96, 3
TEXT_WIDTH = 16  # answer text kept per piece when checking the text (longer pieces are cut)

_parse = jax.jit(parsing.parse_response_tokens, static_argnums=(3, 5))


def _tokenizer(name):
    return bundled.qwen_tokenizer() if name == "qwen" else smollm2_tokenizer()


@functools.cache
def _token_tables(name):
    return parsing.build_token_bytes_table(_tokenizer(name))


def _tables(name, names) -> parsing.ParserTables:
    table, lengths = _token_tables(name)
    names = parsing.encode_action_names(names, NAME_BYTES)
    return parsing.ParserTables(jnp.asarray(table), jnp.asarray(lengths), names)


def _pad(rows, height=B, width=T):
    """Token rows as fixed-shape (ids, active) arrays, so every batch reuses one compile."""
    ids = np.zeros((height, width), np.int32)
    active = np.zeros((height, width), bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        active[i, : len(row)] = True
    return jnp.asarray(ids), jnp.asarray(active)


def _run(name, id_rows, names_per_row, think_per_row, answer_width=0):
    """Parse up to B token-id rows in graph; names and enable_think are per row."""
    pad = B - len(id_rows)
    tables = _tables(name, [list(n) for n in names_per_row] + [list(SOKOBAN)] * pad)
    ids, active = _pad(id_rows)
    result = _parse(tables, ids, active, K, jnp.asarray(list(think_per_row) + [True] * pad), answer_width)
    return jax.tree.map(lambda a: a[: len(id_rows)], jax.device_get(result))


def _assert_agrees(name, id_rows, names_per_row, think_per_row):
    """The byte machine gives the oracle's ids, counts, match and penalty on every row, and the
    text of each kept piece (its first ``TEXT_WIDTH`` bytes) where the reply is valid UTF-8."""
    result = _run(name, id_rows, names_per_row, think_per_row, TEXT_WIDTH)
    tokenizer = _tokenizer(name)
    for i, row in enumerate(id_rows):
        text = parsing.decode_response(tokenizer, row)
        ref = parsing.parse_response_text(text, names_per_row[i], K, bool(think_per_row[i]))
        got = (
            bool(result.matched[i]),
            tuple(result.action_ids[i, : result.n_kept[i]].tolist()),
            tuple(result.valid_action_ids[i, : result.n_valid[i]].tolist()),
            int(result.n_valid[i]),
            bool(result.format_error[i]),
        )
        want = (ref.matched, ref.action_ids, ref.valid_action_ids, ref.n_valid, ref.format_error)
        assert got == want, f"row {i}: {text!r} (think={think_per_row[i]}): got {got}, want {want}"
        assert (result.action_ids[i, result.n_kept[i] :] == -1).all()
        assert (result.valid_action_ids[i, result.n_valid[i] :] == -1).all()
        if "\ufffd" not in text:  # raw bytes of broken UTF-8 have no exact text to compare with
            pieces = [a.encode() for a in ref.actions] + [b""] * (K - len(ref.actions))
            got_text = [bytes(result.answers.bytes[i, k, : result.answers.lengths[i, k]]) for k in range(K)]
            assert got_text == [p[:TEXT_WIDTH] for p in pieces], f"row {i}: {text!r}"
            assert not result.answers.bytes[i][np.arange(TEXT_WIDTH)[None] >= result.answers.lengths[i][:, None]].any()


# ------------------------------------------------------------------------------------------------
# The oracle (RAGEN's semantics, hand-checked)
# ------------------------------------------------------------------------------------------------


def test_oracle_well_formed_reply():
    r = parsing.parse_response_text(" go up</think> \n<answer> Up || LEFT ||foo</answer>tail", SOKOBAN, 5)
    assert r.matched and r.think == "go up" and r.answer == "Up || LEFT ||foo"
    assert r.actions == ("Up", "LEFT", "foo") and r.action_ids == (0, 2, -1)
    assert r.valid_action_ids == (0, 2) and r.n_valid == 2 and r.format_error
    assert r.llm_response == "<think>go up</think><answer>Up || LEFT ||foo</answer>"


def test_oracle_truncates_and_rebuilds_the_answer():
    r = parsing.parse_response_text("</think><answer>up||down|| left ||right</answer>", SOKOBAN, 2)
    assert r.actions == ("up", "down") and r.action_ids == (0, 1) and not r.format_error
    assert r.llm_response == "<think></think><answer>up || down</answer>"


def test_oracle_lazy_think_and_failed_tags():
    # the first </think> is not followed by \s*<answer>; the think capture runs to the second one
    r = parsing.parse_response_text("a</think>b</thin</think>\t<answer>x</answer>", SOKOBAN, 5)
    assert r.matched and r.think == "ab</thin" and r.answer == "x"
    # a partial "<ans" after </think> breaks that occurrence: no match at all
    assert not parsing.parse_response_text("a</think> <ans<answer>x</answer>", SOKOBAN, 5).matched
    # no </answer> after the only </think>…<answer>: no match, the raw text is kept
    r = parsing.parse_response_text("t</think><answer>Up", SOKOBAN, 5)
    assert not r.matched and r.format_error and r.llm_response == "<think>t</think><answer>Up"
    r = parsing.parse_response_text(" Up</answer>", SOKOBAN, 5, enable_think=False)
    assert r.matched and r.action_ids == (0,) and r.llm_response == "<answer>Up</answer>"


def test_oracle_removes_tags_stage_by_stage():
    # removing <think> forms </think>, which the next stage removes; the pieces join to "Up"
    text = "</think><answer>U</th<think>ink>p || |<|im_end|>|Down</answer>"
    r = parsing.parse_response_text(text, SOKOBAN, 5)
    assert r.actions == ("Up", "Down") and r.action_ids == (0, 1)
    # a tag that forms only after a *later* stage is kept: "<think>" stays, the piece is unknown
    r = parsing.parse_response_text("</think><answer><thi</think>nk>Up</answer>", SOKOBAN, 5)
    assert r.actions == ("<think>Up",) and r.format_error


def test_action_names_are_checked_and_padded():
    with pytest.raises(ValueError, match="differ case-insensitively"):
        parsing.parse_response_text("", ["Up", "UP"], 1)
    with pytest.raises(ValueError, match="ASCII"):
        parsing.encode_action_names(["Up", "Ünter"])
    names = parsing.encode_action_names([("Up", "DOWN"), ("Left",)], max_name_bytes=5)
    assert names.lengths.tolist() == [[2, 4], [4, 0]]  # the empty name never matches
    assert names.bytes[0, 1].tolist() == list(b"down\0")


# ------------------------------------------------------------------------------------------------
# Token → bytes table
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen", "smollm2"])
def test_token_bytes_reproduce_decode(name):
    tokenizer = _tokenizer(name)
    table, lengths = _token_tables(name)
    assert table.shape[0] == len(tokenizer) and lengths.max() == table.shape[1]
    added = sorted(tokenizer.backend_tokenizer.get_added_tokens_decoder())
    assert all(lengths[i] == 0 for i in tokenizer.all_special_ids)
    rng = np.random.default_rng(0)
    exact = 0
    for _ in range(400):
        ids = rng.integers(0, len(tokenizer), rng.integers(1, 10)).tolist()
        ids += rng.choice(added, 2).tolist()  # special and added (e.g. Qwen's <think>) tokens
        rng.shuffle(ids)
        data = b"".join(table[i, : lengths[i]].tobytes() for i in ids)
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        assert decoded == parsing.decode_response(tokenizer, ids)
        if data == decoded.encode():
            exact += 1
        else:  # a token cut a UTF-8 character: U+FFFD replacement is the same in Rust and Python
            assert data.decode("utf-8", errors="replace") == decoded
    assert exact > 300


def test_token_bytes_pad_to_the_model_vocab(qwen_tokenizer):
    table, lengths = parsing.build_token_bytes_table(qwen_tokenizer, vocab_size=151936)
    assert table.shape[0] == 151936 and (lengths[len(qwen_tokenizer) :] == 0).all()


def test_token_bytes_need_a_byte_level_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    word_level = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    with pytest.raises(ValueError, match="byte-level BPE"):
        parsing.build_token_bytes_table(word_level)


# ------------------------------------------------------------------------------------------------
# The byte machine: targeted cases
# ------------------------------------------------------------------------------------------------


def _nested_tags(depth: int) -> str:
    """Tags 1..depth, each split open by the one before: only stage-by-stage removal clears it."""
    text = parsing.TAGS[0]
    for tag in parsing.TAGS[1:depth]:
        text = tag[:2] + text + tag[2:]
    return text


TARGETED = [
    ("</think><answer>Up</answer>", True),
    ("I think</think>\n\n<answer> up || DOWN || left || right</answer>", True),  # truncated to K
    ("a</thin</think> <ans<answer>Left||||right</answer>", True),
    ("x<answer>Up</answer></think> <answer>Down</answer>", True),  # <answer> inside think
    ("</think>\u3000\u2028<answer>\u00a0Up\u2003||\x1cdown\x1f</answer>", True),  # Unicode spaces
    ("</think><answer>||Up|||Down||</answer>", True),
    ("</think><answer>U|p | Up</answer>", True),
    ("</think><answer> || \n ||</answer>", True),  # only empty pieces: matched, no action
    ("</think><answer>Up</ans</answer>", True),
    ("</think><answer>Up<</answer>", True),
    ("</think><answer>uP<answer> || <think>Left</answer>", True),
    ("</think><answer>U" + _nested_tags(6) + "p||D<<" + _nested_tags(6) + "own</answer>", True),
    ("</think><answer><<<<<<<<" + _nested_tags(6) + "Up</answer>", True),
    ("</think><answer>U<thi</think>nk>p || L<|im_<answer>end|>eft</answer>", True),  # stage order
    ("</think><answer>U</<answer>think>p||<<|im_end|>/answer>Up</answer>", True),
    ("</think><answer>Up</answer", True),  # never closed
    ("</think><answer> (2 +\u00a03) | 4 <|im_end|>*\u30005 \u3000||  9/3\u2003</answer>", True),  # answer text
    ("Up</answer>", False),
    (" right || <|im_start|>up</answer>", False),
    ("<think>Up</think></answer>", False),
]


@pytest.mark.parametrize("name", ["qwen", "smollm2"])
def test_targeted_replies(name):
    tokenizer = _tokenizer(name)
    rows = [tokenizer.encode(text, add_special_tokens=False) for text, _ in TARGETED]
    _assert_agrees(name, rows, [SOKOBAN] * len(rows), [think for _, think in TARGETED])
    # the deep chains really exercise stage-by-stage removal
    assert parsing.parse_response_text(TARGETED[11][0], SOKOBAN, K).actions == ("Up", "D<<own")
    assert parsing.parse_response_text(TARGETED[12][0], SOKOBAN, K).actions == ("<<<<<<<<Up",)


def test_tags_split_at_every_byte(qwen_tokenizer):
    """A reply split in two at every position, each half tokenised alone, parses the same."""
    text = "t</think> <answer>Up || <|im_end|>LEFT</answer>"
    rows = [
        qwen_tokenizer.encode(text[:cut], add_special_tokens=False)
        + qwen_tokenizer.encode(text[cut:], add_special_tokens=False)
        for cut in range(1, len(text))
    ]
    for start in range(0, len(rows), B):
        batch = rows[start : start + B]
        result = _run("qwen", batch, [SOKOBAN] * len(batch), [True] * len(batch))
        assert result.matched.all() and (result.action_ids[:, :2] == [0, 2]).all()
        assert not result.format_error.any()


def test_one_token_at_a_time_matches_scan(qwen_tokenizer):
    """The decode-loop API (one jitted feed per token, inactive rows frozen) equals the scan."""
    texts = ["abc</think><answer>Down || up</answer> trailing", "</think><answer>Left</answer>", "no"]
    rows = [qwen_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    ids, active = _pad(rows)
    tables = _tables("qwen", [SOKOBAN] * B)
    feed = jax.jit(parsing.parser_feed_tokens)
    state = parsing.init_parser_state(B, K, enable_think=True)
    for t in range(max(map(len, rows))):
        state = feed(tables, state, ids[:, t], active[:, t])
    # inactive tokens, and ids past the tokenizer (a model's padded vocab), change nothing
    state = feed(tables, state, ids[:, 0], jnp.zeros(B, bool))
    state = feed(tables, state, jnp.full(B, len(qwen_tokenizer) + 7), jnp.ones(B, bool))
    stepped = jax.device_get(parsing.parser_result(state))
    scanned = jax.device_get(_parse(tables, ids, active, K, jnp.ones(B, bool)))
    for a, b in zip(jax.tree.leaves(stepped), jax.tree.leaves(scanned)):
        np.testing.assert_array_equal(a, b)
    assert stepped.valid_action_ids[0, :2].tolist() == [1, 0] and not stepped.matched[2]


def test_think_tokens_count_tokens_before_the_closing_one(qwen_tokenizer):
    def ids(*tokens):
        return [qwen_tokenizer.convert_tokens_to_ids(t.replace(" ", "Ġ")) for t in tokens]

    think, answer = ids("I", " will", " go"), ids(" <", "answer", ">", "Up", "</", "answer", ">")
    split_close, whole_close = ids("</", "think", ">"), [qwen_tokenizer.convert_tokens_to_ids("</think>")]
    rows = [think + split_close + answer, think + whole_close + answer, whole_close + answer]
    rows += [answer, answer[3:]]  # no </think>; no thinking at all
    assert parsing.decode_response(qwen_tokenizer, rows[0]) == "I will go</think> <answer>Up</answer>"
    assert parsing.decode_response(qwen_tokenizer, rows[1]) == "I will go</think> <answer>Up</answer>"
    result = _run("qwen", rows, [SOKOBAN] * 5, [True, True, True, True, False])
    # "</think>" completes on token 5 (after 5 tokens), or on Qwen's whole-tag token 3;
    # -1 without a match, 0 without thinking
    assert result.think_tokens.tolist() == [5, 3, 0, -1, 0]
    assert result.matched.tolist() == [True, True, True, False, True]


def test_bandit_names_per_row(smollm2_tokenizer):
    arms = [("Phoenix", "Dragon"), ("Dragon", "Phoenix"), ("Trader", "Librarian"), ("Librarian", "Trader")]
    bank = parsing.encode_action_names(arms)
    order = np.array([0, 1, 1, 2, 3] + [0] * (B - 5))  # each row's arm order, as the env state says
    table, lengths = _token_tables("smollm2")
    names = jax.tree.map(lambda a: a[order], bank)
    tables = parsing.ParserTables(jnp.asarray(table), jnp.asarray(lengths), names)
    answers = [" dragon ", "DRAGON", "phoenix", "Librarian", "Trader || dragon"]
    texts = [f"</think><answer>{a}</answer>" for a in answers]
    ids, active = _pad([smollm2_tokenizer.encode(t, add_special_tokens=False) for t in texts])
    result = jax.device_get(_parse(tables, ids, active, K, jnp.ones(B, bool)))
    assert result.action_ids[:5, :2].tolist() == [[1, -1], [0, -1], [1, -1], [1, -1], [1, -1]]
    assert result.format_error[:5].tolist() == [False, False, False, False, True]  # "dragon" isn't an arm


# ------------------------------------------------------------------------------------------------
# The byte machine against the oracle: property tests
# ------------------------------------------------------------------------------------------------

FRAGMENTS = [
    "<think>", "</think>", "<answer>", "</answer>", "<|im_end|>", "<|im_start|>", "<|im_",
    "<ans", "</ans", "wer>", "<thin", "</thin", "</th", "ink>", "k>", "<", ">", "/", "</",
    "||", "|", "|||", " ", "  ", "\n", "\t", "\r\n", "\x0b", "\x0c", "\x1c", "\u00a0", "\u3000", "\u2028",
    "Up", "up", "UP", "uP", "LEFT", "Right", "down", "Down ", "left", "foo", "Upp", "U", "p",
    "Phoenix", "dragon", "LIBRARIAN", "é", "日本", "—",
]
# U+212A KELVIN SIGN lower-cases to ASCII "k" in Python only (documented divergence)
CHARS = st.characters(blacklist_categories=["Cs"], blacklist_characters="\u212a")


@st.composite
def _tag_chain(draw):
    """Tags nested inside each other: the outer one forms only if the inner is removed first."""
    stages = draw(st.lists(st.integers(0, len(parsing.TAGS) - 1), min_size=1, max_size=4))
    text = parsing.TAGS[stages[0]]
    for stage in stages[1:]:
        tag = parsing.TAGS[stage]
        cut = draw(st.integers(1, len(tag) - 1))
        text = tag[:cut] + text + tag[cut:]
    return text


JUNK = st.lists(st.sampled_from(FRAGMENTS) | st.text(CHARS, max_size=3) | _tag_chain(), max_size=10).map("".join)
SHORT_JUNK = st.lists(st.sampled_from(FRAGMENTS) | st.text(CHARS, max_size=2), max_size=3).map("".join)
SEPARATOR = st.sampled_from(["||", " || ", "|||", "||||", "|", "| |"])
NAME_SET = st.sampled_from(range(len(NAME_SETS)))
SPACE = st.sampled_from(["", "", " ", "  ", "\n", " \t\n", "\u3000", "\u00a0", "\x0b"])


@st.composite
def _action(draw, names):
    """An action name (usually the row's) in any case, padded with spaces, sometimes cut by tags."""
    name = draw(st.sampled_from(names) | st.sampled_from(SOKOBAN + ARMS))
    name = draw(st.sampled_from([name, name.lower(), name.upper(), name.swapcase()]))
    cut = draw(st.integers(0, len(name)))
    inside = draw(st.sampled_from([""] * 10 + list(parsing.TAGS)) | st.sampled_from(["", ""]) | _tag_chain())
    return draw(SPACE) + name[:cut] + inside + name[cut:] + draw(SPACE)


@st.composite
def _shaped_reply(draw):
    """(text, name set, enable_think) that usually matches: think, answer pieces, tail."""
    names, think = draw(NAME_SET), draw(st.booleans())
    action = _action(NAME_SETS[names])
    pieces = draw(st.lists(st.one_of(action, action, action, SHORT_JUNK), min_size=1, max_size=5))
    answer = "".join(piece + draw(SEPARATOR) for piece in pieces)
    answer = answer[: draw(st.sampled_from([None] * 4 + [0, 3, 10, 20]))]  # sometimes cut short
    head = f"{draw(JUNK)}</think>{draw(SPACE)}<answer>" if think else ""
    return f"{head}{answer}</answer>{draw(JUNK)}", names, think


BATCH = st.lists(
    st.one_of(st.tuples(JUNK, NAME_SET, st.booleans()), _shaped_reply(), _shaped_reply()),
    min_size=B,
    max_size=B,
)
PROPERTY_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _agree_on_texts(name, batch):
    tokenizer = _tokenizer(name)
    rows = [tokenizer.encode(text, add_special_tokens=False)[:T] for text, _, _ in batch]
    _assert_agrees(name, rows, [NAME_SETS[n] for _, n, _ in batch], [think for _, _, think in batch])


@PROPERTY_SETTINGS
@given(BATCH)
def test_property_qwen_text(batch):
    _agree_on_texts("qwen", batch)


@PROPERTY_SETTINGS
@given(BATCH)
def test_property_smollm2_text(batch):
    _agree_on_texts("smollm2", batch)


@PROPERTY_SETTINGS
@given(st.lists(st.tuples(st.integers(0, 2**31 - 1), st.booleans()), min_size=B, max_size=B))
def test_property_random_token_ids(seeds):
    """Arbitrary token ids (any bytes, broken UTF-8, special tokens) mixed with tag tokens."""
    tokenizer = _tokenizer("qwen")
    useful = sorted({i for f in FRAGMENTS for i in tokenizer.encode(f, add_special_tokens=False)})
    rows = []
    for seed, _ in seeds:
        rng = np.random.default_rng(seed)
        length = rng.integers(0, T)
        any_id = rng.integers(len(tokenizer), size=length)
        row = np.where(rng.random(length) < 0.7, rng.choice(useful, length), any_id).tolist()
        rows.append([] if "\u212a" in parsing.decode_response(tokenizer, row) else row)
    names = [NAME_SETS[seed % len(NAME_SETS)] for seed, _ in seeds]
    _assert_agrees("qwen", rows, names, [think for _, think in seeds])
