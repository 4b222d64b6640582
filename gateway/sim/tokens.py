"""Prompts and tokens, approximated cheaply and deterministically.

The token rule: a request is rendered to one prompt string (chat messages through a ChatML-like
template, so two conversations that share a system prompt and first turns share a string
prefix), and every 4 characters of that string count as one token, rounded up, at least 1.
Explicit ``input_ids`` count one token per id. No tokenizer is loaded and nothing is split, so
counting a 100 kB prompt costs one ``len``.

The prefix cache works on blocks of ``block_tokens`` tokens (``4 * block_tokens`` characters, or
``block_tokens`` ids). Each full block gets a key that chains the previous block's key, like a
paged KV cache: a block can only match when everything before it matched too.

Output tokens are filler: token ``i`` is ``"tok{i}"``, joined by single spaces.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

CHARS_PER_TOKEN = 4
VOCAB_SIZE = 151_643  # ids handed out by /v1/encode and /generate stay inside a real-looking vocabulary


class PromptError(ValueError):
    """The request body does not describe a prompt; the message names the bad field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: int
    blocks: tuple[int, ...]  # chained keys of the full blocks, first block first


def count_text_tokens(text: str) -> int:
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def text_prompt(text: str, block_tokens: int) -> Prompt:
    step = block_tokens * CHARS_PER_TOKEN
    keys: list[int] = []
    key = 0
    # Python's str hash is per-process salted, which is fine: keys never leave the process.
    for start in range(0, len(text) - step + 1, step):
        key = hash((key, text[start : start + step]))
        keys.append(key)
    return Prompt(count_text_tokens(text), tuple(keys))


def ids_prompt(ids: Sequence[int], block_tokens: int) -> Prompt:
    keys: list[int] = []
    key = 0
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        key = hash((key, tuple(ids[start : start + block_tokens])))
        keys.append(key)
    return Prompt(max(1, len(ids)), tuple(keys))


def encode(text: str) -> list[int]:
    """Deterministic ids for /v1/encode: one id per 4-character piece, stable across processes."""
    return [zlib.crc32(text[i : i + CHARS_PER_TOKEN].encode()) % VOCAB_SIZE for i in range(0, len(text), CHARS_PER_TOKEN)] or [0]


def token_piece(i: int) -> str:
    return f"tok{i}" if i == 0 else f" tok{i}"


def output_text(start: int, end: int) -> str:
    return "".join(token_piece(i) for i in range(start, end))


def output_ids(start: int, end: int) -> list[int]:
    return [1000 + i % (VOCAB_SIZE - 1000) for i in range(start, end)]


# -- rendering request bodies to prompt strings ---------------------------------------------------

_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


def content_text(content: Any, param: str) -> str:
    """The text of an OpenAI/Anthropic/Responses content value (a string or a list of parts).

    Media parts become a fixed placeholder: the simulator never fetches anything, and the
    request log shows exactly what reached it.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError(f"`{param}` must be a string or a list of content parts.", param)
    out: list[str] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise PromptError(f"`{param}[{i}]` must be an object.", param)
        kind = part.get("type")
        if kind in _TEXT_PART_TYPES:
            text = part.get("text")
            if not isinstance(text, str):
                raise PromptError(f"`{param}[{i}].text` must be a string.", param)
            out.append(text)
        elif kind == "tool_result":
            out.append(content_text(part.get("content"), f"{param}[{i}].content"))
        elif kind == "tool_use":
            out.append(orjson.dumps(part.get("input")).decode())
        else:
            out.append(f"<{kind}>")
    return "".join(out)


def _turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def _tools_turn(tools: Any) -> str:
    return _turn("tools", orjson.dumps(tools).decode()) if tools else ""


def render_chat(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("`messages` must be a non-empty list.", "messages")
    parts = [_tools_turn(body.get("tools"))]
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise PromptError(f"`messages[{i}]` must be an object with a string `role`.", "messages")
        text = content_text(msg.get("content"), f"messages[{i}].content")
        if msg.get("tool_calls"):
            text += orjson.dumps(msg["tool_calls"]).decode()
        parts.append(_turn(msg["role"], text))
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_responses(body: dict[str, Any]) -> str:
    inp = body.get("input")
    if inp is None:
        raise PromptError("input is required by Responses Text V1.", "input")
    parts = [_tools_turn(body.get("tools"))]
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        parts.append(_turn("system", body["instructions"]))
    if isinstance(inp, str):
        parts.append(_turn("user", inp))
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            if not isinstance(item, dict):
                raise PromptError(f"Unsupported Responses input item at index {i}.", "input")
            kind = item.get("type", "message")
            if kind == "message":
                parts.append(_turn(str(item.get("role", "user")), content_text(item.get("content", ""), f"input[{i}].content")))
            elif kind == "function_call":
                parts.append(_turn("assistant", f"{item.get('name')}({item.get('arguments', '')})"))
            elif kind == "function_call_output":
                parts.append(_turn("tool", content_text(item.get("output", ""), f"input[{i}].output")))
            else:
                raise PromptError(f"Unsupported Responses input item type: {kind!r}.", "input")
    else:
        raise PromptError("`input` must be a string or a list of items.", "input")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_anthropic(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must not be empty unless input_ids is set.", "messages")
    parts = [_tools_turn(body.get("tools"))]
    system = body.get("system")
    if system:
        parts.append(_turn("system", content_text(system, "system")))
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise PromptError(f"`messages[{i}].role` must be 'user' or 'assistant'.", "messages")
        parts.append(_turn(msg["role"], content_text(msg.get("content"), f"messages[{i}].content")))
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """``/v1/completions`` ``prompt``: a string, a list of strings, a list of ids, or a list of id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, int) for p in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return list(prompt)
    raise PromptError("`prompt` must be a string, a list of strings, or token ids.", "prompt")


def to_prompt(source: str | list[int], block_tokens: int) -> Prompt:
    return text_prompt(source, block_tokens) if isinstance(source, str) else ids_prompt(source, block_tokens)
