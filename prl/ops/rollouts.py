"""`prl rollouts RUN`: the rollouts a run kept readable (RUN/samples/step_N.json), in the terminal or one HTML page.

    prl rollouts RUN                              # the newest step's sampled rollouts, one conversation each
    prl rollouts RUN --steps 5-9 --sort worst     # a range, lowest reward first
    prl rollouts RUN --steps all --fate zero_advantage --truncated
    prl rollouts RUN --steps all --html out.html  # one self-contained page: steps, rewards over steps, conversations
    prl rollouts eval.json --sort worst           # an evaluation's records (`prl eval ... --records eval.json`)

What the orchestrator writes (prl/orchestrator/transcripts.py): per step whole groups of rollouts, trained and
dropped alike, each with its conversation (each turn, tool calls and their results, pictures counted), reward and
each reward function's score, the environment's metrics, tokens, turns, lag, advantage and what became of it.
Control plane: reads the records with msgspec, shows them with rich; no torch, vLLM or verifiers.
"""

from __future__ import annotations

import html
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from prl.errors import ConfigError, RunDirError
from prl.run import records as rec
from prl.run.records import ROLLOUT_FATES, RolloutRecord, RolloutSample
from prl.run.rundir import RunDir

MAX_RECORDS_FILE_BYTES = 256 << 20
"""Largest evaluation records file read (`prl eval --records`: every rollout of every environment)."""


class RecordsFile:
    """One evaluation's records (`prl eval --records FILE`: a RolloutSample of step 0, every rollout), read where a
    run's samples are read (`rollout_sample_steps`, `read_rollout_sample`, `root`)."""

    def __init__(self, path: Path):
        self.root = path
        try:
            size = path.stat().st_size
        except OSError as e:
            raise ConfigError(f"{path}: {e.strerror or e}") from None
        if size > MAX_RECORDS_FILE_BYTES:
            raise ConfigError(f"{path}: {size} bytes, more than a records file holds ({MAX_RECORDS_FILE_BYTES})")
        try:
            self.sample = rec.read(path, RolloutSample)
        except RunDirError as e:
            raise ConfigError(f"{path}: not a records file of `prl eval --records` or samples/step_N.json ({e})") \
                from None

    def rollout_sample_steps(self) -> list[int]:
        return [self.sample.step] if self.sample is not None else []

    def read_rollout_sample(self, step: int) -> RolloutSample | None:
        return self.sample if self.sample is not None and step == self.sample.step else None


def source(arg: str | None):
    """Where `prl rollouts` / `prl export-data` read: a records file (a path to a .json file), else a run."""
    if arg and arg.endswith(".json") and Path(arg).expanduser().is_file():
        return RecordsFile(Path(arg).expanduser().resolve())
    from prl.ops.status import resolve_run

    return resolve_run(arg)

SORTS = ("step", "best", "worst")
"""`--sort`: the step's order, the highest reward first, the lowest first."""


@dataclass(frozen=True)
class Shown:
    """One rollout of one step, as chosen."""

    step: int
    record: RolloutRecord


def choose_steps(run: RunDir, spec: str) -> list[int]:
    """`latest`, `all`, `N`, `A-B` or `A,B,...` among the steps with a sample; ConfigError naming what is there."""
    have = run.rollout_sample_steps()
    if not have:
        raise ConfigError(f"{run.root} has no rollout samples (samples/step_N.json): they are written as each step "
                          "is published, unless environment.sample_rollouts is 0")
    if spec == "latest":
        return have[-1:]
    if spec == "all":
        return have
    try:
        if "-" in spec:
            low, high = (int(x) for x in spec.split("-", 1))
            wanted = set(range(low, high + 1))
        else:
            wanted = {int(x) for x in spec.split(",")}
    except ValueError:
        raise ConfigError(f"--steps {spec!r}: use latest, all, N, A-B or A,B,...") from None
    chosen = [s for s in have if s in wanted]
    if not chosen:
        raise ConfigError(f"--steps {spec}: no rollout sample of those steps; there are steps {have[0]}..{have[-1]} "
                          f"({len(have)} of them)")
    return chosen


def select(run: RunDir, steps: Sequence[int], *, sort: str = "step", fate: str | None = None, failed: bool = False,
           truncated: bool = False, env: str | None = None, limit: int | None = None) -> list[Shown]:
    """The rollouts of `steps` that pass the filters, sorted, at most `limit`."""
    if sort not in SORTS:
        raise ConfigError(f"--sort {sort!r}: one of {', '.join(SORTS)}")
    if fate is not None and fate not in ROLLOUT_FATES:
        raise ConfigError(f"--fate {fate!r}: one of {', '.join(ROLLOUT_FATES)}")
    out = []
    for step in steps:
        sample = run.read_rollout_sample(step)
        for r in sample.records if sample else ():
            if ((fate is None or r.fate == fate) and (not failed or r.error is not None or r.fate == "failed")
                    and (not truncated or r.truncated) and (env is None or r.env == env)):
                out.append(Shown(step, r))
    if sort != "step":
        out.sort(key=lambda s: s.record.reward, reverse=sort == "best")
    return out[:limit] if limit else out


def _header(s: Shown) -> str:
    r = s.record
    adv = "" if r.advantage is None else f", advantage {r.advantage:+.3f}"
    scores = "".join(f", {k} {v:.3g}" for k, v in r.rewards.items())
    return (f"step {s.step} group {r.group} #{r.index} [{r.fate}] {r.env}: reward {r.reward:.4g}{scores}{adv}; "
            f"{r.completion_tokens} tokens, {r.turns} turns, lag {r.lag}{', truncated' if r.truncated else ''}")


def show(shown: Sequence[Shown], console=None) -> None:
    """Each rollout as a rich panel: its header line, then each turn (role, text, tool calls)."""
    from rich.console import Console, Group
    from rich.panel import Panel
    from rich.text import Text

    console = console or Console()
    for s in shown:
        r = s.record
        parts = []
        for turn in r.conversation:
            head = Text(turn.role + (f" (answers {turn.tool_call_id})" if turn.tool_call_id else "")
                        + (f" [{turn.pictures} picture(s)]" if turn.pictures else ""), style="bold cyan")
            parts.append(head)
            if turn.reasoning:
                parts.append(Text(turn.reasoning, style="dim italic"))
            if turn.text:
                parts.append(Text(turn.text))  # user text: never read as markup
            for call in turn.tool_calls:
                parts.append(Text(f"-> {call.name}({call.arguments})", style="yellow"))
        if r.error:
            parts.append(Text(f"error: {r.error}", style="bold red"))
        if r.metrics:
            parts.append(Text("metrics: " + ", ".join(f"{k} {v:.4g}" for k, v in r.metrics.items()), style="dim"))
        if r.clipped:
            parts.append(Text("(some text was cut to the record's bound)", style="dim"))
        console.print(Panel(Group(*parts) if parts else Text("(no conversation recorded)"),
                            title=Text(_header(s)), title_align="left"))
    if not shown:
        console.print("no rollout matches", markup=False)


def steps_summary(run: RunDir, steps: Sequence[int]) -> list[dict]:
    """Per step: the sample's size, mean reward and what became of its rollouts (the page's overview)."""
    rows = []
    for step in steps:
        sample = run.read_rollout_sample(step)
        if sample is None:
            continue
        rewards = [r.reward for r in sample.records]
        rows.append({"step": step, "sampled": len(sample.records), "rollouts": sample.rollouts,
                     "reward_mean": statistics.fmean(rewards) if rewards else None,
                     "fates": {f: sum(r.fate == f for r in sample.records) for f in ROLLOUT_FATES}})
    return rows


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>prl rollouts: {title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 0; display: flex; height: 100vh; }}
#side {{ width: 300px; overflow-y: auto; border-right: 1px solid #ccc; padding: 8px; }}
#main {{ flex: 1; overflow-y: auto; padding: 8px; }}
.step {{ cursor: pointer; padding: 2px 4px; }} .step.on {{ background: #def; }}
.bar {{ display: inline-block; height: 8px; background: #48c; vertical-align: middle; }}
.grid {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: 8px; }}
.rollout {{ border: 1px solid #bbb; border-radius: 4px; padding: 6px; }}
.rollout h3 {{ font-size: 13px; margin: 0 0 4px; }}
.turn {{ margin: 4px 0; white-space: pre-wrap; word-break: break-word; }}
.role {{ font-weight: bold; color: #066; }} .call {{ color: #950; }} .err {{ color: #b00; }}
.trained {{ border-left: 4px solid #2a2; }} .dropped {{ border-left: 4px solid #aaa; }}
</style></head><body>
<div id="side"><h2>{title}</h2>
<label>fate <select id="fate"><option value="">any</option>{fates}</select></label><br>
<label>reward &ge; <input id="min" type="number" step="any" style="width:6em"></label><br>
<label>text <input id="q" type="search"></label>
<h3>steps</h3><div id="steps"></div></div>
<div id="main"><div id="title"></div><div class="grid" id="rollouts"></div></div>
<script id="data" type="application/json">{data}</script>
<script>
const D = JSON.parse(document.getElementById("data").textContent);
let current = D.steps.length ? D.steps[D.steps.length - 1].step : null;
const el = (tag, cls, text) => {{ const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; }};
function drawSteps() {{
  const box = document.getElementById("steps"); box.replaceChildren();
  const rewards = D.steps.map(s => s.reward_mean).filter(r => r !== null);
  const lo = Math.min(...rewards, 0), hi = Math.max(...rewards, lo + 1e-9);
  for (const s of D.steps) {{
    const row = el("div", "step" + (s.step === current ? " on" : ""));
    const width = s.reward_mean === null ? 0 : 4 + 120 * (s.reward_mean - lo) / (hi - lo);
    row.append(el("span", "", "step " + s.step + " "), Object.assign(el("span", "bar"), {{style: "width:" + width + "px"}}),
               el("span", "", " " + (s.reward_mean === null ? "-" : s.reward_mean.toFixed(3))));
    row.onclick = () => {{ current = s.step; draw(); }};
    box.append(row);
  }}
}}
function drawRollouts() {{
  const fate = document.getElementById("fate").value, min = parseFloat(document.getElementById("min").value);
  const q = document.getElementById("q").value.toLowerCase();
  const box = document.getElementById("rollouts"); box.replaceChildren();
  const shown = D.rollouts.filter(r => r.step === current && (!fate || r.fate === fate)
    && (isNaN(min) || r.reward >= min)
    && (!q || r.conversation.some(t => (t.text || "").toLowerCase().includes(q))));
  document.getElementById("title").textContent = "step " + current + ": " + shown.length + " rollout(s)";
  for (const r of shown) {{
    const card = el("div", "rollout " + (r.fate === "trained" ? "trained" : "dropped"));
    const adv = r.advantage === undefined || r.advantage === null ? "" : ", advantage " + r.advantage.toFixed(3);
    card.append(el("h3", "", "group " + r.group + " #" + r.index + " [" + r.fate + "] reward " + r.reward.toFixed(4)
      + adv + ", " + (r.completion_tokens || 0) + " tokens, lag " + (r.lag || 0) + (r.truncated ? ", truncated" : "")));
    for (const t of r.conversation) {{
      const turn = el("div", "turn");
      turn.append(el("span", "role", t.role + (t.pictures ? " [" + t.pictures + " picture(s)]" : "") + ": "));
      turn.append(el("span", "", t.text || ""));
      for (const c of t.tool_calls || []) turn.append(el("div", "call", "-> " + c.name + "(" + c.arguments + ")"));
      card.append(turn);
    }}
    if (r.error) card.append(el("div", "err", "error: " + r.error));
    box.append(card);
  }}
}}
function draw() {{ drawSteps(); drawRollouts(); }}
for (const id of ["fate", "min", "q"]) document.getElementById(id).oninput = drawRollouts;
draw();
</script></body></html>
"""


def page(run: RunDir, steps: Sequence[int], shown: Sequence[Shown]) -> str:
    """One self-contained HTML page (no server, no network): the steps with their mean reward, and the chosen
    rollouts of the selected step side by side, filtered by fate, reward and text as you type."""
    # A record leaves out its defaults on disk (omit_defaults); the page's script reads fate and conversation
    # of every rollout, so they go in whatever their value (a trained rollout's fate is the default).
    data = {"steps": steps_summary(run, steps),
            "rollouts": [{"step": s.step, **msgspec.to_builtins(s.record), "fate": s.record.fate,
                          "conversation": msgspec.to_builtins(s.record.conversation)} for s in shown]}
    # Inside <script>, "</" would end the element early: JSON allows "<\/" for it.
    embedded = json.dumps(data).replace("</", "<\\/")
    fates = "".join(f'<option value="{f}">{f}</option>' for f in ROLLOUT_FATES)
    return PAGE.format(title=html.escape(run.root.name), fates=fates, data=embedded)
