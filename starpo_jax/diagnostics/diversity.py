"""Diversity of reasoning: how many different word n-grams the think texts use (host side, no JAX).

The paper's Echo Trap (RAGEN, Table 1) is reasoning collapsing to one template whatever the
level: the same sentences come back for different prompts. Distinct-n (Li et al., 2016) measures
it: the number of distinct word n-grams over the total number of n-grams in a set of texts, 1.0
when no n-gram repeats, falling towards 0 as the texts repeat each other. It is computed over the
think texts of one env tag's validation trajectories at one step (every level and turn; the
validation set is fixed, so steps compare), logged by ``experiments/run.py`` as
``val-env/<tag>/think_distinct_2gram`` and drawn by ``experiments/report.py``.
"""

from __future__ import annotations

from collections import Counter


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    words = text.lower().split()
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def distinct_ngrams(texts: list[str], n: int = 2) -> float | None:
    """Distinct n-grams / all n-grams over ``texts`` (n-grams never cross texts); None without any."""
    counts = Counter(g for text in texts for g in ngrams(text, n))
    total = sum(counts.values())
    return len(counts) / total if total else None


def think_texts(record: dict) -> list[str]:
    """The non-empty think texts of one trajectory record (``starpo_jax.diagnostics.dumps`` format)."""
    turns = [t for t in record.get("turns") or [] if isinstance(t, dict)]
    return [str(t["think"]) for t in turns if str(t.get("think") or "").strip()]


def think_diversity_metrics(records: list[dict], prefix: str, n: int = 2) -> dict[str, float]:
    """``{prefix}/<tag>/think_distinct_{n}gram`` per tag that has think texts with n-grams."""
    by_tag: dict[str, list[str]] = {}
    for r in records:
        by_tag.setdefault(r["tag"], []).extend(think_texts(r))
    metrics = {}
    for tag, texts in by_tag.items():
        value = distinct_ngrams(texts, n)
        if value is not None:
            metrics[f"{prefix}/{tag}/think_distinct_{n}gram"] = value
    return metrics
