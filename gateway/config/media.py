"""The ``media:`` section: which media a request may carry, and from where.

Schema (every field optional; the defaults let only ``data:`` URLs through)::

    media:
      allowed_domains:            # hosts media URLs may name; empty: data: URLs only
        - images.example.com      # exact host, https, default port (443)
        - "*.cdn.example.org"     # any subdomain of cdn.example.org (not cdn.example.org itself)
        - media.example.net:8443  # exact host on that port only
        - http://legacy.example.com   # also allows plain http (port 80) for this host
      part_types: [text, image_url, ...]   # content part types let through (default: all known)
      mime_types:                 # data: URL / base64 MIME types allowed, per media kind
        image: [image/png, image/jpeg, image/webp, image/gif]
        video: [video/mp4, video/webm]
        audio: [audio/wav, audio/mpeg, audio/ogg, audio/flac]
        time_series: [application/octet-stream]   # a .npy array, as lmdeploy's docs send it
        document: [application/pdf]
      item_params:                # keys besides url/data a media item may carry (processor knobs)
        image: [detail]
        time_series: [sampling_rate]
      max_item_bytes: 20971520    # decoded size of one base64 item (20 MiB)
      max_request_bytes: 67108864 # decoded size of all base64 items in one request (64 MiB)
      max_items: 64               # media items (URLs and base64) in one request
      max_url_length: 4096
      check_magic: false          # also require the decoded bytes to start with the MIME type's signature
      resolve_dns: false          # resolve allowed hosts, refuse any non-global address (listener awaits check_body_async)
      dns_timeout: 2.0

A domain entry is ``[http://|https://]host[:port]`` or ``[http://|https://]*.host[:port]``. The host is
an ASCII DNS name (an internationalised name is written in punycode, ``xn--...``), lower-cased when
read; IP addresses are never entries. ``*.`` matches one or more labels in front of the suffix and never
the suffix itself, and the suffix needs at least two labels (``*.com`` is refused). Without a
port the entry allows the scheme's default port; with one, only that port. ``http://`` allows plain
http as well as https for that entry; every other entry is https only.

An API key's ``media_allowed_domains`` replaces the gateway's list for that key (use it to narrow
what one tenant may fetch); its entries use the same syntax and are checked here.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from .core import AuthConfig
from .fields import Section, did_you_mean

MIB = 1024 * 1024

MEDIA_KINDS = ("image", "video", "audio", "time_series", "document")

# Content part types the policy knows how to check, by request family. Text-like types pass
# untouched; every other known type is media and goes through the URL / base64 rules.
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


def _riff(form: bytes) -> Callable[[bytes], bool]:
    return lambda b: b[:4] == b"RIFF" and b[8:12] == form


def _prefix(*heads: bytes) -> Callable[[bytes], bool]:
    return lambda b: b.startswith(heads)


def _ftyp(b: bytes) -> bool:
    return b[4:8] == b"ftyp"


def _mpeg_audio(b: bytes) -> bool:
    return b.startswith(b"ID3") or (len(b) > 1 and b[0] == 0xFF and b[1] & 0xE0 == 0xE0)


# Magic-byte signatures by (kind, MIME type); the decoded item must start with one when check_magic is on.
SIGNATURES: dict[tuple[str, str], Callable[[bytes], bool]] = {
    ("image", "image/png"): _prefix(b"\x89PNG\r\n\x1a\n"),
    ("image", "image/jpeg"): _prefix(b"\xff\xd8\xff"),
    ("image", "image/gif"): _prefix(b"GIF87a", b"GIF89a"),
    ("image", "image/webp"): _riff(b"WEBP"),
    ("image", "image/bmp"): _prefix(b"BM"),
    ("image", "image/tiff"): _prefix(b"II*\x00", b"MM\x00*"),
    ("video", "video/mp4"): _ftyp,
    ("video", "video/quicktime"): _ftyp,
    ("video", "video/webm"): _prefix(b"\x1a\x45\xdf\xa3"),
    ("video", "video/jpeg"): _prefix(b"\xff\xd8\xff"),  # lmdeploy: comma-separated base64 JPEG frames
    ("audio", "audio/wav"): _riff(b"WAVE"),
    ("audio", "audio/x-wav"): _riff(b"WAVE"),
    ("audio", "audio/wave"): _riff(b"WAVE"),
    ("audio", "audio/mpeg"): _mpeg_audio,
    ("audio", "audio/ogg"): _prefix(b"OggS"),
    ("audio", "audio/flac"): _prefix(b"fLaC"),
    ("audio", "audio/mp4"): _ftyp,
    ("time_series", "application/octet-stream"): _prefix(b"\x93NUMPY"),
    ("time_series", "application/x-npy"): _prefix(b"\x93NUMPY"),
    ("document", "application/pdf"): _prefix(b"%PDF-"),
}

# MIME types whose payload lmdeploy reads as a comma-separated list of base64 frames.
FRAME_SEQUENCE_MIMES = frozenset({("video", "video/jpeg")})

_MIME = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,63}\Z")
_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")


# -- host names: the one grammar both domain entries and media URLs use -------------------------

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOSTNAME = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}\Z")
# WHATWG URL parsers read a host whose last label is a number (decimal, octal or 0x-hex) as IPv4.
_NUMERIC_LABEL = re.compile(r"(?:[0-9]+|0x[0-9a-f]*)\Z")


def _is_ip_literal(host: str) -> bool:
    """A second opinion from the standard library: any spelling it reads as an address."""
    if ":" in host or host[-1:].isdigit():  # ipaddress is slow to say no; only these could be a yes
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            pass
    try:
        socket.inet_aton(host)  # accepts the legacy forms too: 127.1, 0x7f.1, 017700000001
        return True
    except (OSError, ValueError):
        return False


def check_host(host: str) -> tuple[str, str] | None:
    """``(reason, what is wrong)`` when ``host`` (lower-case ASCII, no port) is not a plain DNS name.

    The second item completes the sentence "the host ..." in a refusal or a config problem.
    """
    if not host:
        return "url_bad_host", "is missing"
    if "%" in host:
        return "url_bad_host", "contains percent-encoded bytes; write the host name plainly"
    if "[" in host or "]" in host:
        return "url_ip_literal", "is an IP address; media must come from a named host"
    if host.endswith("."):
        return "url_host_trailing_dot", "ends in a dot; remove the trailing dot"
    if len(host) > 253:
        return "url_bad_host", "is longer than 253 characters"
    if _NUMERIC_LABEL.match(host.rpartition(".")[2]) or _is_ip_literal(host):
        return "url_ip_literal", "is an IP address; media must come from a named host"
    if not _HOSTNAME.match(host):
        return "url_bad_host", "is not a valid DNS name (dot-separated labels of letters, digits and inner hyphens)"
    return None


# -- domain entries ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DomainEntry:
    """One allow rule: an exact host or a ``*.`` suffix, an optional port, and whether http is allowed."""

    host: str  # lower-case; for a wildcard, the suffix after "*."
    wildcard: bool = False
    port: int | None = None  # None: the scheme's default port only
    allow_http: bool = False

    def __str__(self) -> str:
        scheme = "http://" if self.allow_http else ""
        star = "*." if self.wildcard else ""
        port = f":{self.port}" if self.port is not None else ""
        return f"{scheme}{star}{self.host}{port}"


_ENTRY_HELP = "use a host (images.example.com), a wildcard (*.cdn.example.org), optionally with :port, or http://host to also allow http"


def parse_domain_entry(text: str) -> DomainEntry:
    """Parse one allow-list entry; ValueError says what is wrong in plain words."""
    if not isinstance(text, str) or not text:
        raise ValueError("an entry must be a non-empty string")
    if not text.isascii():
        raise ValueError("contains non-ASCII characters; write an internationalised name in punycode (xn--...)")
    if any(c <= " " or c == "\x7f" for c in text):
        raise ValueError("contains whitespace or a control character")
    rest = text.lower()
    if "[" in rest or "]" in rest:
        raise ValueError("the host is an IP address; media must come from a named host")
    allow_http = False
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme not in ("http", "https"):
            raise ValueError(f"scheme {scheme!r} is not allowed; only http:// or https:// may prefix an entry")
        allow_http = scheme == "http"
    if any(c in rest for c in "/?#@\\"):
        raise ValueError("must be a host name only, with no path, query, fragment or user info")
    port = None
    if ":" in rest:
        rest, port_text = rest.rsplit(":", 1)
        if not re.fullmatch(r"[1-9][0-9]{0,4}", port_text) or int(port_text) > 65535:
            raise ValueError(f"port {port_text!r} is not a number from 1 to 65535")
        port = int(port_text)
    wildcard = rest.startswith("*.")
    if wildcard:
        rest = rest[2:]
    if "*" in rest:
        raise ValueError("a wildcard is only allowed as a whole leading label, as in *.cdn.example.org")
    if wildcard and "." not in rest:
        raise ValueError("a wildcard must keep at least two labels after '*.' (*.example.com), never a whole top-level domain")
    problem = check_host(rest)
    if problem is not None:
        raise ValueError(f"the host {problem[1]}")
    return DomainEntry(host=rest, wildcard=wildcard, port=port, allow_http=allow_http)


# -- the section -----------------------------------------------------------------------------------


def _pairs(mapping: Mapping[str, Iterable[str]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((k, tuple(v)) for k, v in mapping.items())


@dataclass(frozen=True)
class MediaConfig:
    allowed_domains: tuple[str, ...] = ()  # entries in their canonical text form; see the module docstring
    part_types: tuple[str, ...] = KNOWN_PART_TYPES
    mime_types: tuple[tuple[str, tuple[str, ...]], ...] = field(default_factory=lambda: _pairs(DEFAULT_MIME_TYPES))
    item_params: tuple[tuple[str, tuple[str, ...]], ...] = field(default_factory=lambda: _pairs(DEFAULT_ITEM_PARAMS))
    max_item_bytes: int = 20 * MIB
    max_request_bytes: int = 64 * MIB
    max_items: int = 64
    max_url_length: int = 4096
    check_magic: bool = False
    resolve_dns: bool = False
    dns_timeout: float = 2.0

    @property
    def entries(self) -> tuple[DomainEntry, ...]:
        return tuple(parse_domain_entry(e) for e in self.allowed_domains)

    def mimes(self, kind: str) -> tuple[str, ...]:
        return dict(self.mime_types).get(kind, ())

    def params(self, kind: str) -> tuple[str, ...]:
        return dict(self.item_params).get(kind, ())


def read_domain_entries(values: list[str], where: Callable[[int], str], s: Section, owner: str = "") -> tuple[str, ...]:
    out: list[str] = []
    for j, value in enumerate(values):
        try:
            entry = str(parse_domain_entry(value))
        except ValueError as exc:
            s.problems.add(where(j), f"{value!r}{owner} is not a valid domain entry: {exc}; {_ENTRY_HELP}")
            continue
        if entry in out:
            s.problems.add(where(j), f"{value!r}{owner} is listed twice")
            continue
        out.append(entry)
    return tuple(out)


def _read_kind_lists(
    s: Section, defaults: Mapping[str, tuple[str, ...]], check: Callable[[str, str, str], str | None]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    out: dict[str, tuple[str, ...]] = {}
    for kind in MEDIA_KINDS:
        values = s.str_list(kind, defaults[kind])
        kept: list[str] = []
        for j, value in enumerate(values):
            norm, problem = value.strip(), check(kind, value.strip(), value)
            if problem is not None:
                s.problems.add(f"{s.where(kind)}[{j}]", problem)
            elif norm not in kept:
                kept.append(norm)
        out[kind] = tuple(kept)
    s.finish()
    return _pairs(out)


def read_media(s: Section, auth: AuthConfig) -> MediaConfig:
    d = MediaConfig()
    domains = read_domain_entries(s.str_list("allowed_domains", ()), lambda j: f"{s.where('allowed_domains')}[{j}]", s)

    part_types: list[str] = []
    for j, value in enumerate(s.str_list("part_types", d.part_types)):
        if value not in KNOWN_PART_TYPES:
            s.problems.add(
                f"{s.where('part_types')}[{j}]",
                f"{value!r} is not a known content part type{did_you_mean(value, KNOWN_PART_TYPES)}; "
                f"choose from: {', '.join(KNOWN_PART_TYPES)}",
            )
        elif value not in part_types:
            part_types.append(value)

    check_magic = s.bool("check_magic", d.check_magic)

    def mime_problem(kind: str, norm: str, raw: str) -> str | None:
        if not _MIME.match(norm):
            return f"{raw!r} is not a MIME type; write it as type/subtype in lower case, e.g. {DEFAULT_MIME_TYPES[kind][0]}"
        if check_magic and (kind, norm) not in SIGNATURES:
            known = ", ".join(m for k, m in SIGNATURES if k == kind)
            return (
                f"{raw!r} has no known magic-byte signature for {kind}, so check_magic cannot verify it; "
                f"choose from: {known} (or turn check_magic off)"
            )
        return None

    def param_problem(kind: str, norm: str, raw: str) -> str | None:
        if not _PARAM.match(norm):
            return f"{raw!r} is not a valid field name (letters, digits and underscores)"
        if norm in RESERVED_PARAMS:
            return f"{raw!r} names the media itself and cannot be a processor parameter; reserved: {', '.join(sorted(RESERVED_PARAMS))}"
        return None

    mime_types = _read_kind_lists(s.section("mime_types"), DEFAULT_MIME_TYPES, mime_problem)
    item_params = _read_kind_lists(s.section("item_params"), DEFAULT_ITEM_PARAMS, param_problem)

    max_item = s.int("max_item_bytes", d.max_item_bytes, min=1, max=1 << 34)
    max_request = s.int("max_request_bytes", d.max_request_bytes, min=1, max=1 << 36)
    if max_request < max_item:
        s.error("max_request_bytes", f"{max_request} is smaller than max_item_bytes ({max_item}); a single item could never pass")
    cfg = MediaConfig(
        allowed_domains=domains,
        part_types=tuple(part_types),
        mime_types=mime_types,
        item_params=item_params,
        max_item_bytes=max_item,
        max_request_bytes=max_request,
        max_items=s.int("max_items", d.max_items, min=1, max=100_000),
        max_url_length=s.int("max_url_length", d.max_url_length, min=32, max=65536),
        check_magic=check_magic,
        resolve_dns=s.bool("resolve_dns", d.resolve_dns),
        dns_timeout=s.number("dns_timeout", d.dns_timeout, min=0, max=60, exclusive=True),
    )
    s.finish()

    for i, key in enumerate(auth.keys):
        if key.media_allowed_domains is None:
            continue
        read_domain_entries(
            list(key.media_allowed_domains),
            lambda j, i=i: f"auth.keys[{i}].media_allowed_domains[{j}]",
            s,
            owner=f" (key {key.name!r})",
        )
    return cfg
