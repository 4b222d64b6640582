"""Every way the media policy can say no: a short reason (the metric label) and a why in plain words.

Smokescreen's rule: explicit allows, and a reason on every denial. ``MediaRefused`` carries one
denial from wherever it is found (the URL parser, the walk, the fetcher) to the filter, which
fills in nothing but the HTTP shape.
"""

from __future__ import annotations

REASONS = (
    # request shape
    "malformed_content",
    "unknown_part_type",
    "unknown_input_item_type",
    "unexpected_part_field",
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
    # the DNS check (resolve_dns) and the inline fetch (fetch: inline)
    "dns_failed",
    "dns_non_global",
    "fetch_failed",
    "fetch_timeout",
    "fetch_bad_status",
    "fetch_bad_response",
    "fetch_redirect_refused",
    "fetch_too_many_redirects",
    "fetch_content_not_allowed",
)

# Reasons only a network step can give: the body table cannot reach them without a resolver or a server.
NETWORK_REASONS = frozenset(r for r in REASONS if r.startswith(("dns_", "fetch_")))


class MediaRefused(Exception):
    """One denial: a reason (metric label), the why in plain words, and where (filled in by the walk)."""

    def __init__(self, reason: str, why: str, param: str | None = None):
        super().__init__(why)
        self.reason = reason
        self.why = why
        self.param = param
