"""The ``media:`` section: which media a request may carry, and from where.

Schema (every field optional; the defaults let only ``data:`` URLs through)::

    media:
      allowed_domains:            # hosts media URLs may name; empty: data: URLs only
        - images.example.com      # exact host, https, default port (443)
        - "*.cdn.example.org"     # any subdomain of cdn.example.org (not cdn.example.org itself)
        - media.example.net:8443  # exact host on that port only
        - http://legacy.example.com   # also allows plain http (port 80) for this host
      part_types: [text, image_url, ...]   # content part types let through (default: all known)
      unknown_part_keys: refuse   # a key a part type does not define: refuse (400) | drop (removed before forwarding)
      mime_types:                 # data: URL / base64 MIME types allowed, per media kind
        image: [image/png, image/jpeg, image/webp, image/gif]
        video: [video/mp4, video/webm]
        audio: [audio/wav, audio/mpeg, audio/ogg, audio/flac]
        time_series: [application/octet-stream]   # a .npy array, as lmdeploy's docs send it
        document: [application/pdf]
      item_params:                # keys besides url/data a media item may carry (processor knobs)
        image: [detail]
        time_series: [sampling_rate]
      max_item_bytes: 20971520    # decoded size of one item, base64 or fetched (20 MiB)
      max_request_bytes: 67108864 # decoded size of all items in one request (64 MiB)
      max_items: 64               # media items (URLs and base64) in one request
      max_url_length: 4096
      check_magic: true           # the decoded bytes must start with the MIME type's signature
      resolve_dns: false          # resolve allowed hosts, refuse any non-global address (fetch: backend)
      dns_timeout: 2.0
      fetch: backend              # backend: URLs are forwarded and the backend fetches them
                                  # inline: the gateway fetches them (pinned, checked address) and forwards data: URLs
      fetch_timeout: 10.0         # seconds for one item, redirects included
      fetch_max_redirects: 3      # each target re-checked against the allow-list
      fetch_concurrency: 8        # fetches in flight across the gateway

Domain entries are described in ``gateway/media/url.py``. An API key's ``media_allowed_domains``
replaces the gateway's list for that key (use it to narrow what one tenant may fetch); it is parsed
with the same grammar when the key is read (``config/core.py``) and stored as a ``DomainSet``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from ..media.parts import DEFAULT_ITEM_PARAMS, DEFAULT_MIME_TYPES, KNOWN_PART_TYPES, MEDIA_KINDS, RESERVED_PARAMS
from ..media.signatures import SIGNATURES
from ..media.url import DomainEntry, DomainSet, read_domain_list
from .fields import Section, did_you_mean

__all__ = ["FETCH_MODES", "UNKNOWN_PART_KEYS", "MediaConfig", "read_domain_set", "read_media"]

MIB = 1024 * 1024
UNKNOWN_PART_KEYS = ("refuse", "drop")
FETCH_MODES = ("backend", "inline")

_MIME = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,63}\Z")
_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")


def _pairs(mapping: Mapping[str, Iterable[str]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((k, tuple(v)) for k, v in mapping.items())


@dataclass(frozen=True)
class MediaConfig:
    allowed_domains: tuple[str, ...] = ()  # entries in their canonical text form
    part_types: tuple[str, ...] = KNOWN_PART_TYPES
    unknown_part_keys: str = "refuse"
    mime_types: tuple[tuple[str, tuple[str, ...]], ...] = field(default_factory=lambda: _pairs(DEFAULT_MIME_TYPES))
    item_params: tuple[tuple[str, tuple[str, ...]], ...] = field(default_factory=lambda: _pairs(DEFAULT_ITEM_PARAMS))
    max_item_bytes: int = 20 * MIB
    max_request_bytes: int = 64 * MIB
    max_items: int = 64
    max_url_length: int = 4096
    check_magic: bool = True
    resolve_dns: bool = False
    dns_timeout: float = 2.0
    fetch: str = "backend"
    fetch_timeout: float = 10.0
    fetch_max_redirects: int = 3
    fetch_concurrency: int = 8
    # The parsed allow-list, built from allowed_domains once (a bad entry raises ValueError here).
    domains: DomainSet = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.domains is None:
            object.__setattr__(self, "domains", DomainSet.parse(self.allowed_domains))

    @property
    def entries(self) -> tuple[DomainEntry, ...]:
        return self.domains.entries

    def mimes(self, kind: str) -> tuple[str, ...]:
        return dict(self.mime_types).get(kind, ())

    def params(self, kind: str) -> tuple[str, ...]:
        return dict(self.item_params).get(kind, ())


def read_domain_set(values: list[str], where: Callable[[int], str], s: Section, owner: str = "") -> DomainSet:
    """A configured domain list, parsed once; every bad entry becomes a problem naming its place."""
    domains, problems = read_domain_list(values, owner)
    for j, message in problems:
        s.problems.add(where(j), message)
    return domains


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


def read_media(s: Section) -> MediaConfig:
    d = MediaConfig()
    domains = read_domain_set(s.str_list("allowed_domains", ()), lambda j: f"{s.where('allowed_domains')}[{j}]", s)

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
    fetch = s.enum("fetch", FETCH_MODES, d.fetch)
    # Both need a signature for every allowed type: check_magic to verify base64, the fetch to sniff.
    needs_signature = [why for on, why in ((check_magic, "check_magic"), (fetch == "inline", "fetch: inline")) if on]

    def mime_problem(kind: str, norm: str, raw: str) -> str | None:
        if not _MIME.match(norm):
            return f"{raw!r} is not a MIME type; write it as type/subtype in lower case, e.g. {DEFAULT_MIME_TYPES[kind][0]}"
        if needs_signature and (kind, norm) not in SIGNATURES:
            known = ", ".join(m for k, m in SIGNATURES if k == kind)
            return (
                f"{raw!r} has no known magic-byte signature for {kind}, so {' and '.join(needs_signature)} cannot verify it; "
                f"choose from: {known}" + (" (or turn check_magic off)" if fetch != "inline" else "")
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
        allowed_domains=domains.texts,
        part_types=tuple(part_types),
        unknown_part_keys=s.enum("unknown_part_keys", UNKNOWN_PART_KEYS, d.unknown_part_keys),
        mime_types=mime_types,
        item_params=item_params,
        max_item_bytes=max_item,
        max_request_bytes=max_request,
        max_items=s.int("max_items", d.max_items, min=1, max=100_000),
        max_url_length=s.int("max_url_length", d.max_url_length, min=32, max=65536),
        check_magic=check_magic,
        resolve_dns=s.bool("resolve_dns", d.resolve_dns),
        dns_timeout=s.number("dns_timeout", d.dns_timeout, min=0, max=60, exclusive=True),
        fetch=fetch,
        fetch_timeout=s.number("fetch_timeout", d.fetch_timeout, min=0, max=600, exclusive=True),
        fetch_max_redirects=s.int("fetch_max_redirects", d.fetch_max_redirects, min=0, max=10),
        fetch_concurrency=s.int("fetch_concurrency", d.fetch_concurrency, min=1, max=1024),
        domains=domains,
    )
    s.finish()
    return cfg
