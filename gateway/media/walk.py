"""The body walk: one pass over a parsed request body that checks every media reference in place.

Where it looks (by route kind):

- chat: ``messages[i].content[j]`` parts of type image_url, image, video_url, video, audio_url,
  audio, time_series_url, time_series whose value is ``{"url": U, ...}``, ``{"data": U, ...}`` or
  a bare string U; and a top-level ``image_data`` (string, object or list; every route).
- messages / count_tokens (Anthropic): image and document blocks with a ``url`` or ``base64``
  source (documents also ``text`` and ``content`` sources), in ``messages``, in ``system`` and
  inside ``tool_result`` content.
- responses: ``input_image`` (image_url, file_id) and ``input_file`` (file_data, file_url,
  file_id) parts in message items and in ``function_call_output`` output.

The three families share one traversal (``content`` and ``part``); they differ only in their
grammar (``parts.py``: which types exist and which keys each may carry) and in how a media part
names its reference. Text-like parts are checked for unknown keys too. The walk rewrites what it
checked into its canonical form, so the backend reads exactly what passed; with the inline fetch
on it also records where each URL sits, so the filter can put the fetched bytes there.
"""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass
from typing import Any, Protocol

from .parts import (
    ANTHROPIC_BLOCK_KEYS,
    ANTHROPIC_INNER_TEXT_PARTS,
    ANTHROPIC_MEDIA_TYPES,
    ANTHROPIC_TEXT_PARTS,
    BASE64_SOURCE_KEYS,
    CHAT_MEDIA_TYPES,
    CHAT_TEXT_PARTS,
    CONTENT_SOURCE_KEYS,
    INPUT_FILE_KEYS,
    INPUT_IMAGE_KEYS,
    KIND_NAMES,
    MEDIA_KINDS,
    RESPONSES_MEDIA_TYPES,
    RESPONSES_TEXT_PARTS,
    URL_SOURCE_KEYS,
    TextPart,
)
from .reasons import MediaRefused
from .signatures import FRAME_SEQUENCE_MIMES, SIGNATURES
from .url import DomainSet, MediaUrl, parse_media_url

__all__ = ["Grammar", "Policy", "Rules", "Slot", "Walk", "text_only"]


class Policy(Protocol):
    """What the walk reads of the ``media:`` section (``config.media.MediaConfig`` is one)."""

    @property
    def part_types(self) -> tuple[str, ...]: ...
    @property
    def unknown_part_keys(self) -> str: ...  # "refuse" or "drop"
    @property
    def max_items(self) -> int: ...
    @property
    def max_item_bytes(self) -> int: ...
    @property
    def max_request_bytes(self) -> int: ...
    @property
    def max_url_length(self) -> int: ...
    @property
    def check_magic(self) -> bool: ...
    @property
    def fetch(self) -> str: ...  # "backend" or "inline"

    def mimes(self, kind: str) -> tuple[str, ...]: ...

    def params(self, kind: str) -> tuple[str, ...]: ...


@dataclass(frozen=True, slots=True)
class Grammar:
    """One family's content parts, already narrowed to the configured ``part_types``."""

    name: str  # "chat", "anthropic", "anthropic_inner", "responses"
    text: dict[str, TextPart]
    media: dict[str, str]  # part type -> media kind
    supported: tuple[str, ...]  # for the "supported types" list in a refusal
    inner: "Grammar | None" = None  # what a text part's nested content list may hold


class Rules:
    """The walk's parsed, per-gateway form of the media policy; built once at start-up."""

    def __init__(self, cfg: Policy):
        allowed = frozenset(cfg.part_types)
        self.allowed = allowed
        self.max_items = cfg.max_items
        self.max_item_bytes = cfg.max_item_bytes
        self.max_request_bytes = cfg.max_request_bytes
        self.max_url_length = cfg.max_url_length
        self.check_magic = cfg.check_magic
        self.drop_unknown = cfg.unknown_part_keys == "drop"
        self.mimes = {kind: cfg.mimes(kind) for kind in MEDIA_KINDS}
        self.params = {kind: frozenset(cfg.params(kind)) for kind in MEDIA_KINDS}
        if cfg.check_magic or cfg.fetch == "inline":  # both read the signatures: to verify base64, to sniff fetched bytes
            for kind in MEDIA_KINDS:
                for mime in self.mimes[kind]:
                    if (kind, mime) not in SIGNATURES:
                        raise ValueError(f"media.mime_types.{kind}: no magic-byte signature is known for {mime!r}")

        def grammar(name: str, text: dict[str, TextPart], media: dict[str, str], inner: Grammar | None = None) -> Grammar:
            t = {k: v for k, v in text.items() if k in allowed}
            m = {k: v for k, v in media.items() if k in allowed}
            return Grammar(name, t, m, (*t, *m), inner)

        inner = grammar("anthropic_inner", ANTHROPIC_INNER_TEXT_PARTS, ANTHROPIC_MEDIA_TYPES)
        self.chat = grammar("chat", CHAT_TEXT_PARTS, CHAT_MEDIA_TYPES)
        self.anthropic = grammar("anthropic", ANTHROPIC_TEXT_PARTS, ANTHROPIC_MEDIA_TYPES, inner)
        self.anthropic_inner = inner
        self.responses = grammar("responses", RESPONSES_TEXT_PARTS, RESPONSES_MEDIA_TYPES)


@dataclass(slots=True)
class Slot:
    """Where one checked URL sits, so fetched bytes can replace it (``fetch: inline``)."""

    url: MediaUrl
    kind: str
    where: str
    container: Any  # the dict or list holding the reference
    key: Any
    form: str  # "url": container[key] = data URL; "anthropic": a url source becomes a base64 source; "input_file": file_url -> file_data

    def fill(self, mime: str, payload: str) -> None:
        if self.form == "anthropic":
            self.container.clear()
            self.container.update({"type": "base64", "media_type": mime, "data": payload})
        elif self.form == "input_file":
            del self.container[self.key]
            self.container["file_data"] = f"data:{mime};base64,{payload}"
        else:
            self.container[self.key] = f"data:{mime};base64,{payload}"


_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_MIME_TOKEN = r"[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,63}"
# "data:" and ";base64," exactly; the MIME type in any case (RFC 2045), lower-cased on the way out.
_DATA_HEADER = re.compile(rf"(?i:data):((?i:{_MIME_TOKEN}));base64,")
_MIME = re.compile(rf"{_MIME_TOKEN}\Z")
_BAD_B64 = "the payload is not strict base64 (A-Z, a-z, 0-9, + and /, padded with = to a multiple of 4 characters, no whitespace)"
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,40}\Z")


def shown(name: Any) -> str:
    """A client-chosen name fit to quote in a refusal, or "this"."""
    return repr(name) if isinstance(name, str) and _SAFE_NAME.match(name) else "this"


def _at(where: str, key: Any) -> str:
    return f"{where}.{key}" if isinstance(key, str) and _SAFE_NAME.match(key) else where


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


class Walk:
    """One request's pass over its body: counts, running size, the domain set in force."""

    __slots__ = ("r", "domains", "items", "total", "hosts", "slots")

    def __init__(self, rules: Rules, domains: DomainSet, *, hosts: list[tuple[str, int, str]] | None = None, slots: list[Slot] | None = None):
        self.r = rules
        self.domains = domains
        self.items = 0
        self.total = 0  # decoded bytes of base64 media so far
        self.hosts = hosts  # (host, port, where) of every URL, for the DNS check
        self.slots = slots  # every URL's place, for the inline fetch

    def body(self, kind: str, body: dict[str, Any]) -> None:
        if kind == "chat":
            self.messages(body.get("messages"), self.r.chat, strings_ok=True)
        elif kind in ("messages", "count_tokens"):
            system = body.get("system")
            if system is not None and not isinstance(system, str):
                self.content(system, "system", self.r.anthropic)
            self.messages(body.get("messages"), self.r.anthropic, strings_ok=False)
        elif kind == "responses":
            self.responses_input(body)
        if "image_data" in body:
            self.image_data(body)

    # -- the one traversal --------------------------------------------------------------------------
    def messages(self, messages: Any, grammar: Grammar, *, strings_ok: bool) -> None:
        """A list of message objects, each with content; chat also takes a prompt string."""
        if messages is None or (strings_ok and isinstance(messages, str)):
            return
        if not isinstance(messages, list):
            raise MediaRefused("malformed_content", "messages must be a list of message objects", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise MediaRefused("malformed_content", "each message must be an object", f"messages[{i}]")
            self.content(m.get("content"), f"messages[{i}].content", grammar)

    def content(self, content: Any, where: str, grammar: Grammar) -> None:
        """None or a string passes; a list is walked part by part; anything else is refused."""
        if content is None or isinstance(content, str):
            return
        if not isinstance(content, list):
            raise MediaRefused("malformed_content", "content must be a string or a list of content parts", where)
        for j, item in enumerate(content):
            self.part(item, f"{where}[{j}]", grammar)

    def part(self, part: Any, where: str, grammar: Grammar) -> None:
        if not isinstance(part, dict):
            raise MediaRefused("malformed_content", "each content part must be an object with a type", where)
        t = part.get("type")
        if not isinstance(t, str):
            raise MediaRefused("malformed_content", "each content part must have a string type", where)
        spec = grammar.text.get(t)
        if spec is not None:
            self.text_part(part, t, spec, where, grammar)
            return
        kind = grammar.media.get(t)
        if kind is None:
            raise MediaRefused(
                "unknown_part_type",
                f"the content part type {shown(t)} is not supported here; supported types: {', '.join(grammar.supported)}",
                where,
            )
        if grammar.name == "chat":
            self.chat_media(part, t, kind, where)
        elif grammar.name == "responses":
            self.responses_media(part, t, kind, where)
        else:
            self.anthropic_media(part, kind, where)

    def text_part(self, part: dict[str, Any], t: str, spec: TextPart, where: str, grammar: Grammar) -> None:
        self.only_keys(part, spec.keys, f"{t} parts", where, "unexpected_part_field")
        for k in spec.strings:
            if k in part and not isinstance(part[k], str):
                raise MediaRefused("malformed_content", f"the field {k!r} of a {t} part must be a string", f"{where}.{k}")
        if spec.nested is not None and grammar.inner is not None:
            self.content(part.get(spec.nested), f"{where}.{spec.nested}", grammar.inner)

    def only_keys(self, obj: dict[str, Any], allowed: frozenset[str], what: str, where: str, reason: str = "unexpected_media_field") -> None:
        """Every key of ``obj`` is one of ``allowed``; an unknown one is refused, or dropped when so configured."""
        unknown = [k for k in obj if k not in allowed]
        if not unknown:
            return
        if self.r.drop_unknown:
            for k in unknown:
                del obj[k]
            return
        raise MediaRefused(reason, f"the field {shown(unknown[0])} is not allowed in {what}; allowed fields: {', '.join(sorted(allowed))}", _at(where, unknown[0]))

    def params(self, obj: dict[str, Any], kind: str, where: str, skip: tuple[str, ...]) -> None:
        """The processor knobs beside a media reference: only the allowed names, scalar values only."""
        allowed = self.r.params[kind]
        unknown = [k for k in obj if k not in skip and k not in allowed]
        if unknown and not self.r.drop_unknown:
            k = unknown[0]
            why = f"the field {shown(k)} is not allowed in {kind} items; allowed fields: {', '.join((*skip, *allowed))}"
            raise MediaRefused("unexpected_media_field", why, _at(where, k))
        for k in unknown:
            del obj[k]
        for k, v in obj.items():
            if k not in skip and not _is_scalar(v):
                raise MediaRefused("malformed_media", f"the field {k!r} must be a string, number or boolean", _at(where, k))

    # -- leaves ---------------------------------------------------------------------------------------
    def count_item(self, where: str) -> None:
        self.items += 1
        if self.items > self.r.max_items:
            raise MediaRefused("too_many_media_items", f"the request carries more than {self.r.max_items} media items", where)

    def url(self, value: str, kind: str, where: str, container: Any, key: Any, form: str = "url") -> None:
        """Check one media reference (data: or http(s)) held at container[key]; canonicalise it in place."""
        self.count_item(where)
        if value[:5].lower() == "data:":
            canon = self.data_url(value, kind, where)
        else:
            try:
                u = parse_media_url(value, self.r.max_url_length)
            except MediaRefused as exc:
                exc.param = where
                raise
            refused = self.domains.decide(u)
            if refused is not None:
                refused.param = where
                raise refused
            if self.hosts is not None:
                self.hosts.append((u.host, u.effective_port, where))
            if self.slots is not None:
                self.slots.append(Slot(u, kind, where, container, key, form))
            canon = u.canonical
        if canon is not value:
            container[key] = canon

    def data_url(self, value: str, kind: str, where: str) -> str:
        m = _DATA_HEADER.match(value)
        if m is None:
            raise MediaRefused("data_url_malformed", "the data URL must have the form data:<type>;base64,<payload>", where)
        mime = m.group(1).lower()
        self.check_mime(mime, kind, where)
        self.payload(value, m.end(), mime, kind, where)
        head = f"data:{mime};base64,"
        return value if value.startswith(head) else head + value[m.end() :]

    def check_mime(self, mime: str, kind: str, where: str) -> None:
        if mime not in self.r.mimes[kind]:
            allowed = ", ".join(self.r.mimes[kind]) or "none"
            what = repr(mime) if _MIME.match(mime) else "of this item"
            raise MediaRefused("data_mime_not_allowed", f"the MIME type {what} is not allowed for {KIND_NAMES[kind]}; allowed: {allowed}", where)

    def payload(self, text: str, start: int, mime: str, kind: str, where: str) -> None:
        """Validate base64 text[start:] as one item of an allowed ``mime``: strict, within limits, magic."""
        if (kind, mime) in FRAME_SEQUENCE_MIMES:
            frames = text[start:].split(",")
            size = sum(self._b64(f, 0, mime, kind, where) for f in frames)
        else:
            size = self._b64(text, start, mime, kind, where)
        self.within_item_limit(size, where)

    def within_item_limit(self, size: int, where: str) -> None:
        limit = self.r.max_item_bytes
        if size > limit:
            raise MediaRefused("media_item_too_large", f"the item decodes to {size} bytes, over the limit of {limit} bytes per item", where)

    def add_to_total(self, size: int, where: str) -> None:
        self.total += size
        if self.total > self.r.max_request_bytes:
            why = f"media in this request decodes to more than {self.r.max_request_bytes} bytes in total"
            raise MediaRefused("media_request_too_large", why, where)

    def _b64(self, text: str, start: int, mime: str, kind: str, where: str) -> int:
        n = len(text) - start
        if n == 0:
            raise MediaRefused("data_empty", "the base64 payload is empty", where)
        if n % 4 or not text.isascii():
            raise MediaRefused("data_bad_base64", _BAD_B64, where)
        pad = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
        size = n // 4 * 3 - pad
        self.within_item_limit(size, where)
        self.add_to_total(size, where)
        # Strictness without decoding: deleting the alphabet must leave only the header and the padding.
        left = text.encode("ascii").translate(None, _B64_ALPHABET)
        if left != text[:start].encode("ascii").translate(None, _B64_ALPHABET) + b"=" * pad:
            raise MediaRefused("data_bad_base64", _BAD_B64, where)
        if self.r.check_magic:
            head = binascii.a2b_base64(text[start : start + min(n, 24)])
            if not SIGNATURES[(kind, mime)](head):
                raise MediaRefused("data_magic_mismatch", f"the decoded bytes do not start like {mime} data", where)
        return size

    # -- media parts, by family --------------------------------------------------------------------------
    def media_value(self, value: Any, kind: str, where: str, container: Any, key: Any) -> None:
        """A chat-style media value: a URL string, or {"url"|"data": URL, <allowed params>}."""
        if isinstance(value, str):
            self.url(value, kind, where, container, key)
            return
        if not isinstance(value, dict):
            raise MediaRefused("malformed_media", "a media item must be a URL string or an object with a url", where)
        if "url" in value and "data" in value:
            raise MediaRefused("malformed_media", "a media item must give exactly one of url and data, not both", where)
        field = "url" if "url" in value else "data" if "data" in value else None
        if field is None:
            raise MediaRefused("malformed_media", "a media item object must have a url", where)
        self.params(value, kind, where, skip=(field,))
        target = value[field]
        if not isinstance(target, str):
            raise MediaRefused("malformed_media", f"{field} must be a string", f"{where}.{field}")
        self.url(target, kind, f"{where}.{field}", value, field)

    def chat_media(self, part: dict[str, Any], t: str, kind: str, where: str) -> None:
        if t not in part:
            raise MediaRefused("malformed_media", f"a {t} part must carry its value under {t!r}", where)
        value = part[t]
        if isinstance(value, str):
            # lmdeploy passes a bare-string part's other fields to the processor as parameters
            self.params(part, kind, where, skip=("type", t))
        else:
            self.only_keys(part, frozenset(("type", t)), f"{t} parts", where)
        self.media_value(value, kind, f"{where}.{t}", part, t)

    def anthropic_media(self, block: dict[str, Any], kind: str, where: str) -> None:
        self.only_keys(block, ANTHROPIC_BLOCK_KEYS[kind], f"{block['type']} blocks", where)
        source = block.get("source")
        at = f"{where}.source"
        if not isinstance(source, dict):
            raise MediaRefused("malformed_media", "source must be an object with a type", at)
        st = source.get("type")
        if st == "url":
            self.only_keys(source, URL_SOURCE_KEYS, "url sources", at)
            url = source.get("url")
            if not isinstance(url, str):
                raise MediaRefused("malformed_media", "url must be a string", f"{at}.url")
            self.url(url, kind, f"{at}.url", source, "url", form="anthropic")
        elif st == "base64":
            self.only_keys(source, BASE64_SOURCE_KEYS, "base64 sources", at)
            mime, data = source.get("media_type"), source.get("data")
            if not isinstance(mime, str) or not isinstance(data, str):
                raise MediaRefused("malformed_media", "a base64 source needs media_type and data strings", at)
            norm = mime.lower()
            self.check_mime(norm, kind, f"{at}.media_type")
            self.count_item(at)
            self.payload(data, 0, norm, kind, f"{at}.data")
            if norm != mime:
                source["media_type"] = norm
        elif kind == "document" and st == "text":
            self.only_keys(source, BASE64_SOURCE_KEYS, "text sources", at)
            if source.get("media_type") != "text/plain" or not isinstance(source.get("data"), str):
                raise MediaRefused("malformed_media", "a text source needs media_type 'text/plain' and a data string", at)
        elif kind == "document" and st == "content":
            self.only_keys(source, CONTENT_SOURCE_KEYS, "content sources", at)
            self.content(source.get("content"), f"{at}.content", self.r.anthropic_inner)
        elif st == "file":
            raise MediaRefused("file_id_not_supported", "file references are not supported; send the media inline or by URL", at)
        else:
            types = "url, base64, text or content" if kind == "document" else "url or base64"
            raise MediaRefused("malformed_media", f"the source type must be {types}", at)

    def responses_media(self, part: dict[str, Any], t: str, kind: str, where: str) -> None:
        if t == "input_image":
            self.only_keys(part, INPUT_IMAGE_KEYS, "input_image parts", where)
            self.responses_ref(part, ("image_url",), kind, where)
            if not _is_scalar(part.get("detail")):
                raise MediaRefused("malformed_media", "detail must be a string", f"{where}.detail")
        else:
            self.only_keys(part, INPUT_FILE_KEYS, "input_file parts", where)
            self.responses_ref(part, ("file_data", "file_url"), kind, where)
            if not isinstance(part.get("filename", ""), str):
                raise MediaRefused("malformed_media", "filename must be a string", f"{where}.filename")

    def responses_ref(self, part: dict[str, Any], fields: tuple[str, ...], kind: str, where: str) -> None:
        if part.get("file_id") is not None:
            why = "file_id references are not supported; send the media inline or by URL"
            raise MediaRefused("file_id_not_supported", why, f"{where}.file_id")
        given = [f for f in fields if part.get(f) is not None]
        if len(given) != 1:
            raise MediaRefused("malformed_media", f"the part must give exactly one of {' or '.join(fields)}", where)
        field = given[0]
        value = part[field]
        if not isinstance(value, str):
            raise MediaRefused("malformed_media", f"{field} must be a URL string", f"{where}.{field}")
        if field == "file_data" and value[:5].lower() != "data:":
            raise MediaRefused("data_url_malformed", "file_data must be a data URL: data:<type>;base64,<payload>", f"{where}.{field}")
        self.url(value, kind, f"{where}.{field}", part, field, form="input_file" if field == "file_url" else "url")

    # -- roots other than messages -------------------------------------------------------------------------
    def responses_input(self, body: dict[str, Any]) -> None:
        inp = body.get("input")
        if inp is None or isinstance(inp, str):
            return
        if not isinstance(inp, list):
            raise MediaRefused("malformed_content", "input must be a string or a list of input items", "input")
        for i, item in enumerate(inp):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise MediaRefused("malformed_content", "each input item must be an object", where)
            t = item.get("type", "message")
            if t == "message":
                self.content(item.get("content"), f"{where}.content", self.r.responses)
            elif t == "function_call_output":
                self.content(item.get("output"), f"{where}.output", self.r.responses)
            elif t != "function_call":
                raise MediaRefused(
                    "unknown_input_item_type",
                    f"the input item type {shown(t)} is not supported here; supported types: message, function_call, function_call_output",
                    where,
                )

    def image_data(self, body: dict[str, Any]) -> None:
        value = body["image_data"]
        if value is None:
            return
        if "image_url" not in self.r.allowed:
            why = "image_data is not supported here because image_url parts are not enabled"
            raise MediaRefused("unknown_part_type", why, "image_data")
        if isinstance(value, list):
            for i, item in enumerate(value):
                if not isinstance(item, (str, dict)):
                    why = "each image_data item must be a URL string or an object with a url"
                    raise MediaRefused("malformed_media", why, f"image_data[{i}]")
                self.media_value(item, "image", f"image_data[{i}]", value, i)
        else:
            self.media_value(value, "image", "image_data", body, "image_data")


def text_only(kind: str, body: dict[str, Any]) -> bool:
    """The fast path: True when no field that can carry media has a non-string value."""
    if "image_data" in body:
        return False
    if kind == "chat" or kind == "messages" or kind == "count_tokens":
        if kind != "chat":
            system = body.get("system")
            if system is not None and type(system) is not str:
                return False
        messages = body.get("messages")
        if type(messages) is not list:
            return messages is None or (kind == "chat" and type(messages) is str)
        for m in messages:
            if type(m) is not dict:
                return False
            c = m.get("content")
            if c is not None and type(c) is not str:
                return False
        return True
    if kind == "responses":
        inp = body.get("input")
        return inp is None or type(inp) is str
    return True
