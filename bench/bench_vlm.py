"""The trainer on image + text batches vs a plain transformers loop, and what pictures cost in the rollout batch.

    python bench/bench_vlm.py [--nproc 1] [--steps 4] [--samples 16] [--reply 48] [--hidden 64]

Builds the tiny VLM (Idefics3, `build_tiny_vlm`; `--hidden` sets its text model's width), publishes `--steps`
rollout batches of prl_shapes-like chats (one or two 56x56 PNG pictures, a question, a `--reply`-token reply)
and runs `python -m prl.trainer` on them (torchrun, `--nproc` CPU ranks). Its tokens/s (training compute:
the image processor, forward, loss, backward, optimizer; median over steps 2..N) is compared with a plain
single-process transformers loop over the same samples, with their own processed pixels, one at a time and
as one right-padded batch per step: transformers' cross-entropy on the reply (labels=), backward, AdamW.
Prints each and the ratios trainer/plain.

SFT: ms per conversation with pictures to tokenize and mask (`picture_spans`, one processor call) against
running the processor on every rendered prefix (`picture_spans_exact`).

Batch size: per sample, the bytes of `batch.safetensors` and the pictures' share of them, against what the
pictures' processed pixels (`pixel_values` fp32, `pixel_attention_mask`) would take instead.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from prl.run.batch import BATCH_FILE, Sample, publish_batch, read_batch  # noqa: E402
from prl.run.rundir import RunDir  # noqa: E402
from testkit.plans import write_plan  # noqa: E402
from prl.trainer.tiny_model import build_tiny_vlm  # noqa: E402
from testkit.trainer_helpers import launch, make_plan  # noqa: E402

COLOURS = ("red", "green", "blue", "orange", "purple")


def png(seed: int) -> bytes:
    """A 56x56 PNG of 1-4 coloured shapes, one per 14-pixel cell."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", (56, 56), "white")
    draw = ImageDraw.Draw(image)
    for cell in torch.randperm(16, generator=g)[:int(torch.randint(1, 5, (1,), generator=g))].tolist():
        x, y = (cell % 4) * 14, (cell // 4) * 14
        (draw.ellipse if cell % 2 else draw.rectangle)((x + 2, y + 2, x + 11, y + 11), fill=COLOURS[cell % 5])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def samples(processor, step: int, n: int, reply: int) -> list[Sample]:
    from PIL import Image

    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(n):
        pictures = [png(step * 1000 + i * 10 + j) for j in range(1 + i % 2)]
        content = [{"type": "image"}] * len(pictures) + [{"type": "text", "text": "How many shapes?"}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pictures]
        ids = processor(text=prompt, images=images, return_tensors="np")["input_ids"][0].tolist()
        answer = torch.randint(0, 400, (reply,), generator=g).tolist()
        out.append(Sample(ids + answer, [0] * len(ids) + [1] * reply, [-6.0] * (len(ids) + reply),
                          float(torch.randn(1, generator=g)), policy_version=step - 1, images=pictures))
    return out


def padded(processor, batch: list[Sample]) -> dict[str, torch.Tensor]:
    """The step as one right-padded transformers batch: ids, attention mask, labels, each sample's pixels."""
    from PIL import Image

    width = max(len(s.token_ids) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(batch):
        n = len(s.token_ids)
        ids[i, :n], mask[i, :n] = torch.tensor(list(s.token_ids)), 1
        labels[i, :n] = ids[i, :n].masked_fill(torch.tensor(list(s.loss_mask)) == 0, -100)
    images = [[Image.open(io.BytesIO(p)).convert("RGB") for p in s.images] for s in batch]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            **processor.image_processor(images, return_tensors="pt")}


def plain_tokens_per_s(model_dir: Path, processor, batches: list[list[Sample]], one_by_one: bool) -> float:
    """transformers alone (the encoder frozen, as the trainer's): each sample with its own pixels, one at a time,
    or the step as one padded batch (tokens counted without the padding)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    text = {id(p) for p in model.get_decoder().parameters()} | {id(p) for p in model.lm_head.parameters()}
    params = [p for p in model.parameters() if id(p) in text]
    opt = torch.optim.AdamW(params, lr=1e-5)
    rates = []
    for batch in batches:
        t = time.perf_counter()
        tokens = 0
        if not one_by_one:
            inputs = padded(processor, batch)
            model(**inputs, use_cache=False).loss.backward()
            tokens = int(inputs["attention_mask"].sum())
        for s in batch if one_by_one else ():
            images = [Image.open(io.BytesIO(p)).convert("RGB") for p in s.images]
            pixels = dict(processor.image_processor(images, return_tensors="pt"))
            ids = torch.tensor([list(s.token_ids)])
            labels = ids.masked_fill(torch.tensor([list(s.loss_mask)]) == 0, -100)
            model(input_ids=ids, labels=labels, use_cache=False, **pixels).loss.backward()
            tokens += ids.shape[1]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        rates.append(tokens / (time.perf_counter() - t))
    return statistics.median(rates[1:] or rates)


def batch_sizes(run: RunDir, processor) -> dict[str, float]:
    """Per sample: the batch file, its pictures, and the pictures as processed pixels instead."""
    from PIL import Image

    batch = read_batch(run.rollouts(1))
    n = batch.num_samples
    pictures = [p for i in range(n) for p in batch.images_of(i)]
    pixels = processor.image_processor([Image.open(io.BytesIO(p)).convert("RGB") for p in pictures],
                                       return_tensors="pt")
    pixel_bytes = sum(v.numel() * v.element_size() for v in pixels.values())
    return {"file": (run.rollouts(1) / BATCH_FILE).stat().st_size / n, "pictures": sum(map(len, pictures)) / n,
            "pixels": pixel_bytes / n, "tokens": batch.num_tokens / n}


def sft_tokenize_ms(processor, turns: int, repeats: int = 20) -> tuple[float, float]:
    """ms per SFT conversation (`turns` turns, a picture in each user turn) by `picture_spans` (one processor
    call) and by `picture_spans_exact` (the processor on every rendered prefix)."""
    from prl.trainer.sft_data import picture_spans, picture_spans_exact

    messages = []
    for t in range(turns):
        messages += [{"role": "user", "content": [{"type": "image", "bytes": png(t)},
                                                  {"type": "text", "text": "How many shapes?"}]},
                     {"role": "assistant", "content": f"{t + 1}"}]
    out = []
    for spans in (picture_spans, picture_spans_exact):
        t0 = time.perf_counter()
        for _ in range(repeats):
            spans(processor, messages)
        out.append((time.perf_counter() - t0) / repeats * 1e3)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--reply", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    args = ap.parse_args()
    from transformers import AutoProcessor

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_vlm(tmp / "model", hidden_size=args.hidden)
        processor = AutoProcessor.from_pretrained(model_dir)
        batches = [samples(processor, s, args.samples, args.reply) for s in range(1, args.steps + 1)]
        run = write_plan(RunDir(tmp / "run"), make_plan(
            model_dir, tmp / "run", world_size=args.nproc, max_steps=args.steps, checkpoint_interval=0,
            micro_batch_tokens=args.micro_batch_tokens, lr=1e-5, max_off_policy_steps=args.steps))
        for s, batch in enumerate(batches, 1):
            publish_batch(run, s, batch, dp_size=args.nproc, micro_batch_tokens=args.micro_batch_tokens)
        sizes = batch_sizes(run, processor)
        launch(run, args.nproc, resume="none", timeout=1800, threads=max(1, torch.get_num_threads() // args.nproc))
        trainer = statistics.median(r["tokens_per_s"] for r in run.read_metrics("trainer")[1:])
        plain = plain_tokens_per_s(model_dir, processor, batches, one_by_one=True)
        pad = plain_tokens_per_s(model_dir, processor, batches, one_by_one=False)
        sft = {turns: sft_tokenize_ms(processor, turns) for turns in (1, 3)}
    print(f"tiny VLM (text hidden {args.hidden}); {args.samples} samples/step, 1-2 pictures and {args.reply} reply "
          f"tokens each ({sizes['tokens']:.0f} tokens/sample); {args.nproc} trainer rank(s); median over steps "
          f"2..{args.steps}")
    print(f"  trainer (train compute) {trainer:10.0f} tokens/s")
    print(f"  plain, one by one       {plain:10.0f} tokens/s")
    print(f"  plain, padded batch     {pad:10.0f} tokens/s")
    print(f"ratio trainer/plain = {trainer / plain:.2f} (one by one), {trainer / pad:.2f} (padded batch)")
    print(f"batch bytes per sample: {sizes['file']:.0f} (pictures {sizes['pictures']:.0f}); the same pictures as "
          f"processed pixels: {sizes['pixels']:.0f}; ratio pictures/pixels = {sizes['pictures'] / sizes['pixels']:.3f}")
    for turns, (once, every) in sft.items():
        print(f"SFT tokenization, {turns} turn(s) with a picture each: {once:.2f} ms/conversation (one processor "
              f"call) vs {every:.2f} (every prefix); ratio = {every / once:.1f}x")


if __name__ == "__main__":
    main()
