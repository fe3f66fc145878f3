"""A launcher: registers GuessDigit under a short name, then runs experiments.run with its flags.

    PYTHONPATH=docs/examples .venv/bin/python docs/examples/train_guess_digit.py --config configs/base.py \
        --config.envs.train.tags="('GuessDigit',)" --config.envs.val.tags="('GuessDigit',)"

Metrics then read ``train/GuessDigit/success`` rather than ``train/guess_digit:GuessDigit/success``.
"""

from guess_digit import GuessDigit

import envs_jax
from experiments import run

envs_jax.register("GuessDigit", GuessDigit)  # before the config is read

if __name__ == "__main__":
    run.run()
