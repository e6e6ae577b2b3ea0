"""Rollouts a person can read: the orchestrator keeps a bounded sample of each step's rollouts (RUN/samples,
prl/orchestrator/transcripts.py), `prl rollouts` shows them in the terminal and as one self-contained HTML page.
Against the real orchestrator and verifiers environment (prl_letters) with the stand-in engine."""

from __future__ import annotations

import json
import re

import pytest

from prl.orchestrator import main
from prl.orchestrator.transcripts import ROLLOUT_TEXT_CHARS, clip, step_sample
from prl.orchestrator.rollouts import Rollout
from prl.run.records import Turn
from tests.helpers import prl_cli
from tests.test_orchestrator import engine, make_run


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory, tokenizer_dir):
    """One step of 2 groups x 4 rollouts, its sample kept (environment.sample_rollouts: 16)."""
    run = make_run(tmp_path_factory.mktemp("rollouts"), tokenizer_dir, max_steps=1)
    eng = engine(run)
    try:
        assert main(str(run.root)) == 0
    finally:
        eng.stop()
    return run


def test_each_published_step_keeps_its_rollouts_readable(sampled_run):
    run = sampled_run
    assert run.rollout_sample_steps() == [1]
    sample = run.read_rollout_sample(1)
    assert sample.step == 1 and sample.rollouts == 8 and len(sample.records) == 8
    assert [(r.group, r.index) for r in sample.records] == [(g, i) for g in range(2) for i in range(4)]
    for r in sample.records:
        roles = [t.role for t in r.conversation]
        assert "user" in roles and roles[-1] == "assistant", r
        assert len(r.conversation[-1].text) == r.metrics["reply_chars"], r  # the reply the environment scored
        assert r.env == "prl_letters" and r.fate in ("trained", "zero_advantage") and r.policy_version == 0
        assert (r.advantage is not None) == (r.fate == "trained") and r.completion_tokens > 0 and r.turns == 1
    # what `prl rollouts` reads is what metrics.jsonl says the step scored
    mean = sum(r.reward for r in sample.records) / len(sample.records)
    assert mean == pytest.approx(run.read_metrics("orchestrator")[0]["reward_mean"], abs=1e-6)


def test_prl_rollouts_shows_conversations_sorted_and_filtered(sampled_run):
    run = sampled_run
    out = prl_cli({}, "rollouts", run.root, "--sort", "worst", "--limit", "3").stdout
    headers = re.findall(r"step 1 group (\d) #(\d) \[(\w+)\] prl_letters: reward ([-\d.e]+)", out)
    assert len(headers) == 3, out
    rewards = [float(h[3]) for h in headers]
    assert rewards == sorted(rewards) and "assistant" in out and "user" in out
    lowest = min(r.reward for r in run.read_rollout_sample(1).records)
    assert rewards[0] == pytest.approx(lowest, abs=1e-3)
    assert "no rollout matches" in prl_cli({}, "rollouts", run.root, "--fate", "stale").stdout
    bad = prl_cli({}, "rollouts", run.root, "--steps", "7-9", check=False)
    assert bad.returncode == 2 and "no rollout sample of those steps" in bad.stderr and "Traceback" not in bad.stderr
    bad = prl_cli({}, "rollouts", run.root, "--fate", "lost", check=False)
    assert bad.returncode == 2 and "--fate 'lost': one of trained" in bad.stderr


def test_the_html_page_is_one_file_that_holds_the_steps_and_every_chosen_rollout(sampled_run, tmp_path):
    page = tmp_path / "out.html"
    done = prl_cli({}, "rollouts", sampled_run.root, "--steps", "all", "--html", page)
    assert "wrote" in done.stdout and "8 rollout(s) of 1 step(s)" in done.stdout
    text = page.read_text()
    assert "<script src" not in text and "http" not in text.split("<script id=\"data\"")[0]  # self-contained
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', text, re.S).group(1))
    assert [s["step"] for s in data["steps"]] == [1] and data["steps"][0]["sampled"] == 8
    assert len(data["rollouts"]) == 8 and all(r["conversation"] for r in data["rollouts"])


def test_text_past_the_bound_is_cut_in_the_middle_and_the_sample_keeps_whole_groups():
    long = "a" * (ROLLOUT_TEXT_CHARS + 500) + "END"
    kept, cut = clip(long)
    assert cut and kept.startswith("aaa") and kept.endswith("END") and "characters cut" in kept
    assert clip("short") == ("short", False)
    group = [Rollout(1.0, 0, [], 3, conversation=[Turn(role="user", text="hi")]) for _ in range(4)]
    fates = [(group, [0.5] * 4, "trained"), (group, None, "failed"), (group, None, "stale")]
    sample = step_sample(3, fates, "e", limit=9, rollouts=12)
    assert [(r.group, r.fate) for r in sample.records] == [(0, "trained")] * 4 + [(1, "failed")] * 4
    assert sample.records[0].lag == 2 and sample.records[0].advantage == 0.5 and sample.records[4].advantage is None
    assert len(step_sample(3, fates, "e", limit=2, rollouts=12).records) == 4  # at least the first group whole
    assert step_sample(3, fates, "e", limit=0, rollouts=12).records == []


@pytest.mark.slow
def test_the_page_in_a_real_browser_shows_the_steps_a_conversation_and_filters(sampled_run, tmp_path):
    """`prl rollouts --html` opened in headless Chromium (Debian's): the steps' bars, the newest step's rollouts as
    cards, a click on another step, the fate, reward and text filters as a user types, and a screenshot that is a
    drawn page (not blank). Three steps: the run's one, and two more written from its records with other rewards."""
    import asyncio
    import io
    import shutil

    import msgspec
    from PIL import Image

    from prl.run.rundir import RunDir
    from testkit.browser import HEIGHT, WIDTH, open_page

    run = RunDir(shutil.copytree(sampled_run.root, tmp_path / "run"))
    first = run.read_rollout_sample(1)
    for step, shift in ((2, 0.25), (3, 0.5)):
        records = [msgspec.structs.replace(r, reward=r.reward + shift) for r in first.records]
        run.write_rollout_sample(msgspec.structs.replace(first, step=step, records=records))
    page_path = tmp_path / "page.html"
    prl_cli({}, "rollouts", run.root, "--steps", "all", "--html", page_path)
    rewards = sorted(r.reward + 0.5 for r in first.records)
    fates = [r.fate for r in first.records]
    word = first.records[0].conversation[0].text.split()[0]

    async def drive(page):
        count = "document.querySelectorAll('#rollouts .rollout').length"
        seen = {"steps": await page.eval("[...document.querySelectorAll('#steps .step')].map(e => e.textContent)"),
                "on": await page.eval("document.querySelector('#steps .step.on').textContent"),
                "title": await page.eval("document.getElementById('title').textContent"),
                "cards": await page.eval(count),
                "turn": await page.eval("document.querySelector('#rollouts .rollout .turn').textContent")}
        await page.eval("document.querySelectorAll('#steps .step')[0].click()")
        seen["clicked"] = await page.eval("document.getElementById('title').textContent")
        await page.eval("document.querySelectorAll('#steps .step')[2].click()")

        async def typed(field: str, value: str) -> int:
            await page.eval(f"(() => {{ const e = document.getElementById('{field}'); e.value = {json.dumps(value)}; "
                            f"e.dispatchEvent(new Event('input')); }})()")
            shown = await page.eval(count)
            await page.eval(f"(() => {{ const e = document.getElementById('{field}'); e.value = ''; "
                            f"e.dispatchEvent(new Event('input')); }})()")
            return shown

        seen["min"] = await typed("min", str(rewards[len(rewards) // 2]))
        seen["fate"] = await typed("fate", fates[0])
        seen["q"] = await typed("q", word)
        seen["nothing"] = await typed("q", "no-such-text-anywhere")
        seen["png"] = await page.screenshot()
        return seen

    async def main():
        async with open_page(page_path.as_uri(), tmp_path) as page:
            return await drive(page)

    seen = asyncio.run(main())
    assert [s.split()[:2] for s in seen["steps"]] == [["step", "1"], ["step", "2"], ["step", "3"]], seen["steps"]
    assert seen["on"].startswith("step 3") and seen["title"] == "step 3: 8 rollout(s)" and seen["cards"] == 8
    assert seen["turn"].startswith("user: ") or seen["turn"].startswith("system: "), seen["turn"]
    assert seen["clicked"] == "step 1: 8 rollout(s)"
    assert seen["min"] == sum(r >= rewards[len(rewards) // 2] for r in rewards)
    assert seen["fate"] == fates.count(fates[0])
    assert 1 <= seen["q"] <= 8 and seen["nothing"] == 0
    shot = Image.open(io.BytesIO(seen["png"])).convert("RGB")
    assert shot.size == (WIDTH, HEIGHT)
    colors = shot.getcolors(maxcolors=1 << 20)
    white = max(colors)[0] / (WIDTH * HEIGHT)
    assert len(colors) > 50 and white < 0.97, (len(colors), white)  # text, bars and borders drawn
    shot.save(tmp_path / "page.png")
