"""bench.append_window's command line: bad input is one line before a model is built."""

import pytest

from experiments.bench import append_window


@pytest.mark.parametrize("argv, message", [
    ("--model nosuch", "unknown model 'nosuch' in --model"),
    ("--batch 0", "--batch must be a positive whole number, not 0"),
    ("--cache 100", "--prompt 267, or --held 1200 + --turn 64, does not fit --cache 100"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        append_window.parse_args(argv.split())
    assert exit_.value.code == 2 and message in capsys.readouterr().err
