"""experiments/bench/turn.py: one rollout turn (append, decode) timed in two source trees, ABBA."""

import pytest

import helpers

REPO = str(helpers.REPO)
turn = helpers.script_module(helpers.REPO / "experiments" / "bench" / "turn.py")


def test_one_side_times_an_append_and_a_whole_decode():
    record = turn.main(["--quick", "--repeats", "2", "--side", REPO])
    assert record["tree"] == REPO and len(record["append_s"]) == len(record["decode_s"]) == 2
    assert all(t > 0 for t in record["append_s"] + record["decode_s"])
    assert record["turn_s"] == [a + d for a, d in zip(record["append_s"], record["decode_s"])]


def test_one_side_times_rows_in_prefix_groups_that_share_their_first_tokens():
    """``--group 2 --shared 8``: the quick workload's 4 rows as two prefix groups sharing 8 of their
    16 held tokens; the decode still runs the whole budget on every row."""
    record = turn.main(["--quick", "--group", "2", "--shared", "8", "--side", REPO])
    assert len(record["decode_s"]) == 1 and record["decode_s"][0] > 0


def test_one_side_times_the_rollouts_turn_with_some_rows_playing():
    """``--playing``: 5 of 16 rows play (a half batch of the rows still playing); the side checks
    that exactly they decoded the whole budget."""
    record = turn.main(["--quick", "--rows", "16", "--playing", "5", "--side", REPO])
    assert set(record) == {"tree", "turn_s", "compile_s"} and len(record["turn_s"]) == 1 and record["turn_s"][0] > 0


def test_the_sides_alternate_and_the_ratio_is_other_over_this(tmp_path, monkeypatch):
    seen = []

    def fake_side(args, tree, argv):
        seen.append(tree)
        slow = 3.0 if tree == "/elsewhere" else 1.0
        return {"tree": tree, "append_s": [slow], "decode_s": [2 * slow], "turn_s": [3 * slow]}

    monkeypatch.setattr(turn, "run_side", fake_side)
    monkeypatch.setattr(turn.os.path, "isdir", lambda path: True)
    report = turn.main(["--tree", "/elsewhere", "--rounds", "2", "--out", str(tmp_path / "turn.json")])
    assert seen == ["/elsewhere", REPO, REPO, "/elsewhere"] * 2
    assert report["other_over_this"] == {"append_s": 3.0, "decode_s": 3.0, "turn_s": 3.0}
    assert (tmp_path / "turn.json").exists()


def test_a_policys_report_says_whether_the_trees_sampled_the_same_tokens(tmp_path, monkeypatch):
    """``--policy``: the sides' token hashes decide ``same_tokens``; the workload names the run."""
    (tmp_path / "run" / "checkpoints" / "3").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text("{}")
    for hashes, same in ((("a", "a"), True), (("a", "b"), False)):
        def fake_side(args, tree, argv, hashes=hashes):
            return {"tree": tree, "rollout_s": [2.0 if tree == "/elsewhere" else 1.0],
                    "tokens_sha1": hashes[tree == "/elsewhere"]}

        monkeypatch.setattr(turn, "run_side", fake_side)
        monkeypatch.setattr(turn.os.path, "isdir", lambda path: True)
        report = turn.main(["--tree", "/elsewhere", "--policy", str(tmp_path / "run"), "--rounds", "1",
                            "--out", str(tmp_path / "turn.json")])
        assert report["same_tokens"] is same and report["other_over_this"] == {"rollout_s": 2.0}
        assert report["workload"]["policy"] == str(tmp_path / "run") and "rows" not in report["workload"]


def test_bad_input_is_one_sentence_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        turn.main(["--held", "600", "--append", "90", "--new", "48"])
    assert "do not fit a cache of 640 slots" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        turn.main(["--playing", "65"])
    assert "--playing 65 must be between 1 and --rows 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        turn.main(["--group", "0"])
    assert "--group 0 must be between 1 and --rows 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        turn.main(["--shared", "301"])
    assert "--shared 301 must be between 0 and --held 300" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        turn.main(["--tree", str(tmp_path)])
    assert "has no starpo_jax package" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        turn.main(["--policy", str(tmp_path)])
    assert f"--policy {tmp_path} is not a run folder" in capsys.readouterr().err
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        turn.main(["--policy", str(tmp_path)])
    assert "holds no saved step" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        turn.main(["--env", "FrozenLake"])
    assert "give --policy too" in capsys.readouterr().err
