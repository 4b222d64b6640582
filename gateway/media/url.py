"""One URL grammar for media: the host names, the allow-list entries, and the URL parser.

A domain entry is ``[http://|https://]host[:port]`` or ``[http://|https://]*.host[:port]``. The
host is an ASCII DNS name (an internationalised name is written in punycode, ``xn--...``),
lower-cased when read; IP addresses are never entries. ``*.`` matches one or more labels in front
of the suffix and never the suffix itself, and the suffix needs at least two labels (``*.com`` is
refused). Without a port the entry allows the scheme's default port; with one, only that port.
``http://`` allows plain http as well as https for that entry; every other entry is https only.

Entries are parsed once, at config load, into a ``DomainSet``; the gateway's list and every API
key's ``media_allowed_domains`` are stored in that form, so nothing is parsed per request.

``parse_media_url`` reads a media URL once, strictly (a subset of RFC 3986 that every other
parser reads alike), and returns the canonical form that is forwarded.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from .reasons import MediaRefused

__all__ = [
    "DEFAULT_PORT",
    "DomainEntry",
    "DomainSet",
    "ENTRY_HELP",
    "MediaUrl",
    "check_host",
    "join_location",
    "parse_domain_entry",
    "parse_media_url",
    "read_domain_list",
]

DEFAULT_PORT = {"https": 443, "http": 80}

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


ENTRY_HELP = "use a host (images.example.com), a wildcard (*.cdn.example.org), optionally with :port, or http://host to also allow http"


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


# -- the URL parser ----------------------------------------------------------------------------------


class MediaUrl(NamedTuple):
    scheme: str  # "https" or "http"
    host: str  # lower-case DNS name
    port: int | None  # as written; None when absent
    canonical: str

    @property
    def effective_port(self) -> int:
        return self.port if self.port is not None else DEFAULT_PORT[self.scheme]

    @property
    def target(self) -> str:
        """The request-target (path and query) to send for this URL."""
        rest = self.canonical[len(self.scheme) + 3 :]
        cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        path = rest[cut:]
        return path if path.startswith("/") else "/" + path


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


def join_location(base: MediaUrl, location: str) -> str:
    """The absolute URL a redirect's ``Location`` names, relative to ``base`` (RFC 3986 section 5.2, no dot segments).

    The result still goes through ``parse_media_url``: anything odd in ``location`` is refused there.
    """
    if _SCHEME.match(location.partition(":")[0]) and ":" in location:
        return location
    origin = base.canonical[: len(base.scheme) + 3 + len(base.host) + (len(f":{base.port}") if base.port is not None else 0)]
    if location.startswith("//"):
        return f"{base.scheme}:{location}"
    if location.startswith("/"):
        return origin + location
    path = base.target.split("?", 1)[0]
    if location.startswith("?"):
        return origin + path + location
    return origin + path.rsplit("/", 1)[0] + "/" + location


# -- the allow-list ----------------------------------------------------------------------------------


class DomainSet:
    """Allow rules indexed for lookup: exact hosts in a dict, wildcard suffixes in another."""

    __slots__ = ("entries", "exact", "suffixes")

    def __init__(self, entries: Iterable[DomainEntry] = ()):
        self.entries = tuple(entries)
        self.exact: dict[str, list[DomainEntry]] = {}
        self.suffixes: dict[str, list[DomainEntry]] = {}
        for e in self.entries:
            (self.suffixes if e.wildcard else self.exact).setdefault(e.host, []).append(e)

    @classmethod
    def parse(cls, texts: Iterable[str]) -> "DomainSet":
        """From entry texts; ValueError on the first bad one (config loading reports them all instead)."""
        return cls(parse_domain_entry(t) for t in texts)

    @property
    def texts(self) -> tuple[str, ...]:
        return tuple(str(e) for e in self.entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DomainSet) and other.entries == self.entries

    def __hash__(self) -> int:
        return hash(self.entries)

    def __repr__(self) -> str:
        return f"DomainSet({list(self.texts)!r})"

    def __bool__(self) -> bool:
        return bool(self.entries)

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
        default = DEFAULT_PORT[url.scheme]
        port = url.port if url.port is not None else default
        same_port = [e for e in candidates if (e.port if e.port is not None else default) == port]
        if not same_port:
            return MediaRefused("url_port_not_allowed", f"port {port} is not allowed for the host {url.host!r}")
        if url.scheme == "http" and not any(e.allow_http for e in same_port):
            return MediaRefused("http_not_allowed", f"plain http is not allowed for the host {url.host!r}; use https")
        return None


def read_domain_list(values: Iterable[str], owner: str = "") -> tuple[DomainSet, list[tuple[int, str]]]:
    """Parse a configured list: the set of the good entries, and ``(index, message)`` for each bad one.

    The caller files each message under the field's path; ``owner`` names whose list it is.
    """
    entries: list[DomainEntry] = []
    problems: list[tuple[int, str]] = []
    for j, value in enumerate(values):
        try:
            entry = parse_domain_entry(value)
        except ValueError as exc:
            problems.append((j, f"{value!r}{owner} is not a valid domain entry: {exc}; {ENTRY_HELP}"))
            continue
        if entry in entries:
            problems.append((j, f"{value!r}{owner} is listed twice"))
            continue
        entries.append(entry)
    return DomainSet(entries), problems
