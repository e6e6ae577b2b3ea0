"""An Idefics3 renderer for the `renderers` package: the tiny VLM's chat (prl/trainer/tiny_model.py
`build_tiny_vlm`) with its images, so the train client can roll out vision environments such as prl_shapes.

`renderers` registers multimodal renderers only for its own model families (Qwen3-VL, Qwen3.5, Gemma 4, Kimi
K2.5, ...) and refuses any other model with a vision config, since its template-driven DefaultRenderer would
drop the images. Name this one instead:

    model:
      renderer: {name: custom, import_path: prl.orchestrator.idefics3.Idefics3Renderer}

What a multimodal renderer provides, and how it reaches the server (renderers.client.generate, as verifiers'
`TrainClient` calls it):

- With images in the prompt the train client always renders with `process_multimodal=False` (and refuses a
  renderer without `supports_process_multimodal`). The renderer then returns the *unexpanded* token ids: ONE
  `<image>` per image, where the chat template writes it. `generate` posts them to vLLM's
  `/inference/v1/generate` with `content_parts` (every image_url of the messages, in order, taken from the
  messages themselves) and `return_token_ids`; vLLM runs the model's processor, expands each `<image>` to
  `<fake_token_around_image><global-img>` + n x `<image>` + `<fake_token_around_image>`, and answers with the
  expanded `prompt_token_ids` and their `mm_placeholders`, which the trace keeps (the renderer's ids as
  `renderer_prompt_ids`). Ids expanded here would be expanded a second time.
- With `process_multimodal=True` a renderer returns `multi_modal_data` (`MultiModalData`: per-image hashes,
  placeholder ranges and processor outputs), which `generate` serializes to vLLM's `features` through a
  per-class table (`renderers.client._build_mm_features`) that has no Idefics3 entry. This renderer returns
  the decoded images there (`mm_items["image"][i]["image"]`, a PIL image; the placeholder range is the one
  `<image>` token), for callers that want the pictures a prompt holds; the train client never sends it.
- `mm_token_type_id_map` ({`<image>` id: 1}) marks the image tokens for the trainer (prime-rl's convention:
  1 image, 2 video), and `bridge_to_next_turn` takes `process_multimodal` and `previous_multi_modal_data` as
  the train client passes them.

The layout is ChatMLRenderer's (the tiny VLM's template is ChatML over content lists: a text part is its
text, an image part one `<image>`); turns extend the last one token for token as there.
"""

from __future__ import annotations

import base64
import hashlib
import io
from typing import Any, Literal

from renderers import Message, MultiModalData, PlaceholderRange, RenderedTokens, ToolSpec

from prl.orchestrator.chatml import ChatMLRenderer, ChatMLRendererConfig, _Tokens

IMPORT_PATH = "prl.orchestrator.idefics3.Idefics3Renderer"
"""What `model.renderer.import_path` names to use this renderer."""

IMAGE_TOKEN = "<image>"
"""Idefics3's image placeholder, one per image in the rendered prompt (vLLM expands it)."""


class Idefics3RendererConfig(ChatMLRendererConfig):
    """Settings of `Idefics3Renderer` (the fields next to `import_path` in `model.renderer`)."""

    name: Literal["idefics3"] = "idefics3"  # type: ignore[assignment]


def is_image_part(part: Any) -> bool:
    """An OpenAI-style image part (`image` or `image_url`), typed or not (renderers' rule)."""
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    return kind in ("image", "image_url") or (kind is None and bool(part.get("image") or part.get("image_url")))


def load_image(part: dict[str, Any]) -> Any:
    """An image part's picture as an RGB PIL image: a PIL image or bytes under `image`, or a `data:` URL
    under `image_url.url` (or `image`). Other URLs are refused: rollouts run offline and vLLM fetches them."""
    from PIL import Image

    raw = part.get("image")
    if raw is None:
        source = part.get("image_url")
        raw = source.get("url") if isinstance(source, dict) else source
    if isinstance(raw, Image.Image):
        return raw.convert("RGB")
    if isinstance(raw, (bytes, bytearray)):
        return Image.open(io.BytesIO(raw)).convert("RGB")
    if isinstance(raw, str) and raw.startswith("data:"):
        return Image.open(io.BytesIO(base64.b64decode(raw.partition(",")[2]))).convert("RGB")
    raise ValueError(f"image part {str(raw)[:60]!r}: expected a PIL image, bytes or a data: URL")


def _image_hash(image: Any) -> str:
    return hashlib.sha256(image.tobytes() + repr(image.size).encode()).hexdigest()[:32]


class _Images:
    """The images of one render, decoded when `decode` (process_multimodal), as `MultiModalData`."""

    def __init__(self, decode: bool):
        self.decode = decode
        self.data = MultiModalData()

    def add(self, part: dict[str, Any], offset: int) -> None:
        if not self.decode:
            return
        image = load_image(part)
        self.data.mm_hashes.setdefault("image", []).append(_image_hash(image))
        self.data.mm_placeholders.setdefault("image", []).append(PlaceholderRange(offset=offset, length=1))
        self.data.mm_items.setdefault("image", []).append({"image": image})

    def result(self) -> MultiModalData | None:
        return None if self.data.is_empty() else self.data


class Idefics3Renderer(ChatMLRenderer):
    """Messages (text and image parts) <-> token ids for the tiny Idefics3 VLM: one `<image>` per image."""

    config_class = Idefics3RendererConfig
    supports_process_multimodal = True
    """Renders with `process_multimodal=False` (what the train client asks for when a prompt has images)."""

    def __init__(self, tokenizer: Any, config: Idefics3RendererConfig | None = None):
        super().__init__(tokenizer, config or Idefics3RendererConfig())
        self._image = self._special(IMAGE_TOKEN)
        self._images: _Images | None = None

    @property
    def mm_token_type_id_map(self) -> dict[int, int]:
        return {self._image: 1}

    def render(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, add_generation_prompt: bool = False,
        process_multimodal: bool = True,
    ) -> RenderedTokens:
        _user_images_only(messages)
        # ChatMLRenderer.render calls _message per message; the images it meets are gathered here for this
        # call only (the train client renders one conversation at a time on a renderer).
        self._images = _Images(process_multimodal)
        try:
            rendered = super().render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
            rendered.multi_modal_data = self._images.result()
            return rendered
        finally:
            self._images = None

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[ToolSpec] | None = None,
        previous_multi_modal_data: MultiModalData | None = None,
        process_multimodal: bool = True,
    ) -> RenderedTokens | None:
        """ChatMLRenderer's bridge; the new messages' images become `<image>` tokens. Decoding them
        (process_multimodal) would need the previous turns' images too, which only `previous_multi_modal_data`
        holds: that case re-renders (None)."""
        if process_multimodal and any(is_image_part(p) for m in new_messages for p in _parts(m)):
            return None
        _user_images_only(new_messages)
        self._images = _Images(False)
        try:
            return super().bridge_to_next_turn(previous_prompt_ids, previous_completion_ids, new_messages,
                                               tools=tools)
        finally:
            self._images = None

    def _message(self, out: _Tokens, message: Message, index: int) -> None:
        content = message.get("content")
        if not any(is_image_part(p) for p in _parts(message)):
            return super()._message(out, message, index)
        # The template's text runs between images, each encoded in one pass; an image is one special token.
        out.special(self._im_start, index)
        run: list[tuple[str, bool]] = [((message.get("role") or "") + "\n", False)]
        for part in content:
            if is_image_part(part):
                if run:
                    out.text(run, index)
                run = []
                if self._images is not None:
                    self._images.add(part, len(out.ids))
                out.special(self._image, index)
            elif isinstance(part, str) and part:
                run.append((part, True))
            elif isinstance(part, dict) and part.get("text"):
                run.append((part["text"], True))
        if run:
            out.text(run, index)
        out.special(self._im_end, index)
        out.text([("\n", False)], index)


def _user_images_only(messages: list[Message]) -> None:
    """Pictures go in user turns (the template writes `<image>` wherever a part is one, but prl_shapes and the
    train client only send them there); elsewhere they would be dropped from the text, so refuse them."""
    for i, message in enumerate(messages):
        if message.get("role") != "user" and any(is_image_part(p) for p in _parts(message)):
            raise ValueError(f"message {i} ({message.get('role')}) has an image part: "
                             f"Idefics3Renderer renders pictures in user messages only")


def _parts(message: Message) -> list[Any]:
    content = message.get("content")
    return content if isinstance(content, list) else []
