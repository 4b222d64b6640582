"""The content-part grammar: which part types exist per request family, and which keys each may carry.

Only known keys of each part type are forwarded. A key that is not listed here (an ``image_url``
object slipped into a ``text`` part, a ``url`` beside an image block) is refused, or dropped when
``media.unknown_part_keys: drop``. Text-like parts carry no media; media parts carry exactly one
reference, checked by the walk.
"""

from __future__ import annotations

from dataclasses import dataclass

MEDIA_KINDS = ("image", "video", "audio", "time_series", "document")
KIND_NAMES = {"image": "images", "video": "videos", "audio": "audio", "time_series": "time series", "document": "documents"}

# Content part types the policy knows how to check, by request family. Text-like types carry no
# media; every other known type is media and goes through the URL / base64 rules.
CHAT_TEXT_TYPES = ("text", "refusal")
CHAT_MEDIA_TYPES = {
    "image_url": "image",
    "image": "image",
    "video_url": "video",
    "video": "video",
    "audio_url": "audio",
    "audio": "audio",
    "time_series_url": "time_series",
    "time_series": "time_series",
}
ANTHROPIC_TEXT_TYPES = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")
ANTHROPIC_MEDIA_TYPES = {"image": "image", "document": "document"}
RESPONSES_TEXT_TYPES = ("input_text", "output_text", "text", "refusal")
RESPONSES_MEDIA_TYPES = {"input_image": "image", "input_file": "document"}

KNOWN_PART_TYPES: tuple[str, ...] = tuple(
    dict.fromkeys(
        (*CHAT_TEXT_TYPES, *CHAT_MEDIA_TYPES, *ANTHROPIC_TEXT_TYPES, *ANTHROPIC_MEDIA_TYPES, *RESPONSES_TEXT_TYPES, *RESPONSES_MEDIA_TYPES)
    )
)

DEFAULT_MIME_TYPES: dict[str, tuple[str, ...]] = {
    "image": ("image/png", "image/jpeg", "image/webp", "image/gif"),
    "video": ("video/mp4", "video/webm"),
    "audio": ("audio/wav", "audio/mpeg", "audio/ogg", "audio/flac"),
    "time_series": ("application/octet-stream",),
    "document": ("application/pdf",),
}

DEFAULT_ITEM_PARAMS: dict[str, tuple[str, ...]] = {
    "image": ("detail",),
    "video": (),
    "audio": (),
    "time_series": ("sampling_rate",),
    "document": (),
}

# Keys that name the media itself or its kind: a processor knob must never shadow them.
RESERVED_PARAMS = frozenset({"url", "data", "type"})


@dataclass(frozen=True, slots=True)
class TextPart:
    """A text-like part: every key it may carry (``type`` included) and those that must be strings."""

    keys: frozenset[str]
    strings: tuple[str, ...] = ()
    nested: str | None = None  # a key holding a content list, walked with the family's inner grammar


def _text(*keys: str, strings: tuple[str, ...] = (), nested: str | None = None) -> TextPart:
    return TextPart(frozenset(("type", *keys)), strings, nested)


# OpenAI chat: https://platform.openai.com/docs/api-reference/chat/create (text and refusal parts)
CHAT_TEXT_PARTS = {
    "text": _text("text", strings=("text",)),
    "refusal": _text("refusal", strings=("refusal",)),
}
# Anthropic Messages content blocks
ANTHROPIC_TEXT_PARTS = {
    "text": _text("text", "cache_control", "citations", strings=("text",)),
    "thinking": _text("thinking", "signature", strings=("thinking", "signature")),
    "redacted_thinking": _text("data", strings=("data",)),
    "tool_use": _text("id", "name", "input", "cache_control", strings=("id", "name")),
    "tool_result": _text("tool_use_id", "content", "is_error", "cache_control", strings=("tool_use_id",), nested="content"),
}
# Inside tool_result content and a document's content source: text and media only.
ANTHROPIC_INNER_TEXT_PARTS = {"text": ANTHROPIC_TEXT_PARTS["text"]}
# OpenAI Responses input/output content
RESPONSES_TEXT_PARTS = {
    "input_text": _text("text", strings=("text",)),
    "output_text": _text("text", "annotations", "logprobs", strings=("text",)),
    "text": _text("text", strings=("text",)),
    "refusal": _text("refusal", strings=("refusal",)),
}

# Keys of media parts whose shape is fixed (chat media parts take the configured item_params instead).
ANTHROPIC_BLOCK_KEYS = {
    "image": frozenset({"type", "source", "cache_control"}),
    "document": frozenset({"type", "source", "cache_control", "title", "context", "citations"}),
}
URL_SOURCE_KEYS = frozenset({"type", "url"})
BASE64_SOURCE_KEYS = frozenset({"type", "media_type", "data"})
CONTENT_SOURCE_KEYS = frozenset({"type", "content"})
INPUT_IMAGE_KEYS = frozenset({"type", "image_url", "file_id", "detail"})
INPUT_FILE_KEYS = frozenset({"type", "file_data", "file_url", "file_id", "filename"})
