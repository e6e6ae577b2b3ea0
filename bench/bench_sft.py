"""SFT throughput: `prl`'s SFT trainer vs a plain single-process transformers loop, same model and data.

    python bench/bench_sft.py [--nproc 1] [--steps 5] [--hidden 256] [--layers 4] [--batch 16] [--turns 3]

Builds a Qwen3-style model and a chat dataset in-process (conversations of `--turns` user/assistant
exchanges of a few hundred characters), plans `configs/sft-tiny.yaml` on them and runs
`python -m prl.trainer` (torchrun, `--nproc` CPU ranks); the trainer's tokens/s (training compute:
forward, loss, backward, optimizer) come from metrics.jsonl, skipping step 1 (warm-up). The baseline
runs the same model on the same steps in this process the way one writes SFT by hand with
transformers: each step's conversations (the same ones, from `prl.trainer.sft.SFTData`), one padded
batch, `labels` = -100 outside the assistant tokens, transformers' own loss, backward, clipping,
AdamW. Prints both and the ratio prl / plain; the two sides share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from prl.run.rundir import RunDir  # noqa: E402
from testkit.plans import local_plan, write_plan  # noqa: E402
from prl.trainer.tiny_model import build_tiny_model  # noqa: E402
from testkit.trainer_helpers import launch  # noqa: E402

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def write_dataset(path: Path, n: int, turns: int, seed: int = 0) -> Path:
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    with path.open("w") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": "You answer in the phonetic alphabet."}]
            for _ in range(turns):
                messages += [{"role": "user", "content": text(rng.randint(10, 30))},
                             {"role": "assistant", "content": text(rng.randint(20, 60))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def plain_tokens_per_s(model_dir: Path, data_path: Path, steps: int, batch: int, max_len: int, lr: float) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prl.trainer.sft import SFTData
    from prl.trainer.sft_data import read_conversations

    data = SFTData(list(read_conversations(data_path)), AutoTokenizer.from_pretrained(model_dir), max_len, batch, 0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rates = []
    for step in range(1, steps + 1):
        samples = data.samples(step)  # tokenizing is outside the timing, as in the trainer's tokens_per_s
        width = max(len(s.token_ids) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        labels = torch.full((len(samples), width), -100, dtype=torch.long)
        attention = torch.zeros(len(samples), width, dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            ids[i, :n] = torch.tensor(s.token_ids)
            attention[i, :n] = 1
            labels[i, :n] = torch.tensor(s.token_ids).masked_fill(torch.tensor(s.loss_mask) == 0, -100)
        t = time.perf_counter()
        model(input_ids=ids, attention_mask=attention, labels=labels, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        rates.append(sum(len(s.token_ids) for s in samples) / (time.perf_counter() - t))
    return statistics.median(rates[1:] or rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="conversations per step")
    ap.add_argument("--turns", type=int, default=3, help="user/assistant exchanges per conversation")
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    args = ap.parse_args()
    max_len, lr = 1024, 1e-4
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 128), head_dim=64)
        data = write_dataset(tmp / "chat.jsonl", n=args.batch * args.steps, turns=args.turns)
        run = write_plan(RunDir(tmp / "run"), local_plan(tmp / "run", model_dir, [
            f"trainer.gpus_per_node={args.nproc}", f"sft.data={data}", f"model.max_model_len={max_len}",
            f"training.batch_size={args.batch}", f"training.max_steps={args.steps}", f"training.lr={lr}",
            f"training.micro_batch_tokens={args.micro_batch_tokens}", "training.checkpoint_interval=0"],
            topology="sft-tiny"))
        threads = max(1, torch.get_num_threads() // args.nproc)  # the ranks share this machine's cores
        launch(run, args.nproc, resume="none", timeout=1800, threads=threads)
        m = run.read_metrics("trainer")[1:]
        prl_rate = statistics.median(r["tokens_per_s"] for r in m)
        whole = statistics.median(r["tokens"] / r["step_s"] for r in m)
        tokens = statistics.median(r["tokens"] for r in m)
        plain = plain_tokens_per_s(model_dir, data, args.steps, args.batch, max_len, lr)
    print(f"model hidden {args.hidden} x {args.layers} layers; {args.batch} conversations/step "
          f"(~{tokens:.0f} tokens); {args.nproc} trainer rank(s); median over steps 2..{args.steps}")
    print(f"  prl SFT (train compute) {prl_rate:10.0f} tokens/s")
    print(f"  prl SFT (whole step)    {whole:10.0f} tokens/s  (incl. data, metrics; last step: publish)")
    print(f"  plain transformers      {plain:10.0f} tokens/s  (one padded batch per step)")
    print(f"ratio prl/plain = {prl_rate / plain:.2f}")


if __name__ == "__main__":
    main()
