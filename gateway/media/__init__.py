"""The media policy's parts, parsed once at config load and used by the media filter.

    url.py         the URL grammar: host names, allow-list entries (DomainSet), the strict URL parser
    signatures.py  magic bytes per media type; the sniffing the fetcher uses
    parts.py       content-part types per request family and the keys each may carry
    walk.py        the one pass over a request body that checks (and canonicalises) every reference
    addresses.py   which resolved addresses are public
    fetch.py       the opt-in inline fetch (pinned address, bounded, sniffed)
    reasons.py     every denial's reason; MediaRefused

This package imports nothing from the rest of the gateway: ``config`` stores its
parsed forms (``DomainSet`` for the gateway list and per API key) and ``filters/media.py`` turns
its decisions into HTTP refusals; the walk reads the ``media:`` section through ``walk.Policy``.
"""

from .addresses import is_global_address
from .reasons import REASONS, MediaRefused
from .url import DomainEntry, DomainSet, MediaUrl, parse_domain_entry, parse_media_url

__all__ = ["REASONS", "DomainEntry", "DomainSet", "MediaRefused", "MediaUrl", "is_global_address", "parse_domain_entry", "parse_media_url"]
