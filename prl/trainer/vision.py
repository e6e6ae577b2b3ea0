"""Vision-language models in the trainer: the model class, the frozen or trained image encoder, and the pixels.

A VLM (a config with a `vision_config` sub-config, e.g. Idefics3, Qwen3-VL) is built as transformers'
image-text-to-text class. Its *language model* (`get_decoder()`) and output layer are what RL trains by default;
the *image encoder* (every other parameter: the vision tower and the connector that projects its features into
the text embeddings) is frozen unless `model.train_vision` is set.

Pictures reach the trainer as the encoded bytes the server was sent (prl/run/batch.py); `Pictures` re-runs the
model's own image processor on them, as vLLM's renderer did, and the model's forward puts their features where
the prompt's (already expanded) image tokens are, in order. A packed row carries its samples' pictures in row
order, so each sample's tokens get its own pictures.

Context parallelism (Idefics3/SmolVLM; `CP_PICTURE_CONNECTORS`): every cp rank runs the image encoder on all of
the row's pictures (the encoder is small beside a long row's language model, and its attention stays whole), and
keeps the features of the image tokens in its own slice of the row: the k-th image token of the row takes the
k-th feature row, so rank c, whose slice starts after k0 image tokens and holds k1 - k0 of them, keeps features
[k0, k1) (`picture_span`, applied by a hook on the connector, `install_cp`). The features' gradients are each
rank's own positions', which FSDP2 sums over the ranks like every other gradient.

FSDP2 and ranks without pictures: only the language model's decoder layers become FSDP units; the encoder's
parameters stay in the root unit, which every rank gathers in every forward, so a rank whose micro-batch has no
picture (or a padding pass) never misses a collective. A trained encoder must also get a gradient on every rank
(FSDP2 reduce-scatters the parameters that have one): such a micro-batch gets one blank picture appended as a
sample of its own, with no loss (`with_encoder_pass`).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from prl.errors import ConfigError
from prl.planner.capabilities import CP_PICTURE_CONNECTORS
from prl.run.batch import BatchError, MicroBatch

PIXEL_KEYS_SKIPPED = ("input_ids", "attention_mask")
"""What the image processor returns besides pixels (the pixel inputs are the rest: `pixel_values`, masks, grids)."""
BLANK_FIELDS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs")
"""The arrays `Pictures.blank` fills (a scoring server's logprobs are zeros for it)."""
SAMPLED_IMAGE_TOKEN = -1
"""The id a *sampled* image token gets in the trainer's input ids (`Pictures.sampled`): a model that generates its
image token (a tiny random one does) gave vLLM a text token there, with the token's embedding and no picture,
while transformers' forward puts picture features at every image token. The embedding maps it back (`install`),
and the forward's placeholder match (`input_ids == image_token_id`) skips it."""
PIXEL_PREFIXES = ("pixel_", "image_")
"""A prepared micro-batch's keys that go to the model's forward as they are: the image processor's outputs."""


def is_vlm(config) -> bool:
    """Whether a transformers config describes a vision-language model (it has a vision sub-config)."""
    return "vision_config" in (getattr(config, "sub_configs", None) or {})


def model_class(config):
    """transformers' auto class that builds this config's trainable model (with its output layer)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vlm(config) else AutoModelForCausalLM


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose blocks FSDP2 shards one by one: a VLM's text decoder, else the model itself."""
    return model.get_decoder() if is_vlm(model.config) else model


def encoder_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """A VLM's image-encoder parameters (vision tower, connector): all but the language model's and the output
    layer's; [] for a text model."""
    if not is_vlm(model.config):
        return []
    text = {id(p) for p in language_model(model).parameters()}
    text |= {id(p) for p in model.get_output_embeddings().parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in text]


def freeze_encoder(model: torch.nn.Module, train_vision: bool) -> int:
    """Freeze a VLM's image encoder unless `train_vision`; returns how many parameters were frozen."""
    params = [] if train_vision else encoder_parameters(model)
    for _, p in params:
        p.requires_grad_(False)
    return len(params)


def install(model: torch.nn.Module) -> None:
    """On a VLM: its input embedding reads SAMPLED_IMAGE_TOKEN as the image token (a text token there)."""
    if not is_vlm(model.config):
        return
    image = int(getattr(model.config, "image_token_id", getattr(model.config, "image_token_index", -1)))

    def unmark(_module, args):
        ids = args[0]
        return (torch.where(ids == SAMPLED_IMAGE_TOKEN, torch.full_like(ids, image), ids), *args[1:])

    model.get_input_embeddings().register_forward_pre_hook(unmark)


def install_cp(model: torch.nn.Module) -> None:
    """Under cp > 1: the connector's output (the row's picture features, in prompt order) is cut to this rank's
    rows, `model.prl_picture_span` (set by `set_picture_span` before each forward)."""
    connector = getattr(model.model, CP_PICTURE_CONNECTORS[model.config.model_type])
    model.prl_picture_span = None

    def keep_own(_module, _args, features):
        lo, hi = model.prl_picture_span
        return features.reshape(-1, features.shape[-1])[lo:hi][None]

    connector.register_forward_hook(keep_own)


def set_picture_span(model: torch.nn.Module, span: torch.Tensor | None) -> None:
    """The feature rows [k0, k1) this cp rank's forward keeps (`install_cp`; a model without it ignores this)."""
    if hasattr(model, "prl_picture_span"):
        model.prl_picture_span = None if span is None else (int(span[0]), int(span[1]))


def decode(picture: bytes, where: str):
    """One encoded picture as an RGB PIL image (what vLLM decodes an image_url into); BatchError naming it."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(picture)).convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise BatchError(f"{where}: a picture PIL cannot decode: {str(e)[:200]}") from e


class Pictures:
    """A VLM's image processor and image token: pixels for a packed row's pictures."""

    def __init__(self, model_path: str | Path, config, train_vision: bool) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_path)
        self.image_token_id = int(getattr(config, "image_token_id", getattr(config, "image_token_index", -1)))
        self.train_vision = train_vision
        self._blank: MicroBatch | None = None

    @classmethod
    def of(cls, model_path: str | Path, train_vision: bool, cp: int = 1) -> Pictures | None:
        """The model's Pictures, or None for a text model (read from its config.json)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        if not is_vlm(config):
            if train_vision:
                raise ConfigError(f"model.train_vision: {model_path} is not a vision-language model")
            return None
        if cp > 1 and config.model_type not in CP_PICTURE_CONNECTORS:
            raise ConfigError(f"trainer.cp({cp}): {model_path} is a {config.model_type} vision-language model, whose "
                              f"pictures' features prl cannot split over cp ranks; use cp 1")
        return cls(model_path, config, train_vision)

    def inputs(self, pictures: list[bytes], where: str) -> dict[str, torch.Tensor]:
        """The model's pixel inputs for a row's pictures, in order ({} for none)."""
        if not pictures:
            return {}
        images = [decode(p, f"{where}, picture {i}") for i, p in enumerate(pictures)]
        out = self.processor.image_processor(images, return_tensors="pt")
        return {k: v for k, v in out.items() if k not in PIXEL_KEYS_SKIPPED}

    def check(self, mb: MicroBatch, where: str) -> None:
        """A row has image placeholders (its prompts' image tokens, not sampled ones) exactly when it has pictures
        (else transformers fails deep in its forward)."""
        tokens = int(np.count_nonzero((mb.input_ids == self.image_token_id) & (mb.loss_mask == 0)))
        if bool(tokens) != bool(mb.images):
            raise BatchError(f"{where}: {len(mb.images)} pictures for {tokens} image tokens; a rollout's pictures "
                             f"and its prompt's image placeholders must come together")

    def blank(self) -> MicroBatch:
        """One blank picture's expanded placeholder tokens and the picture: a loss-free sample that runs the
        encoder (built once with the model's processor)."""
        if self._blank is None:
            from PIL import Image

            size = 2 * int(getattr(self.processor.image_processor, "patch_size", None) or 14)
            buf = io.BytesIO()
            Image.new("RGB", (size, size), (127, 127, 127)).save(buf, format="PNG")
            token = getattr(self.processor, "image_token", None) or "<image>"
            ids = self.processor(text=token, images=[Image.open(buf).convert("RGB")],
                                 return_tensors="np")["input_ids"][0].astype(np.int32)
            zeros = np.zeros(ids.shape[0], dtype=np.float32)
            self._blank = MicroBatch(sample_ids=[], input_ids=ids, position_ids=np.arange(ids.shape[0]),
                                     loss_mask=zeros.astype(np.uint8), advantages=zeros, inference_logprobs=zeros,
                                     images=[buf.getvalue()])
        return self._blank

    def sampled(self, mb: MicroBatch) -> np.ndarray:
        """[T] bool: the row's image tokens the policy sampled (tokens with loss), which the trainer's input ids
        give SAMPLED_IMAGE_TOKEN (its targets keep the image token)."""
        return (np.asarray(mb.loss_mask) > 0) & (np.asarray(mb.input_ids) == self.image_token_id)

    def picture_span(self, mb: MicroBatch, cp: int, cp_rank: int) -> torch.Tensor:
        """[k0, k1): the feature rows of the row's picture tokens (image tokens not sampled) in cp rank `cp_rank`'s
        slice (the row padded to a multiple of cp, as `micro_batch_inputs` pads it, then cut in cp consecutive
        chunks)."""
        image = (np.asarray(mb.input_ids) == self.image_token_id) & ~self.sampled(mb)
        chunk = -(-mb.num_tokens // cp)
        return torch.tensor([int(image[:cp_rank * chunk].sum()), int(image[:(cp_rank + 1) * chunk].sum())])

    def with_encoder_pass(self, mb: MicroBatch | None, labels: tuple[str, ...]) -> MicroBatch | None:
        """`mb` with a blank picture's sample appended when the encoder trains and `mb` has no picture (so this
        rank's encoder gets a gradient, of zero, like every rank's; its tokens are left uncounted by the caller)."""
        if not self.train_vision or (mb is not None and mb.images):
            return mb
        blank = self.blank()
        if mb is None:
            return blank  # a padding pass: nothing of it is counted anyway (`real` is off)
        nothing = np.zeros(blank.num_tokens, dtype=np.float32)  # the blank's scores: it has no loss
        cat = {k: np.concatenate([getattr(mb, k), getattr(blank, k) if k in BLANK_FIELDS else nothing])
               for k in ("input_ids", "position_ids", *labels)}
        return MicroBatch(sample_ids=mb.sample_ids, **cat, images=list(blank.images))
