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
from .settings import internal, read_fields, setting

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
    """Which media a request may carry, and from where: a base64 `data:` URL, or https on an allowed domain."""

    allowed_domains: tuple[str, ...] = setting((), "Hosts media URLs may name: `host` (https, port 443), `*.example.org` (any subdomain), `host:port`, `http://host`; empty: `data:` URLs only.")
    part_types: tuple[str, ...] = setting(KNOWN_PART_TYPES, "Content part types let through.", shown_default="every known type")
    unknown_part_keys: str = setting("refuse", "A key a part type does not define: `refuse` (400) or `drop` (removed before forwarding).", choices=UNKNOWN_PART_KEYS)
    mime_types: tuple[tuple[str, tuple[str, ...]], ...] = setting(
        doc="MIME types allowed per media kind (" + ", ".join(MEDIA_KINDS) + "), for `data:` URLs and fetched items.",
        default_factory=lambda: _pairs(DEFAULT_MIME_TYPES),
        custom={"type": "object", "properties": {k: {"type": ["array", "string"], "items": {"type": "string"}} for k in MEDIA_KINDS}, "additionalProperties": False},
        type_name="mapping of kind to MIME types",
        shown_default="; ".join(f"{k}: {', '.join(v)}" for k, v in DEFAULT_MIME_TYPES.items()),
    )
    item_params: tuple[tuple[str, tuple[str, ...]], ...] = setting(
        doc="Keys besides the URL a media item may carry (processor parameters), per kind.",
        default_factory=lambda: _pairs(DEFAULT_ITEM_PARAMS),
        custom={"type": "object", "properties": {k: {"type": ["array", "string"], "items": {"type": "string"}} for k in MEDIA_KINDS}, "additionalProperties": False},
        type_name="mapping of kind to names",
        shown_default="; ".join(f"{k}: {', '.join(v)}" for k, v in DEFAULT_ITEM_PARAMS.items() if v),
    )
    max_item_bytes: int = setting(20 * MIB, "Decoded size of one item, base64 or fetched.", min=1, max=1 << 34)
    max_request_bytes: int = setting(64 * MIB, "Decoded size of all items in one request.", min=1, max=1 << 36)
    max_items: int = setting(64, "Media items (URLs and base64) in one request.", min=1, max=100_000)
    max_url_length: int = setting(4096, "Characters of one media URL.", min=32, max=65536)
    check_magic: bool = setting(True, "Decoded bytes must start with their MIME type's signature.")
    resolve_dns: bool = setting(False, "Resolve allowed hosts and refuse any that has a non-global address (with `fetch: backend`).")
    dns_timeout: float = setting(2.0, "Seconds for that resolution.", min=0, max=60, exclusive=True)
    fetch: str = setting("backend", "`backend`: URLs are forwarded and the api_server fetches them; `inline`: the gateway fetches them (pinned, checked address) and forwards `data:` URLs.", choices=FETCH_MODES)
    fetch_timeout: float = setting(10.0, "`inline`: seconds for one item, redirects included.", min=0, max=600, exclusive=True)
    fetch_max_redirects: int = setting(3, "`inline`: redirects followed, each target checked against the allow-list.", min=0, max=10)
    fetch_concurrency: int = setting(8, "`inline`: fetches in flight across the gateway.", min=1, max=1024)
    # The parsed allow-list, built from allowed_domains once (a bad entry raises ValueError here).
    domains: DomainSet = internal(default=None, compare=False, repr=False)  # type: ignore[assignment]

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
    v = read_fields(MediaConfig, s)
    domains = read_domain_set(list(v["allowed_domains"]), lambda j: f"{s.where('allowed_domains')}[{j}]", s)

    part_types: list[str] = []
    for j, value in enumerate(v["part_types"]):
        if value not in KNOWN_PART_TYPES:
            s.problems.add(
                f"{s.where('part_types')}[{j}]",
                f"{value!r} is not a known content part type{did_you_mean(value, KNOWN_PART_TYPES)}; "
                f"choose from: {', '.join(KNOWN_PART_TYPES)}",
            )
        elif value not in part_types:
            part_types.append(value)

    check_magic, fetch = v["check_magic"], v["fetch"]
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

    max_item, max_request = v["max_item_bytes"], v["max_request_bytes"]
    if max_request < max_item:
        s.error("max_request_bytes", f"{max_request} is smaller than max_item_bytes ({max_item}); a single item could never pass")
    cfg = MediaConfig(
        **{**v, "allowed_domains": domains.texts, "part_types": tuple(part_types)},
        mime_types=mime_types,
        item_params=item_params,
        domains=domains,
    )
    s.finish()
    return cfg
