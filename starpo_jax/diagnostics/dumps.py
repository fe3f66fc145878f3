"""Trajectories as readable records (host side): what the agent saw, thought, answered and earned.

Rebuilt from the token ids alone: a turn's observation is the text appended before its response,
its response is the sampled text, parsed again with the reference parser for think / answer /
actions. Used for validation JSONL files and the sample printed during training.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from starpo_jax.rollout.multi_turn import RolloutPlan, Trajectories
from starpo_jax.rollout.parsing import decode_response, parse_response_text


def trajectory_records(traj: Trajectories, plan: RolloutPlan, tokenizer, first_seed: int | None = None) -> list[dict]:
    traj = jax_to_numpy(traj)
    records = []
    for b in range(traj.tokens.shape[0]):
        tag = plan.tags[int(traj.tag_id[b])]
        group = int(traj.group_id[b])
        turns, previous_end = [], 0
        for t in range(plan.max_turn):
            if not traj.turn_played[b, t]:
                break
            start, end = int(traj.turn_start[b, t]), int(traj.turn_end[b, t])
            observation = decode_response(tokenizer, traj.tokens[b, previous_end:start])
            response = decode_response(tokenizer, traj.tokens[b, start:end])
            names = None if tag.env.answer_width else _names_for(tag, traj, b)  # None: language actions
            parsed = parse_response_text(response, names, plan.max_actions_per_turn, plan.enable_think)
            actions = list(parsed.actions) if names is None else [names[i] for i in parsed.valid_action_ids]
            turns.append(
                {
                    "observation": observation,
                    "response": response,
                    "think": parsed.think,
                    "answer": parsed.answer,
                    "actions": actions,
                    "format_error": bool(traj.turn_penalised[b, t]),
                    "reward": float(traj.turn_reward[b, t]),
                }
            )
            previous_end = end
        records.append(
            {
                "tag": tag.name,
                "group": group,
                "seed": None if first_seed is None else first_seed + group,
                "success": bool(traj.success[b]),
                "env_reward": float(traj.env_reward[b]),
                "format_penalty_sum": float(traj.format_penalty_sum[b]),
                "num_actions": int(traj.num_actions[b]),
                "turns": turns,
            }
        )
    return records


def _names_for(tag, traj, b) -> tuple[str, ...]:
    """The action names of row b in action-id order (per episode: Bandit's arms swap places)."""
    return tuple(tag.env.action_names[int(i)] for i in traj.action_name_ids[b] if i >= 0)


def jax_to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def write_jsonl(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def format_record(record: dict) -> str:
    """One trajectory as a readable block for the terminal."""
    lines = [f"[{record['tag']} group {record['group']}] success={record['success']} reward={record['env_reward']:+.2f}"]
    for i, turn in enumerate(record["turns"], 1):
        state = turn["observation"].split("State:\n")[-1].split("\nYou have")[0]
        lines.append(f"  turn {i} state:\n    " + state.replace("\n", "\n    "))
        lines.append(f"  response: {turn['response'][:300]!r}")
        lines.append(f"  answer: {turn['answer']!r} -> actions {turn['actions']} reward {turn['reward']:+.2f}"
                     + (" (format penalty)" if turn["format_error"] else ""))
    return "\n".join(lines)
