"""Write SFT demonstrations for the reverse-text task: chat `messages` JSONL from the
`prl_reverse_text` environment's TRAIN split, the assistant turn being the correct answer.

    python examples/smollm2/reverse_sft_data.py runs/data/reverse-sft.jsonl [--examples 400]

The prompt is built the way the RL run builds it (the env loaded through prl; the `prl`
harness emits a task's system prompt, if any, as a system message and its prompt as the user
turn), so SFT and RL see the same conversation. Only the train split is read: the held-out
eval split that both recipes score on stays unseen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ENV_ID = "prl_reverse_text"


def demonstrations(examples: int) -> list[dict]:
    from prl.orchestrator.env import load_env

    env = load_env(ENV_ID, split="train")
    out = []
    for task in env.taskset.take(examples):
        data = task.data
        # As PrlHarness.launch sends it (APPENDS_SYSTEM_PROMPT: a system prompt stays its own turn).
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        messages += [{"role": "user", "content": data.prompt}, {"role": "assistant", "content": data.text[::-1]}]
        out.append({"messages": messages})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--examples", type=int, default=400, help="demonstrations (the first N train tasks)")
    args = parser.parse_args()
    rows = demonstrations(args.examples)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({len(rows)} demonstrations from the {ENV_ID} train split)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
