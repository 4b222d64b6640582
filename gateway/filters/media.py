"""The media policy: every media item is base64 of an allowed type, or a URL on an allowed domain.

lmdeploy's api_server fetches whatever a media field names, ``file://`` and bare local paths
included (see the fact sheet, section 3). This filter runs on the parsed body, after auth and
before routing, and a request it refuses never leaves the gateway.

Where it looks (``ctx.route.kind``):

- chat: ``messages[i].content[j]`` parts of type image_url, image, video_url, video, audio_url,
  audio, time_series_url, time_series whose value is ``{"url": U, ...}``, ``{"data": U, ...}`` or
  a bare string U; and a top-level ``image_data`` (string, object or list; every route).
- messages / count_tokens (Anthropic): image and document blocks with a ``url`` or ``base64``
  source (documents also ``text`` and ``content`` sources), in ``messages``, in ``system`` and
  inside ``tool_result`` content.
- responses: ``input_image`` (image_url, file_id) and ``input_file`` (file_data, file_url,
  file_id) parts in message items and in ``function_call_output`` output. Today's api_server
  rejects them; they are checked anyway so a backend upgrade cannot open a hole.

Text parts pass untouched. A part whose type the policy does not know, or that the
``media.part_types`` allow-list leaves out, is refused with the list of supported types.

The rules, all explicit allows:

- ``data:<mime>;base64,<payload>`` with the MIME type on the kind's list, strict base64 (checked
  without decoding the whole payload), decoded size capped per item and per request, and the
  magic bytes checked when ``check_magic`` is on.
- ``https://host[:port]/path?query`` (http only where the domain entry allows it), parsed once by
  ``parse_media_url``, a hand-written parser for a strict subset of RFC 3986: an ASCII DNS name
  as host, no userinfo, fragment, IP literal, backslash, whitespace, control or non-ASCII
  character, no dot segments, and every character that RFC 3986 requires to be percent-encoded
  refused. Only the case of the scheme and the host is normalised; the canonical form replaces
  the client's string in the body, which the listener re-serialises, so the backend reads exactly
  the URL that was checked.
- Optional (``resolve_dns``): every allowed host is resolved and refused if any address is not
  global. That check needs ``await check_body_async(ctx)``; ``is_async`` says when.

Every refusal is a 400 whose ``reason`` (also the ``gateway_media_refusals_total`` label) is one
of ``REASONS``, whose ``param`` names the exact place, and whose message says why without
repeating the URL (only a host or a scheme that already passed the grammar is quoted).
"""

from __future__ import annotations

import asyncio
import binascii
import ipaddress
import re
import socket
from typing import Any, Awaitable, Callable, NamedTuple

from ..config.media import (
    ANTHROPIC_MEDIA_TYPES,
    ANTHROPIC_TEXT_TYPES,
    CHAT_MEDIA_TYPES,
    CHAT_TEXT_TYPES,
    FRAME_SEQUENCE_MIMES,
    RESPONSES_MEDIA_TYPES,
    RESPONSES_TEXT_TYPES,
    SIGNATURES,
    DomainEntry,
    MediaConfig,
    check_host,
    parse_domain_entry,
)
from ..errors import Refusal
from ..metrics import MEDIA_REFUSALS
from . import RequestContext

__all__ = ["MediaPolicy", "MediaRefused", "MediaUrl", "DomainSet", "parse_media_url", "REASONS"]

REASONS = (
    # request shape
    "malformed_content",
    "unknown_part_type",
    "unknown_input_item_type",
    "malformed_media",
    "unexpected_media_field",
    "file_id_not_supported",
    "too_many_media_items",
    # URLs
    "url_empty",
    "url_too_long",
    "url_bad_character",
    "url_backslash",
    "url_not_absolute",
    "url_scheme_not_allowed",
    "url_malformed",
    "url_fragment",
    "url_userinfo",
    "url_ip_literal",
    "url_bad_host",
    "url_host_trailing_dot",
    "url_bad_port",
    "url_bad_path",
    "url_dot_segment",
    "url_bad_query",
    "http_not_allowed",
    "url_port_not_allowed",
    "domain_not_allowed",
    # data: URLs and base64
    "data_url_malformed",
    "data_mime_not_allowed",
    "data_empty",
    "data_bad_base64",
    "data_magic_mismatch",
    "media_item_too_large",
    "media_request_too_large",
    # optional DNS check
    "dns_failed",
    "dns_non_global",
)


class MediaRefused(Exception):
    """One denial: a reason (metric label), the why in plain words, and where (filled in by the walk)."""

    def __init__(self, reason: str, why: str, param: str | None = None):
        super().__init__(why)
        self.reason = reason
        self.why = why
        self.param = param


class MediaUrl(NamedTuple):
    scheme: str  # "https" or "http"
    host: str  # lower-case DNS name
    port: int | None  # as written; None when absent
    canonical: str


# -- the URL parser ----------------------------------------------------------------------------------

_PRINTABLE = re.compile(r"[\x21-\x7e]*\Z")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*\Z")
_PORT = re.compile(r"[1-9][0-9]{0,4}\Z")
# RFC 3986 path-abempty and query, with no character left that would need percent-encoding:
# one character class each (linear, no backtracking), then every "%" must start an %XX escape.
_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*\Z")
_QUERY = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/?%]*\Z")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_DOT_SEGMENTS = frozenset({".", "..", "%2e", ".%2e", "%2e.", "%2e%2e"})
_AUTHORITY_END = re.compile(r"[/?]")


def parse_media_url(text: str, max_length: int = 4096) -> MediaUrl:
    """Parse an http(s) media URL strictly; MediaRefused says why it is not acceptable.

    Accepted: ``scheme "://" host [":" port] path-abempty ["?" query]`` with scheme http or https
    (any case), host an ASCII DNS name (any case), port 1-65535 without leading zeros, path and
    query made of RFC 3986 unreserved, sub-delims, ":", "@", "/" ("?" in the query) and
    well-formed %XX escapes. The allow-list decides afterwards whether scheme, host and port pass.
    """
    if not text:
        raise MediaRefused("url_empty", "the URL is empty")
    if len(text) > max_length:
        raise MediaRefused("url_too_long", f"the URL is longer than {max_length} characters")
    if not _PRINTABLE.match(text):
        if not text.isascii():
            raise MediaRefused(
                "url_bad_character",
                "the URL contains a character outside printable ASCII; write an internationalised host name "
                "in punycode (xn--...) and percent-encode the rest",
            )
        raise MediaRefused("url_bad_character", "the URL contains whitespace or a control character")
    if "\\" in text:
        raise MediaRefused("url_backslash", "the URL contains a backslash")
    colon = text.find(":")
    if colon <= 0 or not _SCHEME.match(text, 0, colon):
        raise MediaRefused(
            "url_not_absolute", "the value is not an https URL or a data: URL; local file paths are never accepted"
        )
    scheme = text[:colon].lower()
    if scheme not in ("https", "http"):
        shown = scheme if len(scheme) <= 16 else scheme[:16] + "..."
        raise MediaRefused(
            "url_scheme_not_allowed",
            f"the URL scheme {shown!r} is not allowed; only https URLs (http where the domain entry allows it) and data: URLs are accepted",
        )
    if not text.startswith("//", colon + 1):
        raise MediaRefused("url_malformed", "the URL must have the form https://host/path")
    if "#" in text:
        raise MediaRefused("url_fragment", "the URL contains a # fragment; remove it")
    start = colon + 3
    m = _AUTHORITY_END.search(text, start)
    end = m.start() if m else len(text)
    authority = text[start:end]
    if "@" in authority:
        raise MediaRefused(
            "url_userinfo", "the URL has user information before the host (user@host); credentials in media URLs are not accepted"
        )
    if authority.startswith("["):
        raise MediaRefused("url_ip_literal", "the URL's host is an IP address; media must come from a named host")
    host, sep, port_text = authority.rpartition(":") if ":" in authority else (authority, "", "")
    port = None
    if sep:
        if not _PORT.match(port_text) or int(port_text) > 65535:
            raise MediaRefused("url_bad_port", "the URL's port is not a number from 1 to 65535 (without leading zeros)")
        port = int(port_text)
    host = host.lower()
    problem = check_host(host)
    if problem is not None:
        raise MediaRefused(problem[0], f"the URL's host {problem[1]}")
    q = text.find("?", end)
    path_end = q if q >= 0 else len(text)
    path = text[end:path_end]
    if not _PATH.match(path) or ("%" in path and _BAD_ESCAPE.search(path)):
        raise MediaRefused(
            "url_bad_path", "the URL path contains a character that must be percent-encoded, or a malformed %-escape"
        )
    if q >= 0 and (not _QUERY.match(text, q + 1) or _BAD_ESCAPE.search(text, q + 1)):
        raise MediaRefused(
            "url_bad_query", "the URL query contains a character that must be percent-encoded, or a malformed %-escape"
        )
    if "." in path or "%" in path:
        for segment in path.split("/"):
            if segment.lower() in _DOT_SEGMENTS:
                raise MediaRefused("url_dot_segment", "the URL path contains a '.' or '..' segment")
    canonical = f"{scheme}://{host}{sep}{port_text}{text[end:]}"
    return MediaUrl(scheme, host, port, canonical if canonical != text else text)


# -- the allow-list ----------------------------------------------------------------------------------

_DEFAULT_PORT = {"https": 443, "http": 80}


class DomainSet:
    """Allow rules indexed for lookup: exact hosts in a dict, wildcard suffixes in another."""

    def __init__(self, entries: tuple[DomainEntry, ...] | list[DomainEntry]):
        self.entries = tuple(entries)
        self.exact: dict[str, list[DomainEntry]] = {}
        self.suffixes: dict[str, list[DomainEntry]] = {}
        for e in self.entries:
            (self.suffixes if e.wildcard else self.exact).setdefault(e.host, []).append(e)

    def _candidates(self, host: str) -> list[DomainEntry]:
        found = list(self.exact.get(host, ()))
        if self.suffixes:
            dot = host.find(".")
            while dot >= 0:
                found += self.suffixes.get(host[dot + 1 :], ())
                dot = host.find(".", dot + 1)
        return found

    def decide(self, url: MediaUrl) -> MediaRefused | None:
        """None when an entry allows the URL's scheme, host and port; else the refusal."""
        candidates = self._candidates(url.host)
        if not candidates:
            why = f"the host {url.host!r} is not on this gateway's list of allowed media domains"
            if not self.entries:
                why += "; send the media inline as a base64 data: URL"
            return MediaRefused("domain_not_allowed", why)
        default = _DEFAULT_PORT[url.scheme]
        port = url.port if url.port is not None else default
        same_port = [e for e in candidates if (e.port if e.port is not None else default) == port]
        if not same_port:
            return MediaRefused("url_port_not_allowed", f"port {port} is not allowed for the host {url.host!r}")
        if url.scheme == "http" and not any(e.allow_http for e in same_port):
            return MediaRefused("http_not_allowed", f"plain http is not allowed for the host {url.host!r}; use https")
        return None


def _lenient_entries(values: tuple[str, ...]) -> list[DomainEntry]:
    # read_media has already reported bad entries; one that slips through narrows the list, never widens it
    out = []
    for v in values:
        try:
            out.append(parse_domain_entry(v))
        except ValueError:
            continue
    return out


# -- base64 -------------------------------------------------------------------------------------------

_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
# "data:" and ";base64," exactly; the MIME type in any case (RFC 2045), lower-cased on the way out.
_DATA_HEADER = re.compile(r"(?i:data):((?i:[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,63}));base64,")
_BAD_B64 = "the payload is not strict base64 (A-Z, a-z, 0-9, + and /, padded with = to a multiple of 4 characters, no whitespace)"
_KIND_NAMES = {"image": "images", "video": "videos", "audio": "audio", "time_series": "time series", "document": "documents"}
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,40}\Z")


def _shown(name: Any) -> str:
    return repr(name) if isinstance(name, str) and _SAFE_NAME.match(name) else "this"


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


# -- the walk -----------------------------------------------------------------------------------------


class _Walk:
    """One request's pass over its body: counts, running size, the domain set in force."""

    __slots__ = ("p", "domains", "items", "total", "hosts")

    def __init__(self, policy: "MediaPolicy", domains: DomainSet, hosts: list[tuple[str, int, str]] | None):
        self.p = policy
        self.domains = domains
        self.items = 0
        self.total = 0
        self.hosts = hosts

    # -- leaves ---------------------------------------------------------------------------------
    def url(self, value: str, kind: str, where: str) -> str:
        """Check one media reference (data: or http(s)); return its canonical form."""
        self.items += 1
        if self.items > self.p.cfg.max_items:
            raise MediaRefused("too_many_media_items", f"the request carries more than {self.p.cfg.max_items} media items", where)
        if value[:5].lower() == "data:":
            return self.data_url(value, kind, where)
        try:
            u = parse_media_url(value, self.p.cfg.max_url_length)
        except MediaRefused as exc:
            exc.param = where
            raise
        refused = self.domains.decide(u)
        if refused is not None:
            refused.param = where
            raise refused
        if self.hosts is not None:
            self.hosts.append((u.host, u.port or _DEFAULT_PORT[u.scheme], where))
        return u.canonical

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
        if mime not in self.p.mimes[kind]:
            allowed = ", ".join(self.p.mimes[kind]) or "none"
            shown = repr(mime) if _MIME_TOKEN.match(mime) else "of this item"
            raise MediaRefused(
                "data_mime_not_allowed", f"the MIME type {shown} is not allowed for {_KIND_NAMES[kind]}; allowed: {allowed}", where
            )

    def payload(self, text: str, start: int, mime: str, kind: str, where: str) -> None:
        """Validate base64 text[start:] as one item of an allowed ``mime``: strict, within limits, magic."""
        if (kind, mime) in FRAME_SEQUENCE_MIMES:
            frames = text[start:].split(",")
            size = sum(self._b64(f, 0, mime, kind, where) for f in frames)
        else:
            size = self._b64(text, start, mime, kind, where)
        self.within_item_limit(size, where)

    def within_item_limit(self, size: int, where: str) -> None:
        limit = self.p.cfg.max_item_bytes
        if size > limit:
            raise MediaRefused("media_item_too_large", f"the item decodes to {size} bytes, over the limit of {limit} bytes per item", where)

    def _b64(self, text: str, start: int, mime: str, kind: str, where: str) -> int:
        n = len(text) - start
        if n == 0:
            raise MediaRefused("data_empty", "the base64 payload is empty", where)
        if n % 4 or not text.isascii():
            raise MediaRefused("data_bad_base64", _BAD_B64, where)
        pad = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
        size = n // 4 * 3 - pad
        self.within_item_limit(size, where)
        cfg = self.p.cfg
        self.total += size
        if self.total > cfg.max_request_bytes:
            why = f"base64 media in this request decodes to more than {cfg.max_request_bytes} bytes in total"
            raise MediaRefused("media_request_too_large", why, where)
        # Strictness without decoding: deleting the alphabet must leave only the header and the padding.
        left = text.encode("ascii").translate(None, _B64_ALPHABET)
        if left != text[:start].encode("ascii").translate(None, _B64_ALPHABET) + b"=" * pad:
            raise MediaRefused("data_bad_base64", _BAD_B64, where)
        if cfg.check_magic:
            head = binascii.a2b_base64(text[start : start + min(n, 24)])
            if not SIGNATURES[(kind, mime)](head):
                raise MediaRefused("data_magic_mismatch", f"the decoded bytes do not start like {mime} data", where)
        return size

    def media_value(self, value: Any, kind: str, where: str, container: Any, key: Any) -> None:
        """A chat-style media value: a URL string, or {"url"|"data": URL, <allowed params>}."""
        if isinstance(value, str):
            canon = self.url(value, kind, where)
            if canon is not value:
                container[key] = canon
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
        canon = self.url(target, kind, f"{where}.{field}")
        if canon is not target:
            value[field] = canon

    def params(self, obj: dict[str, Any], kind: str, where: str, skip: tuple[str, ...]) -> None:
        """The processor knobs beside a media reference: only the allowed names, scalar values only."""
        allowed = self.p.params[kind]
        for k, v in obj.items():
            if k in skip:
                continue
            if k not in allowed:
                why = f"the field {_shown(k)} is not allowed in {kind} items; allowed fields: {', '.join((*skip, *allowed))}"
                raise MediaRefused("unexpected_media_field", why, _at(where, k))
            if not _is_scalar(v):
                raise MediaRefused("malformed_media", f"the field {k!r} must be a string, number or boolean", _at(where, k))

    def only_keys(self, obj: dict[str, Any], allowed: frozenset[str], what: str, where: str) -> None:
        for k in obj:
            if k not in allowed:
                raise MediaRefused(
                    "unexpected_media_field",
                    f"the field {_shown(k)} is not allowed in {what}; allowed fields: {', '.join(sorted(allowed))}",
                    _at(where, k),
                )

    def unknown_type(self, t: Any, supported: tuple[str, ...], where: str) -> MediaRefused:
        return MediaRefused(
            "unknown_part_type",
            f"the content part type {_shown(t)} is not supported here; supported types: {', '.join(supported)}",
            where,
        )

    # -- shared -----------------------------------------------------------------------------------
    def image_data(self, body: dict[str, Any]) -> None:
        value = body["image_data"]
        if value is None:
            return
        if "image_url" not in self.p.allowed:
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

    def content_list(self, content: Any, where: str, part: Callable[[Any, str], None]) -> None:
        """content: None or a string passes; a list is walked part by part; anything else is refused."""
        if content is None or isinstance(content, str):
            return
        if not isinstance(content, list):
            raise MediaRefused("malformed_content", "content must be a string or a list of content parts", where)
        for j, item in enumerate(content):
            part(item, f"{where}[{j}]")

    @staticmethod
    def part_type(part: Any, where: str) -> str:
        if not isinstance(part, dict):
            raise MediaRefused("malformed_content", "each content part must be an object with a type", where)
        t = part.get("type")
        if not isinstance(t, str):
            raise MediaRefused("malformed_content", "each content part must have a string type", where)
        return t

    # -- chat ---------------------------------------------------------------------------------------
    def chat(self, body: dict[str, Any]) -> None:
        messages = body.get("messages")
        if messages is not None and not isinstance(messages, str):
            if not isinstance(messages, list):
                raise MediaRefused("malformed_content", "messages must be a list of message objects", "messages")
            for i, m in enumerate(messages):
                if not isinstance(m, dict):
                    raise MediaRefused("malformed_content", "each message must be an object", f"messages[{i}]")
                self.content_list(m.get("content"), f"messages[{i}].content", self.chat_part)

    def chat_part(self, part: Any, where: str) -> None:
        t = self.part_type(part, where)
        if t in self.p.chat_text:
            return
        kind = self.p.chat_media.get(t)
        if kind is None:
            raise self.unknown_type(t, self.p.chat_supported, where)
        if t not in part:
            raise MediaRefused("malformed_media", f"a {t} part must carry its value under {t!r}", where)
        value = part[t]
        if isinstance(value, str):
            # lmdeploy passes a bare-string part's other fields to the processor as parameters
            self.params(part, kind, where, skip=("type", t))
        else:
            self.only_keys(part, frozenset(("type", t)), f"{t} parts", where)
        self.media_value(value, kind, f"{where}.{t}", part, t)

    # -- Anthropic messages / count_tokens ----------------------------------------------------------------
    def anthropic(self, body: dict[str, Any]) -> None:
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            self.content_list(system, "system", self.anthropic_block)
        messages = body.get("messages")
        if messages is None:
            return
        if not isinstance(messages, list):
            raise MediaRefused("malformed_content", "messages must be a list of message objects", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise MediaRefused("malformed_content", "each message must be an object", f"messages[{i}]")
            self.content_list(m.get("content"), f"messages[{i}].content", self.anthropic_block)

    def anthropic_block(self, block: Any, where: str) -> None:
        t = self.part_type(block, where)
        if t in self.p.anthropic_text:
            if t == "tool_result":
                self.content_list(block.get("content"), f"{where}.content", self.anthropic_inner_block)
            return
        kind = self.p.anthropic_media.get(t)
        if kind is None:
            raise self.unknown_type(t, self.p.anthropic_supported, where)
        self.anthropic_source(block, kind, where)

    def anthropic_inner_block(self, block: Any, where: str) -> None:
        """Inside tool_result content or a document's content source: text and media only."""
        t = self.part_type(block, where)
        if t == "text" and "text" in self.p.allowed:
            return
        kind = self.p.anthropic_media.get(t)
        if kind is None:
            raise self.unknown_type(t, self.p.anthropic_inner_supported, where)
        self.anthropic_source(block, kind, where)

    def anthropic_source(self, block: dict[str, Any], kind: str, where: str) -> None:
        self.only_keys(block, _ANTHROPIC_BLOCK_KEYS[kind], f"{block['type']} blocks", where)
        source = block.get("source")
        at = f"{where}.source"
        if not isinstance(source, dict):
            raise MediaRefused("malformed_media", "source must be an object with a type", at)
        st = source.get("type")
        if st == "url":
            self.only_keys(source, _URL_SOURCE_KEYS, "url sources", at)
            url = source.get("url")
            if not isinstance(url, str):
                raise MediaRefused("malformed_media", "url must be a string", f"{at}.url")
            canon = self.url(url, kind, f"{at}.url")
            if canon is not url:
                source["url"] = canon
        elif st == "base64":
            self.only_keys(source, _BASE64_SOURCE_KEYS, "base64 sources", at)
            mime, data = source.get("media_type"), source.get("data")
            if not isinstance(mime, str) or not isinstance(data, str):
                raise MediaRefused("malformed_media", "a base64 source needs media_type and data strings", at)
            norm = mime.lower()
            self.check_mime(norm, kind, f"{at}.media_type")
            self.items += 1
            if self.items > self.p.cfg.max_items:
                raise MediaRefused("too_many_media_items", f"the request carries more than {self.p.cfg.max_items} media items", at)
            self.payload(data, 0, norm, kind, f"{at}.data")
            if norm != mime:
                source["media_type"] = norm
        elif kind == "document" and st == "text":
            self.only_keys(source, _BASE64_SOURCE_KEYS, "text sources", at)
            if source.get("media_type") != "text/plain" or not isinstance(source.get("data"), str):
                raise MediaRefused("malformed_media", "a text source needs media_type 'text/plain' and a data string", at)
        elif kind == "document" and st == "content":
            self.only_keys(source, _CONTENT_SOURCE_KEYS, "content sources", at)
            content = source.get("content")
            self.content_list(content, f"{at}.content", self.anthropic_inner_block)
        elif st == "file":
            raise MediaRefused("file_id_not_supported", "file references are not supported; send the media inline or by URL", at)
        else:
            types = "url, base64, text or content" if kind == "document" else "url or base64"
            raise MediaRefused("malformed_media", f"the source type must be {types}", at)

    # -- Responses ------------------------------------------------------------------------------------
    def responses(self, body: dict[str, Any]) -> None:
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
                self.content_list(item.get("content"), f"{where}.content", self.responses_part)
            elif t == "function_call_output":
                self.content_list(item.get("output"), f"{where}.output", self.responses_part)
            elif t != "function_call":
                raise MediaRefused(
                    "unknown_input_item_type",
                    f"the input item type {_shown(t)} is not supported here; supported types: message, function_call, function_call_output",
                    where,
                )

    def responses_part(self, part: Any, where: str) -> None:
        t = self.part_type(part, where)
        if t in self.p.responses_text:
            return
        kind = self.p.responses_media.get(t)
        if kind is None:
            raise self.unknown_type(t, self.p.responses_supported, where)
        if t == "input_image":
            self.only_keys(part, _INPUT_IMAGE_KEYS, "input_image parts", where)
            self.responses_ref(part, ("image_url",), kind, where)
            if not _is_scalar(part.get("detail")):
                raise MediaRefused("malformed_media", "detail must be a string", f"{where}.detail")
        else:
            self.only_keys(part, _INPUT_FILE_KEYS, "input_file parts", where)
            self.responses_ref(part, ("file_data", "file_url"), kind, where)
            if not isinstance(part.get("filename", ""), str):
                raise MediaRefused("malformed_media", "filename must be a string", f"{where}.filename")

    def responses_ref(self, part: dict[str, Any], fields: tuple[str, ...], kind: str, where: str) -> str:
        if part.get("file_id") is not None:
            why = "file_id references are not supported; send the media inline or by URL"
            raise MediaRefused("file_id_not_supported", why, f"{where}.file_id")
        given = [f for f in fields if part.get(f) is not None]
        if len(given) != 1:
            names = " or ".join(fields)
            raise MediaRefused("malformed_media", f"the part must give exactly one of {names}", where)
        field = given[0]
        value = part[field]
        if not isinstance(value, str):
            raise MediaRefused("malformed_media", f"{field} must be a URL string", f"{where}.{field}")
        if field == "file_data" and value[:5].lower() != "data:":
            raise MediaRefused("data_url_malformed", "file_data must be a data URL: data:<type>;base64,<payload>", f"{where}.{field}")
        canon = self.url(value, kind, f"{where}.{field}")
        if canon is not value:
            part[field] = canon
        return field


_MIME_TOKEN = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,63}\Z")
_ANTHROPIC_BLOCK_KEYS = {
    "image": frozenset({"type", "source", "cache_control"}),
    "document": frozenset({"type", "source", "cache_control", "title", "context", "citations"}),
}
_URL_SOURCE_KEYS = frozenset({"type", "url"})
_BASE64_SOURCE_KEYS = frozenset({"type", "media_type", "data"})
_CONTENT_SOURCE_KEYS = frozenset({"type", "content"})
_INPUT_IMAGE_KEYS = frozenset({"type", "image_url", "file_id", "detail"})
_INPUT_FILE_KEYS = frozenset({"type", "file_data", "file_url", "file_id", "filename"})


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if _SAFE_NAME.match(key) else where


# -- DNS (optional) --------------------------------------------------------------------------------------

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def is_global_address(text: str) -> bool:
    """True only for a public unicast address; embedded IPv4 (mapped, 6to4, Teredo) must be public too."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
        if ip.teredo is not None:
            embedded += list(ip.teredo)
        if ip in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if any(not (a.is_global and not a.is_multicast) for a in embedded):
            return False
    return ip.is_global and not ip.is_multicast


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


# -- the filter ------------------------------------------------------------------------------------------


class MediaPolicy:
    """Configured once from ``MediaConfig``; ``check_body`` decides once per request."""

    def __init__(self, cfg: MediaConfig, *, resolver: Resolver | None = None):
        self.cfg = cfg
        self.domains = DomainSet(cfg.entries)  # a malformed entry raises here, at start-up
        self._key_domains: dict[tuple[str, ...], DomainSet] = {}
        self.allowed = frozenset(cfg.part_types)
        self.mimes = {kind: cfg.mimes(kind) for kind in _KIND_NAMES}
        self.params = {kind: frozenset(cfg.params(kind)) for kind in _KIND_NAMES}
        a = self.allowed
        self.chat_text = frozenset(t for t in CHAT_TEXT_TYPES if t in a)
        self.chat_media = {t: k for t, k in CHAT_MEDIA_TYPES.items() if t in a}
        self.anthropic_text = frozenset(t for t in ANTHROPIC_TEXT_TYPES if t in a)
        self.anthropic_media = {t: k for t, k in ANTHROPIC_MEDIA_TYPES.items() if t in a}
        self.responses_text = frozenset(t for t in RESPONSES_TEXT_TYPES if t in a)
        self.responses_media = {t: k for t, k in RESPONSES_MEDIA_TYPES.items() if t in a}
        self.chat_supported = (*[t for t in CHAT_TEXT_TYPES if t in a], *self.chat_media)
        self.anthropic_supported = (*[t for t in ANTHROPIC_TEXT_TYPES if t in a], *self.anthropic_media)
        self.anthropic_inner_supported = (*(("text",) if "text" in a else ()), *self.anthropic_media)
        self.responses_supported = (*[t for t in RESPONSES_TEXT_TYPES if t in a], *self.responses_media)
        self.resolver = resolver or _getaddrinfo
        for kind in _KIND_NAMES:
            for mime in self.mimes[kind]:
                if cfg.check_magic and (kind, mime) not in SIGNATURES:
                    raise ValueError(f"media.mime_types.{kind}: no magic-byte signature is known for {mime!r}")

    @property
    def is_async(self) -> bool:
        """True when the listener must ``await check_body_async`` (the DNS check is on)."""
        return self.cfg.resolve_dns

    def domains_for(self, ctx: RequestContext) -> DomainSet:
        key = ctx.key
        override = key.media_allowed_domains if key is not None else None
        if override is None:
            return self.domains
        found = self._key_domains.get(override)
        if found is None:
            found = self._key_domains[override] = DomainSet(_lenient_entries(override))
        return found

    def check_body(self, ctx: RequestContext) -> Refusal | None:
        return self._check(ctx, None)

    async def check_body_async(self, ctx: RequestContext) -> Refusal | None:
        if not self.cfg.resolve_dns:
            return self._check(ctx, None)
        hosts: list[tuple[str, int, str]] = []
        refusal = self._check(ctx, hosts)
        if refusal is not None or not hosts:
            return refusal
        unique: dict[tuple[str, int], str] = {}
        for host, port, where in hosts:
            unique.setdefault((host, port), where)
        results = await asyncio.gather(
            *(asyncio.wait_for(self.resolver(h, p), self.cfg.dns_timeout) for h, p in unique), return_exceptions=True
        )
        for ((host, _), where), addrs in zip(unique.items(), results):
            if isinstance(addrs, BaseException) or not addrs:
                return self._refuse(MediaRefused("dns_failed", f"the host {host!r} could not be resolved", where))
            if not all(is_global_address(a) for a in addrs):
                return self._refuse(MediaRefused("dns_non_global", f"the host {host!r} resolves to an address that is not public", where))
        return None

    def _check(self, ctx: RequestContext, hosts: list[tuple[str, int, str]] | None) -> Refusal | None:
        body = ctx.body
        if not body or _text_only(ctx.route.kind, body):
            return None
        walk = _Walk(self, self.domains_for(ctx), hosts)
        kind = ctx.route.kind
        try:
            if kind == "chat":
                walk.chat(body)
            elif kind in ("messages", "count_tokens"):
                walk.anthropic(body)
            elif kind == "responses":
                walk.responses(body)
            if "image_data" in body:
                walk.image_data(body)
        except MediaRefused as exc:
            return self._refuse(exc)
        return None

    @staticmethod
    def _refuse(exc: MediaRefused) -> Refusal:
        MEDIA_REFUSALS.labels(reason=exc.reason).inc()
        param = exc.param or "body"
        return Refusal(400, f"Refused media at {param}: {exc.why}.", exc.reason, param=param)


def _text_only(kind: str, body: dict[str, Any]) -> bool:
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
