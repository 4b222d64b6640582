"""The media policy, rule by rule: one table of accepted and refused request bodies.

``CASES`` is shared with ``test_media_e2e.py``, which sends every row through a real gateway
to a simulated backend. Here each row goes straight to ``MediaPolicy.check_body``.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.config import ApiKeyConfig, ConfigError, parse_config
from gateway.config.fields import Problems, Section
from gateway.config.media import MediaConfig, read_media
from gateway.filters import RequestContext
from gateway.filters.media import MediaPolicy
from gateway.media import REASONS, DomainSet, MediaRefused, is_global_address, parse_domain_entry, parse_media_url
from gateway.media.reasons import NETWORK_REASONS
from gateway.metrics import REGISTRY
from gateway.routes import ROUTES

pytestmark = pytest.mark.unit

MODEL = "test-model"

# -- configurations the table runs under -----------------------------------------------------------------

MEDIA_CONFIGS: dict[str, dict[str, Any]] = {
    "main": {
        "allowed_domains": [
            "images.example.com",
            "*.cdn.example.org",
            "media.example.net:8443",
            "http://legacy.example.com",
            "docs.example.com",
        ],
        "check_magic": True,
        "mime_types": {"video": ["video/mp4", "video/webm", "video/jpeg"]},
    },
    "default": {},
    "small": {"allowed_domains": ["images.example.com"], "max_item_bytes": 1024, "max_request_bytes": 1536, "max_items": 3},
    "imageonly": {"allowed_domains": ["images.example.com"], "part_types": ["text", "image_url", "image", "input_text", "input_image"]},
    # the opt-outs: magic bytes not checked, unknown part keys dropped instead of refused
    "lenient": {"allowed_domains": ["images.example.com"], "check_magic": False, "unknown_part_keys": "drop"},
}
# The "narrow" API key replaces the gateway's list with its own.
NARROW_KEY_DOMAINS = ["narrow.example.com", "*.cdn.example.org"]

ROUTE_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
}


def media_config(name: str) -> MediaConfig:
    problems = Problems()
    cfg = read_media(Section(copy.deepcopy(MEDIA_CONFIGS[name]), "media", problems))
    problems.raise_if_any()
    return cfg


# -- media payloads with the right magic bytes -------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(30)
GIF = b"GIF89a" + bytes(20)
WEBP = b"RIFF\x24\x00\x00\x00WEBPVP8 " + bytes(20)
MP4 = b"\x00\x00\x00\x18ftypmp42" + bytes(20)
WEBM = b"\x1a\x45\xdf\xa3" + bytes(20)
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(20)
MP3 = b"ID3\x03\x00" + bytes(20)
OGG = b"OggS\x00\x02" + bytes(20)
FLAC = b"fLaC\x00" + bytes(20)
NPY = b"\x93NUMPY\x01\x00" + bytes(20)
PDF = b"%PDF-1.7\n" + bytes(20)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def data_url(mime: str, raw: bytes) -> str:
    return f"data:{mime};base64,{b64(raw)}"


D_PNG = data_url("image/png", PNG)
D_JPEG = data_url("image/jpeg", JPEG)
IMG = "https://images.example.com/cat.png"
EVIL = "https://evil.example.com/cat.png"

# -- body builders ------------------------------------------------------------------------------------------


def chat(*parts: Any, **top: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}], "max_tokens": 4, **top}


def chat_raw(messages: Any, **top: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **top}


def part(t: str, url: Any, **params: Any) -> dict[str, Any]:
    return {"type": t, t: {"url": url, **params}}


def bare(t: str, url: Any, **extra: Any) -> dict[str, Any]:
    return {"type": t, t: url, **extra}


def img(url: Any) -> dict[str, Any]:
    return part("image_url", url)


def anth(*blocks: Any, **top: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, *blocks]}], **top}


def a_url(url: Any, t: str = "image") -> dict[str, Any]:
    return {"type": t, "source": {"type": "url", "url": url}}


def a_b64(mime: Any, data: Any, t: str = "image") -> dict[str, Any]:
    return {"type": t, "source": {"type": "base64", "media_type": mime, "data": data}}


def tool_result(*blocks: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": "toolu_1", "content": list(blocks)}


def resp(*parts: Any, **top: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "look"}, *parts]}], **top}


def r_img(image_url: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "input_image", "image_url": image_url, **extra}


def completions(**top: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "once upon", "max_tokens": 4, **top}


# -- the table ------------------------------------------------------------------------------------------------

P = "messages[0].content[1]"  # the first media part in chat() / anth() bodies
R = "input[0].content[1]"  # the first media part in resp() bodies


@dataclass(frozen=True)
class Case:
    id: str
    route: str
    body: dict[str, Any]
    expect: str  # "ok" or the refusal reason
    param: str | None = None  # where the refusal points; for "ok" rows, where the canonical form is checked
    canonical: Any = None  # the rewritten value at param, for "ok" rows that normalise case or drop keys
    config: str = "main"
    key: str | None = None  # "narrow": the API key whose media_allowed_domains override the gateway's
    tags: tuple[str, ...] = field(default=())


CASES: list[Case] = []


def ok(id: str, route: str, body: dict[str, Any], *, at: str | None = None, canonical: Any = None, config: str = "main", key: str | None = None) -> None:
    CASES.append(Case(id, route, body, "ok", at, canonical, config, key))


def no(id: str, route: str, body: dict[str, Any], reason: str, param: str, *, config: str = "main", key: str | None = None) -> None:
    assert reason in REASONS, reason
    CASES.append(Case(id, route, body, reason, param, None, config, key))


def no_url(id: str, url: str, reason: str, *, config: str = "main") -> None:
    """A chat image_url.url that must be refused."""
    no(id, "chat", chat(img(url)), reason, f"{P}.image_url.url", config=config)


# accepted: every chat media type, in both shapes -------------------------------------------------------------
CHAT_URLS = {
    "image_url": IMG,
    "image": "https://images.example.com/dog.jpg",
    "video_url": "https://a.cdn.example.org/clip.mp4",
    "video": "https://a.cdn.example.org/clip.webm",
    "audio_url": "https://a.cdn.example.org/talk.wav",
    "audio": "https://a.cdn.example.org/talk.mp3",
    "time_series_url": "https://a.cdn.example.org/quake.npy",
    "time_series": "https://a.cdn.example.org/quake.npy",
}
for t, u in CHAT_URLS.items():
    params = {"sampling_rate": 100} if t.startswith("time_series") else {}
    ok(f"chat {t} object with url", "chat", chat(part(t, u, **params)))
    ok(f"chat {t} bare string", "chat", chat(bare(t, u, **params)))
ok("chat image_url object with data instead of url", "chat", chat({"type": "image_url", "image_url": {"data": D_PNG}}))
ok("chat image_url detail parameter", "chat", chat(part("image_url", IMG, detail="high")))

# accepted: data URLs for every default MIME type, each with its magic bytes
for t, mime, raw in [
    ("image_url", "image/png", PNG),
    ("image_url", "image/jpeg", JPEG),
    ("image_url", "image/webp", WEBP),
    ("image_url", "image/gif", GIF),
    ("video_url", "video/mp4", MP4),
    ("video_url", "video/webm", WEBM),
    ("audio_url", "audio/wav", WAV),
    ("audio_url", "audio/mpeg", MP3),
    ("audio_url", "audio/ogg", OGG),
    ("audio_url", "audio/flac", FLAC),
    ("time_series_url", "application/octet-stream", NPY),
]:
    ok(f"chat {t} data:{mime}", "chat", chat(part(t, data_url(mime, raw))))
ok("chat video data:video/jpeg as a sequence of JPEG frames", "chat", chat(part("video_url", f"data:video/jpeg;base64,{b64(JPEG)},{b64(JPEG)}")))
ok("chat data URL one byte (two pad chars)", "chat", chat(img(data_url("image/png", PNG[:1] * 0 + PNG + b"\x00"))))
ok(
    "data URL scheme and MIME case normalised",
    "chat",
    chat(img("DATA:IMAGE/PNG;base64," + b64(PNG))),
    at=f"{P}.image_url.url",
    canonical=D_PNG,
)

# accepted: domain rules
ok("exact domain", "chat", chat(img(IMG)))
ok("wildcard one level", "chat", chat(img("https://a.cdn.example.org/x.png")))
ok("wildcard two levels", "chat", chat(img("https://a.b.cdn.example.org/x.png")))
ok("wildcard punycode label", "chat", chat(img("https://xn--bcher-kva.cdn.example.org/x.png")))
ok("explicit default port 443", "chat", chat(img("https://images.example.com:443/cat.png")))
ok("port named by the entry", "chat", chat(img("https://media.example.net:8443/cat.png")))
ok("http where the entry allows it", "chat", chat(img("http://legacy.example.com/cat.png")))
ok("https on an http entry", "chat", chat(img("https://legacy.example.com/cat.png")))
ok("http explicit port 80 on an http entry", "chat", chat(img("http://legacy.example.com:80/cat.png")))
ok("host without a path", "chat", chat(img("https://images.example.com")))
ok("query string of a presigned URL", "chat", chat(img(IMG + "?X-Amz-Signature=ab%2Fcd&X-Amz-Expires=300&a=")))
ok("percent escapes, @ and : in the path", "chat", chat(img("https://images.example.com/%E7%8C%AB/@me/a:b/(1)~x.png")))
ok("query with slash and question mark", "chat", chat(img(IMG + "?next=/a?b")))
ok("scheme and host case normalised", "chat", chat(img("HTTPS://IMAGES.Example.COM/Cat.PNG")), at=f"{P}.image_url.url", canonical="https://images.example.com/Cat.PNG")
ok(
    "bare string canonicalised in place",
    "chat",
    chat(bare("image_url", "Https://Images.Example.Com/A.png")),
    at=f"{P}.image_url",
    canonical="https://images.example.com/A.png",
)
ok("several media parts", "chat", chat(img(IMG), img(D_PNG), part("video_url", "https://a.cdn.example.org/v.mp4")))
ok(
    "several messages and roles",
    "chat",
    chat_raw(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, img(IMG)]},
            {"role": "assistant", "content": [{"type": "text", "text": "b"}, {"type": "refusal", "refusal": "no"}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "result"}, img(D_PNG)]},
        ]
    ),
)

# accepted: text only
ok("text only string content", "chat", chat_raw([{"role": "user", "content": "hello"}]))
ok("text only text parts", "chat", chat_raw([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]))
ok("text part text is only text", "chat", chat_raw([{"role": "user", "content": [{"type": "text", "text": "file:///etc/passwd"}]}]))
ok("content null", "chat", chat_raw([{"role": "assistant", "content": None, "tool_calls": []}]))
ok("messages as a prompt string", "chat", chat_raw("hello"))
ok("completions text", "completions", completions())

# accepted: top-level image_data
ok("image_data string", "chat", chat_raw([], input_ids=[1, 2], image_data=IMG))
ok("image_data data URL", "chat", chat_raw([], image_data=D_PNG))
ok("image_data object", "chat", chat_raw([], image_data={"url": IMG}))
ok("image_data list", "chat", chat_raw([], image_data=[IMG, {"url": D_PNG}, {"data": D_JPEG}]))
ok("image_data list on messages", "messages", anth(image_data=[IMG]))
ok("image_data string on completions", "completions", completions(image_data=IMG))
ok("image_data null", "chat", chat_raw([], image_data=None))

# accepted: Anthropic
ok("anthropic image url", "messages", anth(a_url(IMG)))
ok("anthropic image base64", "messages", anth(a_b64("image/png", b64(PNG))))
ok("anthropic media_type case normalised", "messages", anth(a_b64("Image/PNG", b64(PNG))), at=f"{P}.source.media_type", canonical="image/png")
ok("anthropic url canonicalised", "messages", anth(a_url("HTTPS://IMAGES.EXAMPLE.COM/a.png")), at=f"{P}.source.url", canonical="https://images.example.com/a.png")
ok("anthropic image with cache_control", "messages", anth({**a_url(IMG), "cache_control": {"type": "ephemeral"}}))
ok("anthropic tool_result with image", "messages", anth(tool_result({"type": "text", "text": "ok"}, a_url(IMG), a_b64("image/jpeg", b64(JPEG)))))
ok("anthropic tool_result string content", "messages", anth({"type": "tool_result", "tool_use_id": "t", "content": "done"}))
ok("anthropic document url", "messages", anth(a_url("https://docs.example.com/a.pdf", "document")))
ok("anthropic document base64 pdf", "messages", anth({**a_b64("application/pdf", b64(PDF), "document"), "title": "a"}))
ok("anthropic document text source", "messages", anth({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "file:///etc/passwd is only text"}}))
ok("anthropic document content source", "messages", anth({"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "p1"}, a_url(IMG)]}}))
ok(
    "anthropic text-like blocks",
    "messages",
    anth(
        {"type": "thinking", "thinking": "hm", "signature": "s"},
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"url": "file:///etc/passwd"}},
    ),
)
ok("anthropic system blocks", "messages", anth(system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]))
ok("anthropic system string", "messages", anth(system="be brief"))
ok("anthropic string content", "messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
ok("count_tokens image", "count_tokens", anth(a_url(IMG)))

# accepted: Responses
ok("responses input string", "responses", {"model": MODEL, "input": "hello"})
ok("responses text parts", "responses", resp({"type": "input_text", "text": "more"}))
ok("responses input_image url", "responses", resp(r_img(IMG, detail="auto")))
ok("responses input_image data URL", "responses", resp(r_img(D_PNG)))
ok("responses input_image file_id null", "responses", resp(r_img(IMG, file_id=None)))
ok("responses input_file file_data", "responses", resp({"type": "input_file", "file_data": data_url("application/pdf", PDF), "filename": "a.pdf"}))
ok("responses input_file file_url", "responses", resp({"type": "input_file", "file_url": "https://docs.example.com/a.pdf"}))
ok(
    "responses function call round trip",
    "responses",
    {
        "model": MODEL,
        "input": [
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x"}, r_img(IMG)]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "y"}]},
        ],
    },
)
ok("responses url canonicalised", "responses", resp(r_img("HTTPS://Images.Example.Com/a.png")), at=f"{R}.image_url", canonical="https://images.example.com/a.png")

# accepted: per-key override and configurations
ok("narrow key: its own domain", "chat", chat(img("https://narrow.example.com/a.png")), key="narrow")
ok("narrow key: shared wildcard", "chat", chat(img("https://x.cdn.example.org/a.png")), key="narrow")
ok("no domains configured: data URL passes", "chat", chat(img(D_PNG)), config="default")
no_url("no domains configured: magic checked by default", data_url("image/png", JPEG), "data_magic_mismatch", config="default")
ok("magic check off: jpeg bytes declared png pass", "chat", chat(img(data_url("image/png", JPEG))), config="lenient")
ok("small limits: item at the limit", "chat", chat(img(data_url("image/png", PNG + bytes(1024 - len(PNG))))), config="small")
ok("image-only part types: image passes", "chat", chat(img(IMG)), config="imageonly")

# refused: the parser-differential tricks named in the issue ----------------------------------------------------
no_url("userinfo before an allowed host", "https://images.example.com@evil.com/", "url_userinfo")
no_url("fragment hiding an allowed host", "https://evil.com#@images.example.com", "url_fragment")
no_url("allowed host as a prefix of another", "https://images.example.com.evil.com/", "domain_not_allowed")
no_url("trailing dot and upper case", "https://IMAGES.EXAMPLE.COM./a.png", "url_host_trailing_dot")
no_url("enclosed alphanumerics for an IP", "https://①②⑦.0.0.1/", "url_bad_character")
no_url("IPv4-mapped IPv6", "https://[::ffff:127.0.0.1]/", "url_ip_literal")
no_url("decimal IP", "https://2130706433/", "url_ip_literal")
no_url("file URL written as a JSON escape", "\u0066ile:///etc/passwd", "url_scheme_not_allowed")
no("image_url given as a list", "chat", chat({"type": "image_url", "image_url": [{"url": IMG}]}), "malformed_media", f"{P}.image_url")

# refused: schemes and bare paths
for u in [
    "file:///etc/passwd",
    "FILE:///etc/passwd",
    "file://localhost/etc/passwd",
    "ftp://images.example.com/a.png",
    "gopher://images.example.com:70/_x",
    "jar:https://images.example.com/a.jar!/x.png",
    "blob:https://images.example.com/0f0e",
    "javascript:alert(1)",
    "ws://images.example.com/a",
    "wss://images.example.com/a",
    "httpss://images.example.com/a.png",
    "http+unix://%2Fvar%2Frun/a",
    "foo:/etc/passwd",
    "C:/Windows/win.ini",
    "dict://images.example.com:11211/stat",
    "ldap://images.example.com/",
]:
    no_url(f"scheme {u.split(':')[0]} ({u[:24]})", u, "url_scheme_not_allowed")
for u in ["/etc/passwd", "etc/passwd", "./cat.png", "../cat.png", "cat.png", "~/.ssh/id_rsa", "//images.example.com/cat.png", ":foo"]:
    no_url(f"bare path {u}", u, "url_not_absolute")
no_url("windows path with backslashes", "C:\\Windows\\win.ini", "url_backslash")
no_url("empty URL", "", "url_empty")
no_url("scheme without slashes", "https:images.example.com/a.png", "url_malformed")
no_url("scheme with one slash", "https:/images.example.com/a.png", "url_malformed")
no_url("three slashes, empty host", "https:///images.example.com/a.png", "url_bad_host")
no_url("scheme only", "https://", "url_bad_host")

# refused: http without an http entry, ports
no_url("http on an https-only exact entry", "http://images.example.com/a.png", "http_not_allowed")
no_url("http on an https-only wildcard", "http://a.cdn.example.org/a.png", "http_not_allowed")
no_url("port the entry does not name", "https://images.example.com:8080/a.png", "url_port_not_allowed")
no_url("port entry without its port", "https://media.example.net/a.png", "url_port_not_allowed")
no_url("port entry with another port", "https://media.example.net:9443/a.png", "url_port_not_allowed")
no_url("http entry on another port", "http://legacy.example.com:8080/a.png", "url_port_not_allowed")
no_url("http default port on https", "https://images.example.com:80/a.png", "url_port_not_allowed")
for p in ["0", "65536", "0443", "", "abc", "+443", "4 43", "99999"]:
    reason = "url_bad_character" if " " in p else "url_bad_port"
    no_url(f"bad port {p!r}", f"https://images.example.com:{p}/a.png", reason)
no_url("two ports", "https://images.example.com:443:443/a.png", "url_bad_host")

# refused: IP literals in every spelling
for u in [
    "https://127.0.0.1/",
    "https://10.0.0.1/a.png",
    "https://169.254.169.254/latest/meta-data/",
    "https://0x7f.0.0.1/",
    "https://0177.0.0.1/",
    "https://127.1/",
    "https://0x7f000001/",
    "https://017700000001/",
    "https://0/",
    "https://1.2.3.4:443/a.png",
    "https://images.example.com.127.0.0.1/",
    "https://[::1]/",
    "https://[fe80::1%25eth0]/",
    "https://[::ffff:7f00:1]:443/",
    "https://0x7F.1/",
]:
    no_url(f"IP literal {u[8:32]}", u, "url_ip_literal")

# refused: wildcard and exact matching
no_url("wildcard does not match its own suffix", "https://cdn.example.org/a.png", "domain_not_allowed")
no_url("wildcard suffix glued to a label", "https://evilcdn.example.org/a.png", "domain_not_allowed")
no_url("wildcard host followed by another domain", "https://a.cdn.example.org.evil.com/a.png", "domain_not_allowed")
no_url("parent of an exact entry", "https://example.com/a.png", "domain_not_allowed")
no_url("subdomain of an exact entry", "https://x.images.example.com/a.png", "domain_not_allowed")
no_url("unlisted host", EVIL, "domain_not_allowed")
no_url("localhost", "https://localhost/a.png", "domain_not_allowed")

# refused: host grammar
for u, r in [
    ("https://images..example.com/a.png", "url_bad_host"),
    ("https://-a.cdn.example.org/a.png", "url_bad_host"),
    ("https://a-.cdn.example.org/a.png", "url_bad_host"),
    ("https://a_b.cdn.example.org/a.png", "url_bad_host"),
    ("https://images%2eexample.com/a.png", "url_bad_host"),
    ("https://images.example.com%00/a.png", "url_bad_host"),
    ("https://%69mages.example.com/a.png", "url_bad_host"),
    ("https://" + "a" * 64 + ".cdn.example.org/a.png", "url_bad_host"),
    ("https://" + "a." * 126 + "cdn.example.org/a.png", "url_bad_host"),
    ("https://*.cdn.example.org/a.png", "url_bad_host"),
    ("https://.images.example.com/a.png", "url_bad_host"),
    ("https://images.example.com../a.png", "url_host_trailing_dot"),
    ("https://images.example.com]/a.png", "url_ip_literal"),
]:
    no_url(f"host {u[8:40]}", u, r)

# refused: characters anywhere
for u, r in [
    ("https://images.example.com/a b.png", "url_bad_character"),
    ("https://images.exa\tmple.com/a.png", "url_bad_character"),
    ("https://images.example.com/a.png\n", "url_bad_character"),
    ("\nhttps://images.example.com/a.png", "url_bad_character"),
    (" https://images.example.com/a.png", "url_bad_character"),
    ("https://images.example.com/\x00.png", "url_bad_character"),
    ("https://images.example.com/\x7f.png", "url_bad_character"),
    ("https://images.example.com/\u00fc.png", "url_bad_character"),
    ("https://images\uff0eexample.com/a.png", "url_bad_character"),
    ("https://images.example.com\u3002/a.png", "url_bad_character"),
    ("https://images.example.com/\u202ea.png", "url_bad_character"),
    ("https://images.example.com\\@evil.com/", "url_backslash"),
    ("https:\\\\images.example.com\\a.png", "url_backslash"),
    ("https://evil.com\\images.example.com/a.png", "url_backslash"),
]:
    no_url(f"character {u!r}"[:60], u, r)

# refused: path and query
for u, r in [
    ("https://images.example.com/a/../b.png", "url_dot_segment"),
    ("https://images.example.com/a/./b.png", "url_dot_segment"),
    ("https://images.example.com/..", "url_dot_segment"),
    ("https://images.example.com/%2e%2e/etc/passwd", "url_dot_segment"),
    ("https://images.example.com/%2E./x", "url_dot_segment"),
    ("https://images.example.com/a%zz.png", "url_bad_path"),
    ("https://images.example.com/a%2", "url_bad_path"),
    ("https://images.example.com/a|b.png", "url_bad_path"),
    ("https://images.example.com/a{b}.png", "url_bad_path"),
    ('https://images.example.com/a"b.png', "url_bad_path"),
    ("https://images.example.com/a<b>.png", "url_bad_path"),
    ("https://images.example.com/a^b.png", "url_bad_path"),
    ("https://images.example.com/a`b.png", "url_bad_path"),
    ("https://images.example.com/a[0].png", "url_bad_path"),
    ("https://images.example.com/a.png?x=<y>", "url_bad_query"),
    ("https://images.example.com/a.png?x=%", "url_bad_query"),
    ("https://images.example.com/a.png?q=[1]", "url_bad_query"),
    ("https://images.example.com/a.png?q={}", "url_bad_query"),
]:
    no_url(f"path {u[26:60]}", u, r)
no_url("over-long URL", IMG + "?" + "a" * 5000, "url_too_long")

# refused: data URLs
NOT_B64 = [
    ("symbols", "!!!!"),
    ("inner space", b64(PNG)[:8] + " " + b64(PNG)[8:]),
    ("newline", b64(PNG)[:8] + "\n" + b64(PNG)[8:]),
    ("url-safe alphabet", b64(PNG).replace("+", "-").replace("/", "_")[:-4] + "-_-_"),
    ("missing padding", b64(PNG + b"\x00").rstrip("=")),
    ("data after padding", b64(PNG + b"\x00") + "QQ=="),
    ("padding in the middle", "iVBO=w0KGgo="),
    ("triple padding", b64(PNG)[:-4] + "Q==="),
    ("non-ASCII", b64(PNG)[:-4] + "\u00e9AAA"),
    ("percent-escaped", b64(PNG)[:-4] + "%2BAA"),
    ("fragment", b64(PNG) + "#x"),
]
for name, payload in NOT_B64:
    no_url(f"data URL not base64: {name}", "data:image/png;base64," + payload, "data_bad_base64")
no_url("data URL without base64", "data:image/png,iVBORw0KGgo=", "data_url_malformed")
no_url("data URL with a charset parameter", "data:image/png;charset=utf-8;base64," + b64(PNG), "data_url_malformed")
no_url("data URL with a name parameter", "data:image/png;name=a.png;base64," + b64(PNG), "data_url_malformed")
no_url("data URL with BASE64 upper case", "data:image/png;BASE64," + b64(PNG), "data_url_malformed")
no_url("data URL without a MIME type", "data:;base64," + b64(PNG), "data_url_malformed")
no_url("data URL with a space before the comma", "data:image/png;base64 ," + b64(PNG), "data_url_malformed")
no_url("data URL without a comma", "data:image/png;base64", "data_url_malformed")
no_url("data URL svg", "data:image/svg+xml;base64," + b64(b"<svg/>"), "data_mime_not_allowed")
no_url("data URL html", "data:text/html;base64," + b64(b"<html>"), "data_mime_not_allowed")
no_url("data URL video type in an image part", data_url("video/mp4", MP4), "data_mime_not_allowed")
no_url("data URL empty payload", "data:image/png;base64,", "data_empty")
no_url("magic: jpeg bytes declared png", data_url("image/png", JPEG), "data_magic_mismatch")
no_url("magic: png bytes declared gif", data_url("image/gif", PNG), "data_magic_mismatch")
no_url("magic: html declared jpeg", data_url("image/jpeg", b"<html><script>"), "data_magic_mismatch")
no(
    "magic: one bad frame in a JPEG sequence",
    "chat",
    chat(part("video_url", f"data:video/jpeg;base64,{b64(JPEG)},{b64(PNG)}")),
    "data_magic_mismatch",
    f"{P}.video_url.url",
)
no("magic: pdf document with png bytes", "messages", anth(a_b64("application/pdf", b64(PNG), "document")), "data_magic_mismatch", f"{P}.source.data")
no_url("item over the size limit", data_url("image/png", PNG + bytes(1025 - len(PNG))), "media_item_too_large", config="small")
no(
    "request over the total size limit",
    "chat",
    chat(img(data_url("image/png", PNG + bytes(900))), img(data_url("image/png", PNG + bytes(900)))),
    "media_request_too_large",
    "messages[0].content[2].image_url.url",
    config="small",
)
no("too many media items", "chat", chat(img(IMG), img(IMG), img(IMG), img(IMG)), "too_many_media_items", "messages[0].content[4].image_url.url", config="small")

# refused: shapes
for name, value in [("a number", 42), ("null", None), ("true", True), ("an empty object", {}), ("an object without url", {"URL": IMG})]:
    no(f"image_url given as {name}", "chat", chat({"type": "image_url", "image_url": value}), "malformed_media", f"{P}.image_url")
no("url given as a number", "chat", chat(img(7)), "malformed_media", f"{P}.image_url.url")
no("url given as a list", "chat", chat(img([IMG])), "malformed_media", f"{P}.image_url.url")
no("url and data both given", "chat", chat({"type": "image_url", "image_url": {"url": IMG, "data": D_PNG}}), "malformed_media", f"{P}.image_url")
no(
    "empty url beside a data path (lmdeploy falls back to data)",
    "chat",
    chat({"type": "image_url", "image_url": {"url": "", "data": "file:///etc/passwd"}}),
    "malformed_media",
    f"{P}.image_url",
)
no("type inside the media object", "chat", chat(part("image_url", IMG, type="video")), "unexpected_media_field", f"{P}.image_url.type")
no("processor knob not allowed", "chat", chat(part("image_url", IMG, max_pixels=10**9)), "unexpected_media_field", f"{P}.image_url.max_pixels")
no("allowed knob with an object value", "chat", chat(part("image_url", IMG, detail={"url": "file:///x"})), "malformed_media", f"{P}.image_url.detail")
no("bare string with a knob beside it", "chat", chat(bare("image_url", IMG, max_pixels=10**9)), "unexpected_media_field", f"{P}.max_pixels")
no("second url beside the media object", "chat", chat({**img(IMG), "url": "file:///etc/passwd"}), "unexpected_media_field", f"{P}.url")
no("media part without its value", "chat", chat({"type": "image_url"}), "malformed_media", P)
no("media part without a type", "chat", chat({"image_url": {"url": IMG}}), "malformed_content", P)
no("part type not a string", "chat", chat({"type": 5, "image_url": {"url": IMG}}), "malformed_content", P)
no("part not an object", "chat", chat("file:///etc/passwd"), "malformed_content", P)
no("content an object", "chat", chat_raw([{"role": "user", "content": {"type": "image_url", "image_url": IMG}}]), "malformed_content", "messages[0].content")
no("content a number", "chat", chat_raw([{"role": "user", "content": 3}]), "malformed_content", "messages[0].content")
no("messages an object", "chat", chat_raw({"role": "user", "content": [img("file:///etc/passwd")]}), "malformed_content", "messages")
no("message not an object", "chat", chat_raw(["file:///etc/passwd"]), "malformed_content", "messages[0]")
no("bad item in a later message", "chat", chat_raw([{"role": "user", "content": "a"}, {"role": "user", "content": [img(IMG), img(EVIL)]}]), "domain_not_allowed", "messages[1].content[1].image_url.url")
for t in ["input_audio", "file", "image_data", "IMAGE_URL", "Image_url", "input_image", "document", "foo", ""]:
    no(f"unknown chat part type {t!r}", "chat", chat({"type": t, t: {"url": IMG}}), "unknown_part_type", P)

# refused: top-level image_data
no("image_data file path", "chat", chat_raw([], image_data="file:///etc/passwd"), "url_scheme_not_allowed", "image_data")
no("image_data list with a bad second item", "chat", chat_raw([], image_data=[IMG, "/etc/passwd"]), "url_not_absolute", "image_data[1]")
no("image_data object with ftp", "chat", chat_raw([], image_data={"url": "ftp://images.example.com/a"}), "url_scheme_not_allowed", "image_data.url")
no("image_data a number", "chat", chat_raw([], image_data=42), "malformed_media", "image_data")
no("image_data nested list", "chat", chat_raw([], image_data=[[IMG]]), "malformed_media", "image_data[0]")
no("image_data on completions", "completions", completions(image_data="/etc/passwd"), "url_not_absolute", "image_data")
no("image_data on messages", "messages", anth(image_data={"url": EVIL}), "domain_not_allowed", "image_data.url")
no("image_data on count_tokens", "count_tokens", anth(image_data=["file:///etc/passwd"]), "url_scheme_not_allowed", "image_data[0]")

# refused: Anthropic
no("anthropic url source file", "messages", anth(a_url("file:///etc/passwd")), "url_scheme_not_allowed", f"{P}.source.url")
no("anthropic url source bare path", "messages", anth(a_url("/etc/passwd")), "url_not_absolute", f"{P}.source.url")
no("anthropic url source http", "messages", anth(a_url("http://images.example.com/a.png")), "http_not_allowed", f"{P}.source.url")
no("anthropic url source not a string", "messages", anth(a_url({"url": IMG})), "malformed_media", f"{P}.source.url")
no("anthropic base64 svg", "messages", anth(a_b64("image/svg+xml", b64(b"<svg/>"))), "data_mime_not_allowed", f"{P}.source.media_type")
no("anthropic base64 media_type with parameters", "messages", anth(a_b64("image/png;base64,AAAA", b64(PNG))), "data_mime_not_allowed", f"{P}.source.media_type")
no("anthropic base64 bad data", "messages", anth(a_b64("image/png", "not base64!")), "data_bad_base64", f"{P}.source.data")
no("anthropic base64 data URL in data", "messages", anth(a_b64("image/png", D_PNG)), "data_bad_base64", f"{P}.source.data")
no("anthropic base64 without media_type", "messages", anth({"type": "image", "source": {"type": "base64", "data": b64(PNG)}}), "malformed_media", f"{P}.source")
no("anthropic file source", "messages", anth({"type": "image", "source": {"type": "file", "file_id": "file_1"}}), "file_id_not_supported", f"{P}.source")
no("anthropic unknown source type", "messages", anth({"type": "image", "source": {"type": "path", "path": "/etc/passwd"}}), "malformed_media", f"{P}.source")
no("anthropic source missing", "messages", anth({"type": "image"}), "malformed_media", f"{P}.source")
no("anthropic source extra key", "messages", anth({"type": "image", "source": {"type": "url", "url": IMG, "path": "/etc/passwd"}}), "unexpected_media_field", f"{P}.source.path")
no("anthropic block extra url key", "messages", anth({**a_url(IMG), "url": "file:///etc/passwd"}), "unexpected_media_field", f"{P}.url")
no("anthropic tool_result image file", "messages", anth(tool_result({"type": "text", "text": "x"}, a_url("file:///etc/passwd"))), "url_scheme_not_allowed", f"{P}.content[1].source.url")
no("anthropic tool_result content object", "messages", anth({"type": "tool_result", "tool_use_id": "t", "content": a_url(EVIL)}), "malformed_content", f"{P}.content")
no("anthropic tool_result nested tool_result", "messages", anth(tool_result(tool_result(a_url(EVIL)))), "unknown_part_type", f"{P}.content[0]")
no("anthropic document url file", "messages", anth(a_url("file:///etc/passwd", "document")), "url_scheme_not_allowed", f"{P}.source.url")
no("anthropic document base64 html", "messages", anth(a_b64("text/html", b64(b"<html>"), "document")), "data_mime_not_allowed", f"{P}.source.media_type")
no("anthropic document text source html", "messages", anth({"type": "document", "source": {"type": "text", "media_type": "text/html", "data": "x"}}), "malformed_media", f"{P}.source")
no(
    "anthropic document content source with a bad image",
    "messages",
    anth({"type": "document", "source": {"type": "content", "content": [a_url("/etc/passwd")]}}),
    "url_not_absolute",
    f"{P}.source.content[0].source.url",
)
no("anthropic system image", "messages", anth(system=[{"type": "text", "text": "a"}, a_url(EVIL)]), "domain_not_allowed", "system[1].source.url")
no("anthropic unknown block type", "messages", anth({"type": "container_upload", "file_id": "f"}), "unknown_part_type", P)
no("anthropic chat-style part", "messages", anth(img(IMG)), "unknown_part_type", P)
no("anthropic content an object", "messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": a_url(EVIL)}]}, "malformed_content", "messages[0].content")
no("count_tokens bad url", "count_tokens", anth(a_url("gopher://images.example.com/")), "url_scheme_not_allowed", f"{P}.source.url")

# refused: Responses
no("responses input_image file", "responses", resp(r_img("file:///etc/passwd")), "url_scheme_not_allowed", f"{R}.image_url")
no("responses input_image file_id", "responses", resp({"type": "input_image", "file_id": "file-abc"}), "file_id_not_supported", f"{R}.file_id")
no("responses input_image url and file_id", "responses", resp(r_img(IMG, file_id="file-abc")), "file_id_not_supported", f"{R}.file_id")
no("responses input_image url object", "responses", resp(r_img({"url": IMG})), "malformed_media", f"{R}.image_url")
no("responses input_image nothing", "responses", resp({"type": "input_image", "detail": "auto"}), "malformed_media", R)
no("responses input_image extra url key", "responses", resp(r_img(IMG, url="file:///etc/passwd")), "unexpected_media_field", f"{R}.url")
no("responses input_file gopher", "responses", resp({"type": "input_file", "file_url": "gopher://docs.example.com/"}), "url_scheme_not_allowed", f"{R}.file_url")
no("responses input_file raw base64", "responses", resp({"type": "input_file", "file_data": b64(PDF)}), "data_url_malformed", f"{R}.file_data")
no("responses input_file html", "responses", resp({"type": "input_file", "file_data": data_url("text/html", b"<html>")}), "data_mime_not_allowed", f"{R}.file_data")
no("responses input_file file_id", "responses", resp({"type": "input_file", "file_id": "file-abc"}), "file_id_not_supported", f"{R}.file_id")
no(
    "responses input_file data and url",
    "responses",
    resp({"type": "input_file", "file_data": data_url("application/pdf", PDF), "file_url": "https://docs.example.com/a.pdf"}),
    "malformed_media",
    R,
)
no("responses unknown part type", "responses", resp({"type": "input_audio", "input_audio": {"data": "x"}}), "unknown_part_type", R)
no("responses chat-style part", "responses", resp(img(IMG)), "unknown_part_type", R)
no(
    "responses unknown item type",
    "responses",
    {"model": MODEL, "input": [{"type": "computer_call_output", "output": {"type": "computer_screenshot", "image_url": "file:///x"}}]},
    "unknown_input_item_type",
    "input[0]",
)
no(
    "responses function_call_output with a bad image",
    "responses",
    {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c", "output": [r_img(EVIL)]}]},
    "domain_not_allowed",
    "input[0].output[0].image_url",
)
no("responses input an object", "responses", {"model": MODEL, "input": {"role": "user", "content": [r_img(EVIL)]}}, "malformed_content", "input")
no("responses input item a string", "responses", {"model": MODEL, "input": ["hi"]}, "malformed_content", "input[0]")

# refused: per-key override and configurations
no("narrow key: gateway domain not on the key's list", "chat", chat(img(IMG)), "domain_not_allowed", f"{P}.image_url.url", key="narrow")
no("narrow key: http entry of the gateway", "chat", chat(img("http://legacy.example.com/a.png")), "domain_not_allowed", f"{P}.image_url.url", key="narrow")
no_url("no domains configured: https refused", IMG, "domain_not_allowed", config="default")
no_url("no domains configured: file refused", "file:///etc/passwd", "url_scheme_not_allowed", config="default")
no("image-only part types: video refused", "chat", chat(part("video_url", D_PNG)), "unknown_part_type", P, config="imageonly")
no("image-only part types: audio refused", "chat", chat(bare("audio", "https://images.example.com/a.wav")), "unknown_part_type", P, config="imageonly")
no("image-only part types: document refused", "messages", anth(a_url(IMG, "document")), "unknown_part_type", P, config="imageonly")
no("image-only part types: input_file refused", "responses", resp({"type": "input_file", "file_url": IMG}), "unknown_part_type", R, config="imageonly")


# refused: keys a part type does not define (issue 8.5), and what the drop mode forwards instead
TEXT_WITH_IMAGE = {"type": "text", "text": "look", "image_url": {"url": "file:///etc/passwd"}}
no("text part carrying an image_url object", "chat", chat_raw([{"role": "user", "content": [TEXT_WITH_IMAGE]}]), "unexpected_part_field", "messages[0].content[0].image_url")
no("text part carrying a bare image_url", "chat", chat_raw([{"role": "user", "content": [{"type": "text", "text": "x", "image_url": "x"}]}]), "unexpected_part_field", "messages[0].content[0].image_url")
no("refusal part with a url", "chat", chat_raw([{"role": "assistant", "content": [{"type": "refusal", "refusal": "no", "url": IMG}]}]), "unexpected_part_field", "messages[0].content[0].url")
no("text part with cache_control (chat)", "chat", chat({"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}), "unexpected_part_field", f"{P}.cache_control")
no("text part text an object", "chat", chat({"type": "text", "text": {"url": IMG}}), "malformed_content", f"{P}.text")
no("anthropic text block with a source", "messages", anth({"type": "text", "text": "x", "source": {"type": "url", "url": "/etc/passwd"}}), "unexpected_part_field", f"{P}.source")
no("anthropic tool_use with an image_url", "messages", anth({"type": "tool_use", "id": "t", "name": "f", "input": {}, "image_url": IMG}), "unexpected_part_field", f"{P}.image_url")
no("anthropic thinking with a url", "messages", anth({"type": "thinking", "thinking": "hm", "signature": "s", "url": IMG}), "unexpected_part_field", f"{P}.url")
no("anthropic tool_result with a source", "messages", anth({**tool_result(), "source": {"type": "url", "url": IMG}}), "unexpected_part_field", f"{P}.source")
no("anthropic text inside tool_result with an image_url", "messages", anth(tool_result({"type": "text", "text": "x", "image_url": IMG})), "unexpected_part_field", f"{P}.content[0].image_url")
no("anthropic system text block with a url", "messages", anth(system=[{"type": "text", "text": "a", "url": IMG}]), "unexpected_part_field", "system[0].url")
no("anthropic thinking signature a number", "messages", anth({"type": "thinking", "thinking": "hm", "signature": 5}), "malformed_content", f"{P}.signature")
no("responses input_text with an image_url", "responses", resp({"type": "input_text", "text": "x", "image_url": IMG}), "unexpected_part_field", f"{R}.image_url")
no("responses output_text with a file_url", "responses", {"model": MODEL, "input": [{"role": "assistant", "content": [{"type": "output_text", "text": "y", "file_url": IMG}]}]}, "unexpected_part_field", "input[0].content[0].file_url")
no("imageonly: unknown text-part key refused", "chat", chat({"type": "text", "text": "x", "video_url": IMG}), "unexpected_part_field", f"{P}.video_url", config="imageonly")
ok("drop: text part's image_url object removed", "chat", chat_raw([{"role": "user", "content": [TEXT_WITH_IMAGE]}]), at="messages[0].content[0]", canonical={"type": "text", "text": "look"}, config="lenient")
ok("drop: processor knob removed", "chat", chat(part("image_url", IMG, max_pixels=10**9)), at=f"{P}.image_url", canonical={"url": IMG}, config="lenient")
ok("drop: second url beside the media object removed", "chat", chat({**img(IMG), "url": "file:///etc/passwd"}), at=P, canonical=img(IMG), config="lenient")
ok("drop: anthropic block extra url key removed", "messages", anth({**a_url(IMG), "url": "file:///etc/passwd"}), at=P, canonical=a_url(IMG), config="lenient")
ok("drop: responses input_text extra key removed", "responses", resp({"type": "input_text", "text": "x", "image_url": IMG}), at=R, canonical={"type": "input_text", "text": "x"}, config="lenient")
no("drop mode still refuses a bad url", "chat", chat(img("file:///etc/passwd")), "url_scheme_not_allowed", f"{P}.image_url.url", config="lenient")
no("drop mode still refuses a non-string text", "chat", chat({"type": "text", "text": ["x"]}), "malformed_content", f"{P}.text", config="lenient")


# -- running the table ------------------------------------------------------------------------------------------------

_POLICIES: dict[str, MediaPolicy] = {}
NARROW_KEY = ApiKeyConfig(name="narrow", hash="sha256:" + "0" * 64, media_allowed_domains=tuple(NARROW_KEY_DOMAINS))


def policy_for(name: str) -> MediaPolicy:
    if name not in _POLICIES:
        _POLICIES[name] = MediaPolicy(media_config(name))
    return _POLICIES[name]


def context(route: str, body: dict[str, Any], key: ApiKeyConfig | None = None) -> RequestContext:
    ctx = RequestContext({}, ROUTES[("POST", ROUTE_PATHS[route])], {})
    ctx.body = body
    ctx.key = key
    return ctx


_STEP = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def value_at(body: Any, param: str) -> Any:
    """Follow a param path such as messages[0].content[1].image_url.url."""
    node = body
    for name, index in _STEP.findall(param):
        node = node[int(index)] if index else node[name]
    return node


def refused_count(reason: str) -> float:
    return REGISTRY.get_sample_value("gateway_media_refusals_total", {"reason": reason}) or 0.0


def test_table_is_large_and_covers_every_reason_but_the_network_ones():
    assert len(CASES) > 200
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
    covered = {c.expect for c in CASES}
    assert NETWORK_REASONS >= {"dns_failed", "dns_non_global"}  # those are covered by the DNS and fetch tests
    assert set(REASONS) - covered == NETWORK_REASONS
    assert sum(c.expect == "ok" for c in CASES) > 60


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_media_policy_table(case: Case):
    body = copy.deepcopy(case.body)
    ctx = context(case.route, body, NARROW_KEY if case.key == "narrow" else None)
    before = refused_count(case.expect)
    refusal = policy_for(case.config).check_body(ctx)
    if case.expect == "ok":
        assert refusal is None, f"refused: {refusal}"
        if case.canonical is not None:
            assert value_at(body, case.param) == case.canonical
        else:
            assert body == case.body, "an accepted body is forwarded unchanged unless a case was normalised"
        return
    assert refusal is not None, "expected a refusal"
    assert (refusal.status, refusal.reason, refusal.param) == (400, case.expect, case.param), refusal.message
    assert case.param in refusal.message
    assert refused_count(case.expect) == before + 1
    offending = value_at(case.body, case.param) if _resolvable(case.body, case.param) else None
    if isinstance(offending, str) and len(offending) > 12 and not case.param.endswith("media_type"):
        assert offending not in refusal.message, "the refused URL must not be echoed back"


def _resolvable(body: Any, param: str) -> bool:
    try:
        value_at(body, param)
        return True
    except (KeyError, IndexError, TypeError):
        return False


# -- pieces, one rule at a time ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, host, expected",
    [
        ("*.cdn.example.org", "a.cdn.example.org", True),
        ("*.cdn.example.org", "a.b.cdn.example.org", True),
        ("*.cdn.example.org", "cdn.example.org", False),
        ("*.cdn.example.org", "evilcdn.example.org", False),
        ("*.cdn.example.org", "cdn.example.org.evil.com", False),
        ("*.cdn.example.org", "a.cdn.example.org.evil.com", False),
        ("images.example.com", "images.example.com", True),
        ("images.example.com", "a.images.example.com", False),
        ("images.example.com", "images.example.co", False),
        ("IMAGES.Example.com", "images.example.com", True),
    ],
)
def test_domain_entry_matching(entry: str, host: str, expected: bool):
    url = parse_media_url(f"https://{host}/x")
    assert (DomainSet([parse_domain_entry(entry)]).decide(url) is None) == expected


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("images.example.com", "images.example.com"),
        ("Images.Example.COM", "images.example.com"),
        ("*.cdn.example.org", "*.cdn.example.org"),
        ("images.example.com:8443", "images.example.com:8443"),
        ("http://legacy.example.com", "http://legacy.example.com"),
        ("HTTPS://images.example.com", "images.example.com"),
        ("http://*.legacy.example.com:8080", "http://*.legacy.example.com:8080"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("minio", "minio"),
    ],
)
def test_domain_entry_accepted(text: str, canonical: str):
    assert str(parse_domain_entry(text)) == canonical


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "non-empty"),
        ("*", "wildcard"),
        ("*.com", "top-level"),
        ("a.*.example.com", "wildcard"),
        ("images.*", "wildcard"),
        ("1.2.3.4", "IP address"),
        ("[::1]", "IP address"),
        ("0x7f.1", "IP address"),
        ("images.example.com.", "ends in a dot"),
        ("ftp://images.example.com", "scheme"),
        ("images.example.com/path", "host name only"),
        ("user@images.example.com", "host name only"),
        ("images.example.com:0", "port"),
        ("images.example.com:99999", "port"),
        ("images.example.com:", "port"),
        ("bücher.example", "punycode"),
        (" images.example.com", "whitespace"),
        ("images_x.example.com", "DNS name"),
    ],
)
def test_domain_entry_refused(text: str, why: str):
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_domain_entry(text)


def test_parser_returns_the_parts_it_checked():
    u = parse_media_url("HTTPS://Media.Example.NET:8443/A/b.png?Q=1")
    assert u == ("https", "media.example.net", 8443, "https://media.example.net:8443/A/b.png?Q=1")
    same = "https://images.example.com/a.png"
    assert parse_media_url(same).canonical is same


def test_refusal_shapes_follow_the_route_style():
    ctx = context("messages", anth(a_url(EVIL)))
    refusal = policy_for("main").check_body(ctx)
    body = refusal.body("anthropic")
    assert b'"invalid_request_error"' in body and b"messages[0].content[1].source.url" in body
    ctx = context("chat", chat(img(EVIL)))
    refusal = policy_for("main").check_body(ctx)
    assert b'"param":"messages[0].content[1].image_url.url"' in refusal.body("openai")
    assert b'"code":"domain_not_allowed"' in refusal.body("openai")


def test_secret_query_is_never_in_the_message():
    secret = "X-Amz-Signature=deadbeefcafe0123456789"
    for url in (f"https://evil.example.com/a.png?{secret}", f"file:///etc/passwd?{secret}", f"https://images.example.com/a b?{secret}"):
        refusal = policy_for("main").check_body(context("chat", chat(img(url))))
        assert refusal is not None and "deadbeef" not in refusal.message


def test_text_only_body_is_not_walked_or_copied():
    body = chat_raw([{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}])
    snapshot = copy.deepcopy(body)
    messages = body["messages"]
    assert policy_for("main").check_body(context("chat", body)) is None
    assert body == snapshot and body["messages"] is messages


def test_key_without_override_uses_the_gateway_list():
    key = ApiKeyConfig(name="plain", hash="sha256:" + "1" * 64)
    assert policy_for("main").check_body(context("chat", chat(img(IMG)), key)) is None


def test_key_override_may_be_empty_meaning_data_only():
    key = ApiKeyConfig(name="inline-only", hash="sha256:" + "2" * 64, media_allowed_domains=())
    policy = policy_for("main")
    assert policy.check_body(context("chat", chat(img(D_PNG)), key)) is None
    assert policy.check_body(context("chat", chat(img(IMG)), key)).reason == "domain_not_allowed"


def test_policy_refuses_a_malformed_entry_at_start_up():
    with pytest.raises(ValueError):
        MediaPolicy(MediaConfig(allowed_domains=("*.com",)))


# -- configuration ------------------------------------------------------------------------------------------------------


def _problems(media: dict[str, Any], keys: list[dict[str, Any]] | None = None) -> list[str]:
    auth = {"keys": keys or [{"name": "k", "hash": "sha256:" + "a" * 64}]}
    try:
        parse_config({"auth": auth, "backends": [{"url": "http://127.0.0.1:1"}], "media": media})
    except ConfigError as exc:
        return exc.problems
    return []


def test_config_defaults_allow_only_data_urls():
    cfg = media_config("default")
    assert cfg.allowed_domains == () and cfg.max_item_bytes == 20 * 1024 * 1024 and cfg.check_magic and not cfg.resolve_dns
    assert cfg.unknown_part_keys == "refuse" and cfg.fetch == "backend"
    assert cfg.mimes("image") == ("image/png", "image/jpeg", "image/webp", "image/gif")


def test_config_reads_every_field():
    cfg = media_config("main")
    assert cfg.allowed_domains[:2] == ("images.example.com", "*.cdn.example.org")
    assert [str(e) for e in cfg.entries][3] == "http://legacy.example.com"
    assert cfg.check_magic and "video/jpeg" in cfg.mimes("video")
    assert media_config("small").max_items == 3


@pytest.mark.parametrize(
    "media, fragment",
    [
        ({"allowed_domains": ["images.example.com", "*.com"]}, "media.allowed_domains[1]: '*.com' is not a valid domain entry"),
        ({"allowed_domains": ["1.2.3.4"]}, "media.allowed_domains[0]: '1.2.3.4' is not a valid domain entry: the host is an IP address"),
        ({"allowed_domains": ["a.example.com", "A.example.com"]}, "media.allowed_domains[1]: 'A.example.com' is listed twice"),
        ({"part_types": ["text", "image_urls"]}, "media.part_types[1]: 'image_urls' is not a known content part type (did you mean 'image_url'?); choose from: text,"),
        ({"mime_types": {"image": ["png"]}}, "media.mime_types.image[0]: 'png' is not a MIME type"),
        ({"mime_types": {"images": ["image/png"]}}, "media.mime_types.images: unknown field (did you mean 'image'?)"),
        ({"check_magic": True, "mime_types": {"image": ["image/x-icon"]}}, "media.mime_types.image[0]: 'image/x-icon' has no known magic-byte signature"),
        ({"item_params": {"image": ["url"]}}, "media.item_params.image[0]: 'url' names the media itself"),
        ({"max_item_bytes": 0}, "media.max_item_bytes: 0 is out of range"),
        ({"max_item_bytes": 100, "max_request_bytes": 10}, "media.max_request_bytes: 10 is smaller than max_item_bytes"),
        ({"resolve_dns": "yes"}, "media.resolve_dns: expected true or false"),
        ({"unknown_part_keys": "ignore"}, "media.unknown_part_keys: 'ignore' is not a valid choice; choose one of: refuse, drop"),
        ({"fetch": "inlined"}, "media.fetch: 'inlined' is not a valid choice; choose one of: backend, inline (did you mean 'inline'?)"),
        ({"fetch_timeout": 0}, "media.fetch_timeout: 0"),
        ({"fetch_max_redirects": 11}, "media.fetch_max_redirects: 11 is out of range"),
        ({"fetch_concurrency": 0}, "media.fetch_concurrency: 0 is out of range"),
        (
            {"check_magic": False, "fetch": "inline", "mime_types": {"image": ["image/x-icon"]}},
            "media.mime_types.image[0]: 'image/x-icon' has no known magic-byte signature for image, so fetch: inline cannot verify it",
        ),
        ({"allowed_domain": ["x.example.com"]}, "media.allowed_domain: unknown field (did you mean 'allowed_domains'?)"),
    ],
)
def test_config_problems_name_field_value_and_choices(media: dict[str, Any], fragment: str):
    problems = _problems(media)
    assert any(fragment in p for p in problems), problems


def test_config_stores_parsed_domain_sets_for_the_gateway_and_every_key():
    cfg = parse_config(
        {
            "auth": {"keys": [{"name": "k", "hash": "sha256:" + "a" * 64, "media_allowed_domains": ["Narrow.Example.com", "*.cdn.example.org"]}]},
            "backends": [{"url": "http://127.0.0.1:1"}],
            "media": {"allowed_domains": ["images.example.com"]},
        }
    )
    key = cfg.auth.keys[0]
    assert isinstance(key.media_domains, DomainSet) and key.media_allowed_domains == ("narrow.example.com", "*.cdn.example.org")
    assert isinstance(cfg.media.domains, DomainSet) and cfg.media.domains.texts == ("images.example.com",)
    policy = MediaPolicy(cfg.media)
    ctx = context("chat", chat(img(IMG)), key)
    assert policy.domains_for(ctx) is key.media_domains, "the key's parsed set is used as is, never re-parsed per request"
    assert policy.check_body(ctx).reason == "domain_not_allowed"
    assert policy.check_body(context("chat", chat(img("https://narrow.example.com/a.png")), key)) is None


def test_a_stored_key_record_carries_the_domain_texts_and_reads_back_parsed():
    import yaml

    from gateway.state.keys import key_from_record, key_to_record

    key = ApiKeyConfig(name="k", hash="sha256:" + "4" * 64, media_allowed_domains=("narrow.example.com", "*.cdn.example.org"))
    record = key_to_record(key)
    assert record["media_allowed_domains"] == ["narrow.example.com", "*.cdn.example.org"] and "media_domains" not in record
    back = key_from_record(yaml.safe_load(yaml.safe_dump(record)))
    assert back == key and back.media_domains == key.media_domains and isinstance(back.media_domains, DomainSet)


def test_a_key_built_in_code_with_a_bad_entry_fails_loudly():
    with pytest.raises(ValueError, match="not a number from 1 to 65535"):
        ApiKeyConfig(name="x", hash="sha256:" + "3" * 64, media_allowed_domains=("images.example.com:0",))


def test_config_checks_each_keys_media_domains():
    keys = [
        {"name": "ok", "hash": "sha256:" + "a" * 64, "media_allowed_domains": ["images.example.com"]},
        {"name": "bad", "hash": "sha256:" + "b" * 64, "media_allowed_domains": ["images.example.com", "file:///etc"]},
    ]
    problems = _problems({}, keys)
    assert len(problems) == 1
    assert problems[0].startswith("auth.keys[1].media_allowed_domains[1]: 'file:///etc' (key 'bad') is not a valid domain entry")


# -- the optional DNS check -------------------------------------------------------------------------------------------------


def _dns_policy(answers: dict[str, list[str] | Exception]) -> MediaPolicy:
    async def resolver(host: str, port: int) -> list[str]:
        answer = answers[host]
        if isinstance(answer, Exception):
            raise answer
        return answer

    cfg = MediaConfig(allowed_domains=("images.example.com", "*.cdn.example.org"), resolve_dns=True)
    return MediaPolicy(cfg, resolver=resolver)


@pytest.mark.parametrize(
    "addresses, reason",
    [
        (["93.184.216.34"], None),
        (["2606:2800:220:1:248:1893:25c8:1946"], None),
        (["93.184.216.34", "10.0.0.5"], "dns_non_global"),
        (["127.0.0.1"], "dns_non_global"),
        (["169.254.169.254"], "dns_non_global"),
        (["::1"], "dns_non_global"),
        (["::ffff:127.0.0.1"], "dns_non_global"),
        (["fe80::1%eth0"], "dns_non_global"),
        (["64:ff9b::a00:1"], "dns_non_global"),
        (["2002:7f00:1::1"], "dns_non_global"),
        (["100.64.0.1"], "dns_non_global"),
        (["224.0.0.1"], "dns_non_global"),
        ([], "dns_failed"),
        (OSError("no such host"), "dns_failed"),
    ],
)
def test_dns_check_refuses_non_global_answers(addresses, reason):
    policy = _dns_policy({"images.example.com": addresses, "a.cdn.example.org": ["93.184.216.34"]})
    assert policy.is_async
    ctx = context("chat", chat(img("https://a.cdn.example.org/x.png"), img(IMG)))
    refusal = asyncio.run(policy.check_body_async(ctx))
    if reason is None:
        assert refusal is None
    else:
        assert (refusal.reason, refusal.param) == (reason, "messages[0].content[2].image_url.url")


def test_dns_check_is_skipped_for_data_urls_and_when_off():
    policy = _dns_policy({})
    assert asyncio.run(policy.check_body_async(context("chat", chat(img(D_PNG))))) is None
    off = MediaPolicy(MediaConfig(allowed_domains=("images.example.com",)))
    assert not off.is_async
    assert asyncio.run(off.check_body_async(context("chat", chat(img(IMG))))) is None


def test_global_address_helper():
    assert is_global_address("8.8.8.8") and not is_global_address("not an ip") and not is_global_address("192.168.1.1")


def test_refused_carries_reason_strings_only():
    assert all(re.fullmatch(r"[a-z0-9_]+", r) for r in REASONS)
    with pytest.raises(MediaRefused) as exc:
        parse_media_url("file:///etc/passwd")
    assert exc.value.reason == "url_scheme_not_allowed" and "passwd" not in exc.value.why


def test_media_package_imports_nothing_above_it():
    """gateway/media/ is a lower layer: config stores its parsed forms and the filter applies them."""
    import ast
    from pathlib import Path

    import gateway.media

    root = Path(gateway.media.__file__).parent
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and id(node) not in guarded:
                relative_up = node.level > 1
                absolute_gateway = node.level == 0 and (node.module or "").startswith("gateway") and not (node.module or "").startswith("gateway.media")
                assert not relative_up and not absolute_gateway, f"{path.name} imports {'.' * node.level}{node.module}"
