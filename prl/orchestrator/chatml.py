"""A ChatML renderer for the `renderers` package: multi-turn rollouts that stay one exact token sequence.

The train client (verifiers' `TrainClient`) renders each model call with a `renderers` Renderer. On a
later turn it first asks `bridge_to_next_turn` to extend the previous prompt + sampled completion with
the new user/tool messages; only when that returns None does it re-render the whole conversation, and
a re-render that differs from the sampled tokens (a reply rarely decodes and re-encodes to the same
ids) starts a new branch of the trace, trained as a separate sequence. Models that `renderers` does not
know (ChatML models such as SmolLM2, and the test tokenizer) get its template-driven DefaultRenderer,
which never bridges. This renderer does, so every turn extends the last one token for token:

    model:
      renderer: {name: custom, import_path: prl.orchestrator.chatml.ChatMLRenderer}
      # SmolLM2's template adds a system prompt when the chat has none:
      # renderer: {name: custom, import_path: ..., default_system: "You are a helpful AI assistant ..."}

The layout is ChatML, as the tokenizer's own chat template writes it:

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n

Tools use the Hermes convention: the tool list is described in the system message, the model answers
with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (parsed from the decoded text, so the
tags may be several tokens), and results come back as `tool` messages wrapped in `<tool_response>`.
The reply ends at `<|im_end|>` (and at the tokenizer's end-of-sequence token when that differs).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from renderers import (
    BaseRendererConfig,
    Message,
    ParsedResponse,
    ParsedToolCall,
    RenderedTokens,
    ToolCallParseStatus,
    ToolSpec,
    attribute_text_segments,
    extract_message_tool_names,
    reject_assistant_in_extension,
    trim_to_turn_close,
)

IMPORT_PATH = "prl.orchestrator.chatml.ChatMLRenderer"
"""What `model.renderer.import_path` names to use this renderer."""

_TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You can call these functions. Their signatures, one JSON object a line, are inside <tools></tools>:\n"
    "<tools>"
)
_TOOLS_CLOSING = (
    "\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_RESPONSE_OPEN, _RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


class ChatMLRendererConfig(BaseRendererConfig):
    """Settings of `ChatMLRenderer` (the fields next to `import_path` in `model.renderer`)."""

    name: Literal["chatml"] = "chatml"
    default_system: str | None = None
    """System prompt rendered when the chat has none (what the model's template adds, e.g. SmolLM2's)."""

    _internal_fields = frozenset({"default_system"})


class _Tokens:
    """Token ids with their per-token attribution, as `RenderedTokens` wants them."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.indices: list[int] = []
        self.sampled: list[bool] = []
        self.content: list[bool] = []
        self.has_content = True

    def special(self, token_id: int, index: int, *, sampled: bool = False) -> None:
        self._add([(token_id, sampled)], index, sampled)

    def text(self, segments: list[tuple[str, bool]], index: int, *, sampled: bool = False) -> None:
        """Encode the segments in one pass (BPE merges across them as in the template's one string);
        a token is content when its first character comes from a content segment."""
        attributed = attribute_text_segments(self.tokenizer, segments)
        self.has_content &= attributed.has_content_attribution
        self._add(attributed, index, sampled)

    def _add(self, pairs: Iterable[tuple[int, bool]], index: int, sampled: bool) -> None:
        for token_id, is_content in pairs:
            self.ids.append(token_id)
            self.indices.append(index)
            self.sampled.append(sampled)
            self.content.append(is_content)

    def result(self, messages: list[Message], prior: Sequence[int] = ()) -> RenderedTokens:
        """`prior`: tokens before these (a bridge's previous turns), attributed to no message."""
        n = len(prior)
        return RenderedTokens(
            token_ids=[*prior, *self.ids],
            message_indices=[-1] * n + self.indices,
            sampled_mask=[False] * n + self.sampled,
            # Without character offsets the body/scaffold split is unknown: say so with [] (renderers' rule).
            is_content=[False] * n + self.content if self.has_content else [],
            message_roles=[m.get("role") or "" for m in messages],
            message_tool_names=extract_message_tool_names(messages),
        )


def _text(content: Any) -> str:
    """A message body as text: a string, or the text parts of an OpenAI-style content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else p.get("text") or "" for p in content if isinstance(p, (str, dict)))
    return ""


def _tool_call_text(call: dict[str, Any]) -> str:
    function = call.get("function") or call
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    name = json.dumps(function.get("name", ""), ensure_ascii=False)
    return '<tool_call>\n{"name": ' + name + ', "arguments": ' + arguments + "}\n</tool_call>"


def _system_segments(system: str | None, tools: list[ToolSpec] | None) -> list[tuple[str, bool]]:
    """The system message's body: its own text (content), then the tool list (scaffold)."""
    segments: list[tuple[str, bool]] = [(system, True)] if system else []
    if tools:
        if system:
            segments.append(("\n\n", False))
        segments.append((_TOOLS_PREAMBLE, False))
        segments += [("\n" + json.dumps(tool, ensure_ascii=False), False) for tool in tools]
        segments.append((_TOOLS_CLOSING, False))
    return segments


def system_with_tools(system: str | None, tools: list[ToolSpec] | None) -> str:
    """The system message's text as this renderer writes it for `tools`: what an SFT demonstration's system
    turn holds so that SFT trains on the prompt a tool-using RL rollout shows the model."""
    return "".join(text for text, _ in _system_segments(system, tools))


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A Hermes tool call as this renderer writes (and parses) it."""
    return _tool_call_text({"name": name, "arguments": arguments})


def tool_response_text(result: str) -> str:
    """A tool result's body inside its `tool` turn, as this renderer writes it."""
    return _RESPONSE_OPEN + result + _RESPONSE_CLOSE


class ChatMLRenderer:
    """Messages <-> token ids for ChatML chat templates, with exact turn-to-turn bridging."""

    config_class = ChatMLRendererConfig
    is_prefix_stable = True
    """Rendering more messages never changes the tokens of the earlier ones: each message is rendered alone."""

    def __init__(self, tokenizer: Any, config: ChatMLRendererConfig | None = None):
        self._tokenizer = tokenizer
        self.config = config or ChatMLRendererConfig()
        self._im_start = self._special("<|im_start|>")
        self._im_end = self._special("<|im_end|>")
        eos = getattr(tokenizer, "eos_token_id", None)
        self._stop = [self._im_end] + ([eos] if isinstance(eos, int) and eos != self._im_end else [])

    def _special(self, token: str) -> int:
        token_id = self._tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == self._tokenizer.unk_token_id:
            name = getattr(self._tokenizer, "name_or_path", "?")
            raise ValueError(f"tokenizer {name!r} has no {token} token: it is not a ChatML model; "
                             f"set model.renderer to its family's renderer")
        return token_id

    def get_stop_token_ids(self) -> list[int]:
        return list(self._stop)

    # -- rendering
    def render(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, add_generation_prompt: bool = False
    ) -> RenderedTokens:
        if not messages:
            raise ValueError("No messages provided.")
        out = _Tokens(self._tokenizer)
        first_is_system = messages[0].get("role") == "system"
        system = _text(messages[0].get("content")) if first_is_system else self.config.default_system
        if system is not None or tools:
            self._system(out, system, tools, 0 if first_is_system else -1)
        for i, message in enumerate(messages):
            if i == 0 and first_is_system:
                continue
            if message.get("role") == "assistant":
                self._assistant(out, message, i)
            else:
                self._message(out, message, i)
        if add_generation_prompt:
            self._generation_prompt(out)
        return out.result(messages)

    def render_ids(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, add_generation_prompt: bool = False
    ) -> list[int]:
        return self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt).token_ids

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[ToolSpec] | None = None,
    ) -> RenderedTokens | None:
        """The previous prompt and sampled completion, verbatim, then the new user/tool/system messages and
        the generation prompt. A completion cut by the token limit gets the `<|im_end|>` it did not sample.
        None (re-render) when the new messages hold an assistant turn, which would re-encode sampled text."""
        if not previous_prompt_ids or not new_messages or reject_assistant_in_extension(new_messages):
            return None
        if any(m.get("role") not in ("user", "system", "tool") for m in new_messages):
            return None
        prior = trim_to_turn_close(previous_prompt_ids, previous_completion_ids, set(self._stop),
                                   synthesize_close=self._im_end)
        if prior is None:
            return None
        out = _Tokens(self._tokenizer)
        out.text([("\n", False)], -1)  # the template's newline after <|im_end|>; the engine stopped before it
        for i, message in enumerate(new_messages):
            self._message(out, message, i)
        self._generation_prompt(out)
        return out.result(new_messages, prior)

    def _system(self, out: _Tokens, system: str | None, tools: list[ToolSpec] | None, index: int) -> None:
        self._block(out, [("system\n", False), *_system_segments(system, tools)], index)

    def _message(self, out: _Tokens, message: Message, index: int) -> None:
        role = message.get("role") or ""
        if role not in ("user", "system", "tool"):
            raise ValueError(f"ChatML renders user, system, tool and assistant messages, not {role!r}")
        body = _text(message.get("content"))
        if role == "tool":
            segments = [("tool\n" + _RESPONSE_OPEN, False), (body, True), (_RESPONSE_CLOSE, False)]
        else:
            segments = [(role + "\n", False), (body, True)]
        self._block(out, segments, index)

    def _block(self, out: _Tokens, segments: list[tuple[str, bool]], index: int) -> None:
        out.special(self._im_start, index)
        out.text(segments, index)
        out.special(self._im_end, index)
        out.text([("\n", False)], index)

    def _assistant(self, out: _Tokens, message: Message, index: int) -> None:
        # The role line is the generation prompt (never sampled), encoded apart from the reply as it was
        # at sampling time; the reply and its <|im_end|> are what the model samples; the "\n" after is not.
        out.special(self._im_start, index)
        out.text([("assistant\n", False)], index)
        reply = _text(message.get("content"))
        calls = [_tool_call_text(c) for c in message.get("tool_calls") or []]
        body = "\n".join([reply, *calls] if reply else calls)
        if body:
            out.text([(body, True)], index, sampled=True)
        out.special(self._im_end, index, sampled=True)
        out.text([("\n", False)], index)

    def _generation_prompt(self, out: _Tokens) -> None:
        out.special(self._im_start, -1)
        out.text([("assistant\n", False)], -1)

    # -- parsing
    def parse_response(
        self, token_ids: list[int], *, tools: list[ToolSpec] | None = None, prompt_ids: list[int] | None = None
    ) -> ParsedResponse:
        """The reply up to its stop token, decoded; Hermes `<tool_call>` blocks found in the text (the tags
        need not be single tokens) become tool calls, the text before the first one the content."""
        ids = list(token_ids)
        for i, t in enumerate(ids):
            if t in self._stop:
                ids = ids[:i]
                break
        text = self._tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
        calls = [self._tool_call(m.group(1), closed=bool(m.group(2))) for m in _TOOL_CALL.finditer(text)]
        content = text.split("<tool_call>", 1)[0] if calls else text
        return ParsedResponse(content=content.strip(), reasoning_content=None, tool_calls=calls)

    @staticmethod
    def _tool_call(raw: str, *, closed: bool) -> ParsedToolCall:
        raw = raw.strip()
        if not closed:
            return ParsedToolCall(raw=raw, status=ToolCallParseStatus.UNCLOSED_BLOCK)
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return ParsedToolCall(raw=raw, status=ToolCallParseStatus.INVALID_JSON)
        if not isinstance(parsed, dict):
            return ParsedToolCall(raw=raw, status=ToolCallParseStatus.MALFORMED_STRUCTURE)
        name, arguments = parsed.get("name"), parsed.get("arguments", {})
        if not isinstance(name, str) or not name:
            return ParsedToolCall(raw=raw, arguments=arguments, status=ToolCallParseStatus.MISSING_NAME)
        return ParsedToolCall(raw=raw, name=name, arguments=arguments, status=ToolCallParseStatus.OK)
