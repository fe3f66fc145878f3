"""The commands (``python -m experiments.run`` and the others). Each restarts itself once, before its
imports, with its memory in huge pages (``starpo_jax.runtime.huge_pages``)."""

from starpo_jax.runtime.huge_pages import restart_with_huge_pages

restart_with_huge_pages()
