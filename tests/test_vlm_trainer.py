"""The trainer on the tiny vision-language model (Idefics3): rollout batches carry each sample's pictures as the
encoded files the server got (prl/run/batch.py), the trainer re-runs the model's image processor on them and
puts their features where each packed sample's image tokens are (prl/trainer/vision.py).

Checked against a plain single-process transformers loop (one sample at a time, its own pixels): the 2-rank
FSDP2 trainer's losses, its logprobs before the first update (mismatch_kl ~ 0 when the batch's sampling
logprobs are transformers'), and its published weights; with the image encoder frozen (the default) and
trained (`model.train_vision`), where a rank whose micro-batch has no picture must not hang its peers.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from prl.run.batch import BatchError, Sample, publish_batch, read_batch
from prl.run.rundir import RunDir
from prl.trainer.loss import policy_loss, token_logprobs_and_entropy
from testkit.plans import write_plan
from tests.tiny_model import build_tiny_vlm
from testkit.trainer_helpers import launch, make_plan

STEPS = 2
COLOURS = ("red", "green", "blue", "orange", "purple", "black")


def picture(colour: str, shape: int) -> bytes:
    """A 56x56 PNG: a coloured disc or square on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    draw = ImageDraw.Draw(image)
    (draw.ellipse if shape % 2 else draw.rectangle)((8 + shape, 8, 40, 44 - shape), fill=colour)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")
    return path, AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32)


def pixels(processor, pictures: list[bytes]) -> dict:
    from PIL import Image

    if not pictures:
        return {}
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pictures]
    return dict(processor.image_processor(images, return_tensors="pt"))


def hf_logprobs(model, processor, ids: list[int], pictures: list[bytes], reply_start: int) -> torch.Tensor:
    """transformers' logprob of each token given the ones before it ([len - 1]), as vLLM computes them: the
    pictures' features at the prompt's image tokens, a sampled image token read as text (its own embedding)."""
    row = torch.tensor([ids])
    embeds = model.get_input_embeddings()(row)
    if pictures:
        features = model.get_image_features(**pixels(processor, pictures)).pooler_output
        at = row == model.config.image_token_id
        at[:, reply_start:] = False
        embeds = embeds.masked_scatter(at[..., None], features.reshape(-1, embeds.shape[-1]).to(embeds.dtype))
    logits = model(inputs_embeds=embeds).logits[0, :-1]
    return token_logprobs_and_entropy(logits, row[0, 1:])[0]


def make_samples(step: int, vlm) -> list[Sample]:
    """Chats of one or two pictures + a question, then a random reply; the sampling logprobs are transformers'
    (so the trainer's first forward must reproduce them). Step 1: five samples, the last without a picture (one
    rank runs a picture-less micro-batch and a padding pass); step 2: two samples, the second without a picture,
    so one rank's whole step has none (a trained encoder then gets no gradient there without the blank)."""
    from PIL import Image

    path, processor, model = vlm
    rng = np.random.default_rng(step)
    out = []
    n, text_only = (5, 4) if step == 1 else (2, 1)
    for i in range(n):
        n_pics = 1 + (i % 2)
        pics = [picture(COLOURS[(step + i + j) % len(COLOURS)], i + j) for j in range(n_pics)]
        content = [{"type": "image"}] * n_pics + [{"type": "text", "text": f"how many shapes? {i}"}]
        if i == text_only:
            pics, content = [], [{"type": "text", "text": "no picture here"}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pics] or None
        prompt_ids = processor(text=prompt, images=images, return_tensors="np")["input_ids"][0].tolist()
        reply = rng.integers(0, 400, int(rng.integers(3, 9))).tolist()
        if i == 1:
            reply[1] = model.config.image_token_id  # sampled by the policy: a text token, no picture
        ids = prompt_ids + reply
        with torch.no_grad():
            lp = [0.0] + hf_logprobs(model, processor, ids, pics, len(prompt_ids)).tolist()
        out.append(Sample(token_ids=ids, loss_mask=[0] * len(prompt_ids) + [1] * len(reply),
                          inference_logprobs=lp, advantage=float(rng.normal()), policy_version=max(step - 1, 0),
                          images=pics))
    return out


def reference(vlm, steps: int, train_vision: bool):
    """Plain transformers + AdamW, one sample at a time: per-step losses and the final model."""
    from transformers import AutoModelForImageTextToText

    path, processor, _ = vlm
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    text = {id(p) for p in model.get_decoder().parameters()} | {id(p) for p in model.lm_head.parameters()}
    params = [p for p in model.parameters() if train_vision or id(p) in text]
    training = make_plan(path).settings().training
    opt = torch.optim.AdamW(params, lr=training.lr, weight_decay=training.weight_decay)
    losses = []
    for step in range(1, steps + 1):
        samples = make_samples(step, vlm)
        n = sum(sum(s.loss_mask) for s in samples)
        total = 0.0
        for s in samples:
            logp = hf_logprobs(model, processor, list(s.token_ids), list(s.images), s.loss_mask.index(1))
            m = len(s.token_ids) - 1
            loss, _ = policy_loss(logp, torch.tensor(s.inference_logprobs[1:]), torch.full((m,), s.advantage),
                                  torch.tensor(s.loss_mask[1:]), training.loss, n)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, training.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


def published(path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def run_trainer(vlm, root, train_vision: bool, cp: int = 1):
    """The 2-rank trainer on STEPS steps of `make_samples`: 2 data-parallel ranks, or one row split over 2 cp ranks."""
    path = vlm[0]
    plan = make_plan(path, root, max_steps=STEPS, checkpoint_interval=STEPS, micro_batch_tokens=96,
                     overrides=[f"model.train_vision={str(train_vision).lower()}", f"trainer.cp={cp}"])
    run = write_plan(RunDir(root), plan)
    for step in range(1, STEPS + 1):
        publish_batch(run, step, make_samples(step, vlm), dp_size=2 // cp, micro_batch_tokens=96)
    first = read_batch(run.rollouts(1))  # the trainer removes what it consumed
    launch(run, 2, resume="none", timeout=300)
    return run, first


def split_pictures(batch, image_token_id: int, cp: int) -> list[int]:
    """Micro-batches of `batch` whose image tokens fall on both sides of a cp split (features split over ranks)."""
    out = []
    for i, mb in enumerate(batch.micro_batches(0, 1, 96)):
        image = mb.input_ids == image_token_id
        if 0 < image[:-(-mb.num_tokens // cp)].sum() < image.sum():
            out.append(i)
    return out


@pytest.mark.slow  # three 2-rank trainer runs (~40 s each)
@pytest.mark.parametrize("train_vision,cp", [(False, 1), (True, 1), (True, 2)],
                         ids=["encoder-frozen", "encoder-trained", "encoder-trained-cp2"])
def test_two_rank_vlm_training_matches_transformers_on_the_same_pictures(vlm, tmp_path, train_vision, cp):
    """cp 2: each rank keeps the features of its half's image tokens, and the encoder's gradient is both halves'."""
    path = vlm[0]
    run, batch = run_trainer(vlm, tmp_path / "run", train_vision, cp)
    if cp > 1:
        assert split_pictures(batch, vlm[2].config.image_token_id, cp), "test data must split pictures over cp ranks"
    else:
        assert batch.arrays["sample_images"].tolist() == [0, 1, 3, 4, 6, 6]  # the text-only sample has none
    metrics = run.read_metrics("trainer")
    ref_losses, ref_model = reference(vlm, STEPS, train_vision)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)
    # Before the first update the trainer's logprobs are transformers' with each sample's own pixels.
    assert metrics[0]["mismatch_kl"] < 1e-8, metrics[0]
    out, base = published(run.weights(STEPS)), published(path)
    ref = {k: v for k, v in ref_model.state_dict().items()}
    assert out.keys() == base.keys() == ref.keys()  # vision tower and connector published, as vLLM loads them
    encoder = [k for k in ref if not k.startswith(("model.text_model.", "lm_head."))]
    assert encoder and any(k.startswith("model.connector.") for k in encoder)
    for k, v in ref.items():
        torch.testing.assert_close(out[k], v, rtol=0, atol=1e-4, msg=lambda m: f"{k}: {m}")
    moved = [k for k in encoder if not torch.equal(out[k], base[k])]
    assert bool(moved) == train_vision, moved
    assert any(not torch.equal(out[k], base[k]) for k in ref if k.startswith("model.text_model."))


def test_a_batch_carries_each_sample_s_pictures_and_refuses_too_many_bytes(tmp_path):
    """The pictures' arrays round-trip per sample and per packed row (in row order); a sample over the per-sample
    bound and malformed picture arrays are refused with what is wrong."""
    from prl.run import batch as B

    run = RunDir(tmp_path / "run").create()
    samples = [Sample([1, 2, 3, 4], [0, 0, 1, 1], [0.0] * 4, 1.0, images=[b"png-a", b"png-bb"]),
               Sample([5, 6, 7], [0, 1, 1], [0.0] * 3, -1.0),
               Sample([8, 9], [0, 1], [0.0] * 2, 0.5, images=[b"png-c"])]
    publish_batch(run, 1, samples, dp_size=1, micro_batch_tokens=64)
    batch = read_batch(run.rollouts(1))
    assert [batch.images_of(i) for i in range(3)] == [[b"png-a", b"png-bb"], [], [b"png-c"]]
    (row,) = batch.micro_batches(0, 1, 64)
    assert row.images == [p for i in row.sample_ids for p in batch.images_of(i)]
    rows = batch.micro_batches(0, 1, 4)
    assert sorted(p for r in rows for p in r.images) == [b"png-a", b"png-bb", b"png-c"]
    B.publish_batch(run, 2, samples[1:2], dp_size=1, micro_batch_tokens=64)
    text = read_batch(run.rollouts(2))
    assert "images" not in text.arrays and text.micro_batches(0, 1, 64)[0].images == []
    big = Sample([1, 2], [0, 1], [0.0, 0.0], 1.0, images=[b"x" * (B.MAX_SAMPLE_IMAGE_BYTES + 1)])
    with pytest.raises(BatchError, match=r"sample 1: its 1 pictures hold 64.0 MiB, over .* 64 MiB per sample"):
        B.to_arrays([samples[1], big])
    arrays = B.to_arrays(samples)
    with pytest.raises(BatchError, match="without the other picture arrays"):
        B.validate({k: v for k, v in arrays.items() if k != "image_offsets"})
    arrays["sample_images"] = np.asarray([0, 2, 1, 3])
    with pytest.raises(BatchError, match="sample_images needs 4 entries from 0 to the 3 pictures"):
        B.validate(arrays)


def test_pictures_and_image_tokens_must_come_together(vlm):
    """A row with image tokens but no picture (or the reverse) is refused before the forward, naming the row;
    an undecodable picture is refused naming it."""
    from prl.run.batch import MicroBatch
    from prl.trainer.vision import Pictures

    path, processor, _ = vlm
    pictures = Pictures.of(path, train_vision=False)
    image = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    ids = np.asarray([1, image, image, 2])
    zeros = np.zeros(4, dtype=np.float32)
    row = MicroBatch([3], ids, np.arange(4), zeros.astype(np.uint8), zeros, zeros)
    with pytest.raises(BatchError, match=r"samples \[3\]: 0 pictures for 2 image tokens"):
        pictures.check(row, "the micro-batch of samples [3]")
    row.loss_mask[2] = 1  # a sampled image token is text: one placeholder left, and no picture for it
    with pytest.raises(BatchError, match=r"0 pictures for 1 image tokens"):
        pictures.check(row, "the micro-batch of samples [3]")
    with pytest.raises(BatchError, match="picture 0: a picture PIL cannot decode"):
        pictures.inputs([b"not a png"], "the micro-batch of samples [3]")
    assert set(pictures.inputs([picture("red", 1)], "x")) == {"pixel_values", "pixel_attention_mask"}


def shapes_conversations(root, n: int = 8) -> "Path":
    """A JSONL of n picture conversations, "how many shapes?" -> the count, half the pictures as files next to
    it (relative paths), half embedded as data URLs."""
    import base64

    (root / "pics").mkdir(parents=True)
    lines = []
    for i in range(n):
        count = 1 + i % 3
        data = picture(COLOURS[i % len(COLOURS)], count)
        if i % 2:
            part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
        else:
            (root / "pics" / f"{i}.png").write_bytes(data)
            part = {"type": "image", "path": f"pics/{i}.png"}
        lines.append(json.dumps({"messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "How many shapes?"}]},
            {"role": "assistant", "content": str(count)}]}))
    path = root / "shapes.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sft_conversations_with_pictures_tokenize_as_the_processor_does_and_train(vlm, tmp_path):
    """SFT data with pictures (a relative path, an embedded data URL): the sample's ids are the processor's for the
    rendered chat and its pictures, the loss covers the assistant's reply and end marker only, the pictures ride
    in the sample; a 1-rank SFT run on them lowers the loss."""
    from PIL import Image

    from prl.trainer.sft_data import read_conversations, tokenize_conversation
    from testkit.plans import local_plan

    path, processor, _ = vlm
    data = shapes_conversations(tmp_path / "data")
    conversations = list(read_conversations(data))
    image = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    for i, messages in enumerate(conversations[:2]):
        sample = tokenize_conversation(processor, messages, 256, image)
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]},
                {"role": "assistant", "content": str(1 + i % 3)}]
        pics = [Image.open(io.BytesIO(p)).convert("RGB") for p in sample.images]
        expected = processor(text=processor.apply_chat_template(chat), images=pics, return_tensors="np")
        assert list(sample.token_ids) == expected["input_ids"][0].tolist()
        trained = processor.tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask) if m])
        assert trained == f"{1 + i % 3}<|im_end|>\n", trained
        assert len(sample.images) == 1 and Image.open(io.BytesIO(sample.images[0])).size == (56, 56)

    run = RunDir(tmp_path / "run")
    plan = local_plan(run.root, path, ["trainer.gpus_per_node=1", f"sft.data={data}", "training.max_steps=6",
                                       "training.batch_size=8", "training.micro_batch_tokens=128",
                                       "training.checkpoint_interval=6", "training.lr=5e-3"], topology="sft-tiny")
    write_plan(run, plan)
    launch(run, 1, resume="none", timeout=300)
    losses = [m["loss"] for m in run.read_metrics("trainer")]
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0], losses


def sft_chat(turns: int, pictures: int = 1, adjacent: bool = False, late: bool = False, system: bool = False):
    """A checked SFT conversation: `turns` user/assistant turns; the user's turns alternate pictures and text only
    (`late`: the first has none), each picture followed by a caption unless `adjacent`."""
    messages = [{"role": "system", "content": "You count shapes."}] if system else []
    for t in range(turns):
        parts = []
        for j in range(pictures):
            parts.append({"type": "image", "bytes": picture(COLOURS[(t + j) % len(COLOURS)], t + j)})
            if not adjacent:
                parts.append({"type": "text", "text": f"picture {j}."})
        parts.append({"type": "text", "text": "how many shapes?"})
        messages += [{"role": "user", "content": parts if (t % 2 == 0) != late else "and now?"},
                     {"role": "assistant", "content": f"{t + 2} shapes"}]
    return messages


@pytest.mark.parametrize("chat", [dict(turns=1), dict(turns=3, system=True), dict(turns=2, pictures=2),
                                  dict(turns=2, pictures=2, adjacent=True), dict(turns=3, late=True)],
                         ids=["one-turn", "three-turns", "two-pictures", "adjacent-pictures", "picture-later"])
def test_sft_picture_spans_run_the_processor_once_with_every_prefix_s_bounds(vlm, monkeypatch, chat):
    """The ids and loss spans of a conversation with pictures are what running the processor on every rendered
    prefix gives, from one processor call (the prefixes' text is tokenized and mapped into the expanded ids)."""
    from prl.trainer import sft_data

    processor = vlm[1]
    messages = sft_chat(**chat)
    exact = sft_data.picture_spans_exact(processor, messages)
    calls = []
    preprocess = processor.image_processor.preprocess
    monkeypatch.setattr(sft_data, "picture_spans_exact", lambda *a: calls.append(a) or exact)
    monkeypatch.setattr(processor.image_processor, "preprocess", lambda *a, **k: calls.append(k) or preprocess(*a, **k))
    assert sft_data.picture_spans(processor, messages) == exact
    assert len(calls) == 1, "one image-processor call, no fallback"
    assert len(exact[1]) == chat["turns"]


def test_expanded_positions_maps_text_tokens_around_each_picture_s_run_or_refuses():
    """Placeholder 9 expands to runs; text tokens map into the expanded ids; an ambiguous or foreign expansion
    gives None (the caller then runs the processor on every prefix)."""
    from prl.trainer.sft_data import expanded_positions

    plain = [1, 2, 9, 3, 4, 9, 9, 5]
    whole = [1, 2, 7, 9, 9, 7, 3, 4, 7, 9, 7, 7, 9, 7, 5]
    where = expanded_positions(plain, whole, 9)
    assert where[:3] == [0, 1, 2] and where[3:6] == [6, 7, 8] and where[6] == -1 and where[7:] == [14, 15]
    assert expanded_positions([1, 9, 3, 4, 9, 3, 4], [1, 9, 3, 4, 3, 4, 9, 3, 4], 9) is None  # "3 4" twice
    assert expanded_positions([1, 9, 2], [5, 9, 9, 2], 9) is None  # the text before differs
    assert expanded_positions([1, 2], [1, 2], 9) is None  # no picture


@pytest.mark.parametrize("part, message", [
    ({"type": "image", "path": "pics/missing.png"}, r"messages\[0\]\.content\[0\]: cannot read the picture .*missing"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGEgcG5n"}},
     r"messages\[0\]\.content\[0\]: not a picture PIL can decode"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
     r"messages\[0\]\.content\[0\]: only data:image/\.\.\.;base64 URLs are read \(nothing is fetched\)"),
    ({"type": "video", "path": "v.mp4"}, r"messages\[0\]\.content\[0\]: a part must be"),
])
def test_a_bad_picture_in_sft_data_is_named_with_file_line_and_part(tmp_path, part, message):
    from prl.trainer.sft_data import DataError, read_conversations

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}
    bad = {"messages": [{"role": "user", "content": [part]}, {"role": "assistant", "content": "2"}]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=f"{path}:2: " + message):
        list(read_conversations(path))


def test_pictures_for_a_text_model_and_pictures_from_the_assistant_are_refused(tmp_path):
    from prl.trainer.sft_data import DataError, read_conversations

    data = shapes_conversations(tmp_path / "data", n=2)
    assert len(list(read_conversations(data))) == 2
    lines = data.read_text().splitlines()
    turned = json.loads(lines[0])
    turned["messages"][1]["content"] = turned["messages"][0]["content"]
    data.write_text(json.dumps(turned) + "\n")
    with pytest.raises(DataError, match=r":1: messages\[1\] \(assistant\) has a picture; pictures go in user"):
        list(read_conversations(data))
