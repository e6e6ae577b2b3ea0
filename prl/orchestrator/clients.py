"""The model clients rollouts talk through (verifiers' client configs), shared by training and evaluation.

    train client   the conversation rendered here (the tokenizer and `model.renderer`), sent token-in/token-out
                   to a prl server's generate route: the token ids and logprobs training needs
    eval client    verifiers' plain OpenAI client (`prl eval` against any endpoint: no token ids)

The orchestrator's rollouts and in-run evals use the train client; `prl eval` uses the eval client, or the train
client with `render_with` (a sweep over a run's weights renders as training did).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prl.errors import ConfigError
from prl.orchestrator.config import OrchestratorConfig
from prl.orchestrator.sync import LiveServer
from prl.run.rundir import GENERATION_KEY_VAR


def renderer_config(renderer: dict[str, Any] | None) -> Any:
    """`model.renderer` as a `renderers.RendererConfig` (None stays None: chosen from the tokenizer);
    ConfigError naming the field when renderers refuses it (an unknown name, a field the renderer lacks,
    an import_path that does not load)."""
    if renderer is None:
        return None
    import pydantic
    from renderers import RendererConfig

    try:
        return pydantic.TypeAdapter(RendererConfig).validate_python(renderer)
    except pydantic.ValidationError as e:
        where = [".".join(map(str, err["loc"])) for err in e.errors()]
        problems = "; ".join(f"{w}: {err['msg']}" if w else err["msg"] for w, err in zip(where, e.errors()))
        raise ConfigError(f"model.renderer {renderer}: {problems}") from None
    except (ImportError, TypeError) as e:  # a custom import_path that does not load, or names no renderer
        raise ConfigError(f"model.renderer {renderer}: {type(e).__name__}: {e}") from None


def train_client(base_url: str, api_key_var: str, tokenizer: str, renderer: Any) -> Any:
    """verifiers' train client for a prl server at `base_url` (`.../v1`): conversations rendered here with
    `tokenizer` and `renderer` (from `renderer_config`), sent token-in/token-out to its generate route."""
    import verifiers.v1 as vf

    return vf.TrainClientConfig(base_url=base_url, api_key_var=api_key_var, renderer_model_name=tokenizer,
                                renderer=renderer)


def train_contexts(cfg: OrchestratorConfig, model: str) -> Callable[[LiveServer], Any]:
    """LiveServer -> the verifiers ModelContext a rollout on it runs with: the train client of that server (the
    run's generation-only key, GENERATION_KEY_VAR), the served `model` name and the run's sampling settings. Checks `model.renderer` at once."""
    import verifiers.v1 as vf

    sampling = vf.SamplingConfig(temperature=cfg.training.temperature, max_tokens=cfg.training.max_tokens)
    renderer = renderer_config(cfg.renderer)

    def make(server: LiveServer) -> Any:
        client = train_client(f"{server.url}/v1", GENERATION_KEY_VAR, cfg.model_path, renderer)
        return vf.ModelContext(model=model, client=client, sampling=sampling)

    return make


def endpoint_client(base_url: str, api_key_var: str, render_with: str | None,
                    renderer: dict[str, Any] | None) -> Any:
    """The client `prl eval` sends to `base_url` (`.../v1`) with: the train client rendering with the tokenizer
    `render_with` and `renderer` when given, else verifiers' plain eval client."""
    if render_with:
        return train_client(base_url, api_key_var, render_with, renderer_config(renderer))
    import verifiers.v1 as vf

    return vf.EvalClientConfig(base_url=base_url, api_key_var=api_key_var)
