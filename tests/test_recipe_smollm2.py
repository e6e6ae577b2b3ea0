"""The SmolLM2 recipes' helpers (docs/recipes/): SFT demonstrations from the real reverse-text and
calculator envs, the curve tables, and the SFT -> RL topologies being RL ones started from other weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

SMOLLM2 = REPO / "examples" / "smollm2"


def _script(name: str, *args) -> str:
    result = subprocess.run([sys.executable, str(SMOLLM2 / name), *map(str, args)], capture_output=True, text=True,
                            cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_sft_data_is_the_train_splits_prompts_with_correct_answers_and_no_eval_text(tmp_path):
    from prl.orchestrator.env import load_env
    from prl_reverse_text import lcs_ratio

    out = tmp_path / "data" / "reverse.jsonl"
    _script("sft_data.py", "prl_reverse_text", out, "--examples", 50)
    rows = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    train = [task.data for task in load_env("prl_reverse_text", split="train").taskset.take(50)]
    eval_texts = {task.data.text for task in load_env("prl_reverse_text", split="eval").taskset}
    assert len(rows) == 50
    for messages, data in zip(rows, train):
        assert [m["role"] for m in messages] == ["user", "assistant"]  # the env gives no system prompt
        assert messages[0]["content"] == data.prompt and data.text not in eval_texts
        assert lcs_ratio(messages[1]["content"], data.text[::-1]) == 1.0


@pytest.mark.slow  # three scripts that load the env and its MCP server: 40-90 s on 2 shared cores
def test_calc_demonstrations_tokenize_as_the_rl_renderer_renders_the_rollout(tmp_path, tok):
    """SFT renders a demonstration with the tokenizer's chat template; RL renders the rollout with prl's
    ChatML renderer and the tool list the MCP server gives. Both must give the same token ids, and the
    call must parse back to the task's expression, whose value the answer turn holds."""
    from prl.orchestrator.chatml import ChatMLRenderer
    from prl.orchestrator.env import load_env
    from prl_calc import SYSTEM_PROMPT, evaluate

    full, call_only = tmp_path / "calc.jsonl", tmp_path / "calc-calls.jsonl"
    _script("sft_data.py", "prl_calc", full, "--examples", 20)
    _script("sft_data.py", "prl_calc", call_only, "--examples", 20, "--call-only")
    rows = [json.loads(line)["messages"] for line in full.read_text().splitlines()]
    calls = [json.loads(line)["messages"] for line in call_only.read_text().splitlines()]
    tasks = [task.data for task in load_env("prl_calc", split="train").taskset.take(20)]
    renderer = ChatMLRenderer(tok)
    system = rows[0][0]["content"]
    listed = system[system.index("<tools>\n") + 8:system.index("\n</tools>")]
    tools = [json.loads(line) for line in listed.splitlines()]
    assert [t["function"]["name"] for t in tools] == ["calc"] and system.startswith(SYSTEM_PROMPT)
    for messages, short, data in zip(rows, calls, tasks):
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert short == messages[:3] and messages[1]["content"] == data.prompt
        rl = renderer.render_ids([{"role": "system", "content": SYSTEM_PROMPT}, *messages[1:3],
                                  {"role": "tool", "content": str(data.answer)}, messages[4]], tools=tools)
        assert tok.apply_chat_template(messages, tokenize=False) == tok.decode(rl)
        assert list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]) == rl
        parsed = renderer.parse_response(tok.encode(messages[2]["content"], add_special_tokens=False))
        (call,) = parsed.tool_calls
        assert call.name == "calc" and evaluate(call.arguments["expression"]) == data.answer
        assert messages[4]["content"] == f"Answer: {data.answer}"
    result = subprocess.run([sys.executable, str(SMOLLM2 / "sft_data.py"), "prl_reverse_text", tmp_path / "x.jsonl",
                             "--call-only"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 2 and "--call-only is for prl_calc" in result.stderr
    assert not (tmp_path / "x.jsonl").exists()


def _metrics(run: Path, records: list[dict]) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_curve_tables_for_sft_and_two_rl_runs(tmp_path):
    sft = _metrics(tmp_path / "sft", [{"role": "trainer", "step": s, "loss": 8.0 / s, "epoch": s / 4, "loss_tokens": 100,
                                       "step_s": 10.0} for s in (1, 2)])
    assert _script("reward_curve.py", sft).splitlines()[2:] == ["| 1 | 8.0000 | 0.25 | 100 | 10.0 |",
                                                               "| 2 | 4.0000 | 0.50 | 100 | 10.0 |"]

    def rl(name: str, base: float) -> Path:
        records = [{"role": "orchestrator", "step": s, "reward_mean": base + s / 100} for s in range(1, 11)]
        return _metrics(tmp_path / name, records + [{"role": "orchestrator", "step": 10, "eval": True,
                                                     "reward_mean": base + 0.5}])

    out = _script("reward_curve.py", rl("a", 0.1), "--compare", rl("b", 0.2), "--every", 5).splitlines()
    assert out[2:5] == ["| 1 | 0.110 | 0.210 |  |  |", "| 5 | 0.150 | 0.250 |  |  |", "| 10 | 0.200 | 0.300 | 0.600 | 0.700 |"]
    assert out[6].startswith("a: mean train reward steps 1-5 0.130, last 5 0.180; eval 0.600 (step 10)")


def test_rl_after_sft_is_the_rl_only_recipe_from_the_sft_runs_weights():
    def load(name: str) -> dict:
        return yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())

    rl_only, after_sft, sft = load("smollm2-reverse"), load("smollm2-reverse-from-sft"), load("smollm2-sft-reverse")
    assert after_sft["model"].pop("from_run") == f"runs/prl-runs/{sft['name']}"
    assert rl_only["model"].pop("path") == sft["model"]["path"]
    assert after_sft["model"] == rl_only["model"]
    for topo in (rl_only, after_sft):
        del topo["name"], topo["training"]["max_steps"]  # the runs' lengths may differ, not what a step does
    assert after_sft == rl_only
