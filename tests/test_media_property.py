"""Property tests: whatever the media policy lets through satisfies the policy, by other parsers' reading.

Hypothesis builds URLs from tricky pieces (schemes, separators, hosts in many spellings, ports,
paths with odd characters) and request bodies that put them in every place media hides, in every
shape. For each body the policy accepts, an independent extractor reads the body the way
lmdeploy's api_server would (which strings it would fetch or decode) and checks each one with
three other URL parsers (urllib.parse, httpx, yarl) and the standard base64 decoder.
"""

from __future__ import annotations

import base64
import binascii
import copy
import ipaddress
import string
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yarl
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.media import MediaRefused, parse_media_url
from test_media_policy import FLAC, JPEG, MP4, NPY, PDF, PNG, WAV, context, media_config, policy_for

pytestmark = pytest.mark.unit

MAIN = media_config("main")
PROFILE = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- an independent reading of the "main" configuration ----------------------------------------------------------


def host_allowed(scheme: str, host: str, port: int | None) -> bool:
    default = {"https": 443, "http": 80}.get(scheme)
    if default is None:
        return False
    port = default if port is None else port
    if host in ("images.example.com", "docs.example.com") or host.endswith(".cdn.example.org"):
        return scheme == "https" and port == 443
    if host == "media.example.net":
        return scheme == "https" and port == 8443
    if host == "legacy.example.com":
        return port == default
    return False


MIMES = {kind: set(MAIN.mimes(kind)) for kind in ("image", "video", "audio", "time_series", "document")}
PARAMS = {kind: set(MAIN.params(kind)) for kind in MIMES}
# lmdeploy's MULTIMODAL_TYPES and the kind each loads
LMDEPLOY_TYPES = {
    "image_url": "image",
    "image": "image",
    "video_url": "video",
    "video": "video",
    "audio_url": "audio",
    "audio": "audio",
    "time_series_url": "time_series",
    "time_series": "time_series",
    "image_data": "forbidden",
}


def violation(url: Any, kind: str) -> str | None:
    """Why ``url`` breaks the policy by an independent reading, or None when it is fine."""
    if not isinstance(url, str):
        return "not a string"
    if kind == "forbidden":
        return "a part type the policy never forwards"
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            return "data URL is not base64"
        mime = header[len("data:") : -len(";base64")]
        if mime not in MIMES[kind]:
            return f"MIME type {mime!r} not allowed for {kind}"
        for chunk in payload.split(",") if mime == "video/jpeg" else [payload]:
            try:
                base64.b64decode(chunk, validate=True)
            except (binascii.Error, ValueError):
                return "payload is not strict base64"
            if not chunk or len(chunk) % 4:
                return "payload is empty or unpadded"
        return None
    if any(not (0x21 <= ord(c) < 0x7F) or c in "\\#" for c in url):
        return "character outside printable ASCII, backslash or fragment"
    readings = []
    try:
        u = urlsplit(url)
        readings.append(("urllib", u.scheme, u.hostname, u.port, u.username is not None or u.fragment != ""))
    except ValueError as exc:
        return f"urllib cannot parse it: {exc}"
    try:
        h = httpx.URL(url)
        readings.append(("httpx", h.scheme, h.raw_host.decode("ascii"), h.port, bool(h.userinfo) or h.fragment != ""))
    except Exception as exc:  # httpx raises InvalidURL and friends
        return f"httpx cannot parse it: {exc}"
    try:
        y = yarl.URL(url)
        readings.append(("yarl", y.scheme, y.raw_host, y.explicit_port, y.user is not None or y.fragment != ""))
    except Exception as exc:
        return f"yarl cannot parse it: {exc}"
    hosts = {r[2] for r in readings}
    if len(hosts) != 1:
        return f"parsers disagree on the host: {readings}"
    for name, scheme, host, port, extra in readings:
        if extra:
            return f"{name} sees user info or a fragment"
        if not host or not host_allowed(scheme, host, port):
            return f"{name} reads {scheme}://{host}:{port}, which is not allowed"
        try:
            ipaddress.ip_address(host.strip("[]"))
            return f"{name} reads an IP address"
        except ValueError:
            pass
    return None


def fetched(route: str, body: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any]]]:
    """Every (kind, source, processor params) the backend would load from this body."""
    out: list[tuple[str, Any, dict[str, Any]]] = []

    def chat_item(item: Any) -> None:
        if not isinstance(item, dict):
            out.append(("forbidden", item, {}))
            return
        t = item.get("type")
        if t not in LMDEPLOY_TYPES:
            return
        val = item.get(t, {})
        if isinstance(val, dict):
            params = {k: v for k, v in val.items() if k not in ("url", "data")}
            src = val.get("url") or val.get("data")
            if "url" in val and "data" in val:
                out.append(("forbidden", src, {}))
        else:
            params = {k: v for k, v in item.items() if k not in ("type", t)}
            src = val
        out.append((LMDEPLOY_TYPES[t], src, params))

    def anthropic_blocks(blocks: Any) -> None:
        if not isinstance(blocks, list):
            return
        for b in blocks:
            if not isinstance(b, dict):
                continue
            if b.get("type") in ("image", "document"):
                kind = "image" if b["type"] == "image" else "document"
                src = b.get("source") or {}
                if src.get("type") == "url":
                    out.append((kind, src.get("url"), {}))
                elif src.get("type") == "base64":
                    out.append((kind, f"data:{src.get('media_type')};base64,{src.get('data')}", {}))
                elif src.get("type") == "content":
                    anthropic_blocks(src.get("content"))
                elif src.get("type") != "text":
                    out.append(("forbidden", src, {}))
            elif b.get("type") == "tool_result":
                anthropic_blocks(b.get("content"))

    def responses_parts(parts: Any) -> None:
        if not isinstance(parts, list):
            return
        for p in parts:
            if isinstance(p, dict) and p.get("type") == "input_image":
                out.append(("image", p.get("image_url"), {}))
                if p.get("file_id") is not None:
                    out.append(("forbidden", p["file_id"], {}))
            elif isinstance(p, dict) and p.get("type") == "input_file":
                for f in ("file_url", "file_data"):
                    if p.get(f) is not None:
                        out.append(("document", p[f], {}))
                if p.get("file_id") is not None:
                    out.append(("forbidden", p["file_id"], {}))

    if route == "chat" and isinstance(body.get("messages"), list):
        for m in body["messages"]:
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                for item in m["content"]:
                    chat_item(item)
    if route in ("messages", "count_tokens"):
        anthropic_blocks(body.get("system"))
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                anthropic_blocks(m.get("content"))
    if route == "responses" and isinstance(body.get("input"), list):
        for item in body["input"]:
            if isinstance(item, dict):
                responses_parts(item.get("content"))
                responses_parts(item.get("output"))
    image_data = body.get("image_data")
    if image_data is not None:
        for img in image_data if isinstance(image_data, list) else [image_data]:
            if isinstance(img, dict):
                out.append(("image", img.get("url") or img.get("data"), {k: v for k, v in img.items() if k not in ("url", "data")}))
            else:
                out.append(("image", img, {}))
    return out


# -- generators ----------------------------------------------------------------------------------------------------

SCHEMES = ["https", "http", "HTTPS", "HtTp", "file", "ftp", "gopher", "jar:https", "blob:https", "javascript", "", "https ", "\thttps", "ｈttps"]
SEPARATORS = ["://", "://", "://", ":/", ":", ":///", ":\\\\", "://user:pw@", "://@", ":/\\", "://images.example.com@"]
HOSTS = [
    "images.example.com",
    "IMAGES.example.COM",
    "docs.example.com",
    "a.cdn.example.org",
    "x.y.cdn.example.org",
    "xn--bcher-kva.cdn.example.org",
    "media.example.net",
    "legacy.example.com",
    "cdn.example.org",
    "evilcdn.example.org",
    "images.example.com.evil.com",
    "evil.com",
    "images.example.com.",
    "localhost",
    "127.0.0.1",
    "2130706433",
    "0x7f.1",
    "0177.0.0.1",
    "[::1]",
    "[::ffff:127.0.0.1]",
    "①②⑦.0.0.1",
    "images%2eexample.com",
    "images．example.com",
    "evil.com#@images.example.com",
    "evil.com\\@images.example.com",
    "images.example.com\\@evil.com",
    "images.example.com?@evil.com",
    "a_b.cdn.example.org",
    "",
]
PORTS = ["", "", "", ":443", ":8443", ":80", ":8080", ":0", ":65536", ":", ":0443", ": 443"]
PATH_ALPHABET = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@/%?#[]{}|\\^`\"<> \t\n\x00\x7fé①\u202e"
paths = st.one_of(
    st.sampled_from(["", "/", "/a.png", "/../etc/passwd", "/%2e%2e/x", "/a%20b.png", "/a b", "/@evil.com", "//evil.com/x", "/x?y=1#z"]),
    st.text(alphabet=PATH_ALPHABET, max_size=24).map(lambda s: "/" + s),
)
tails = st.sampled_from(["", "", "?a=1", "?X-Amz-Signature=ab%2Fcd", "?next=/a?b", "#frag", "?a=%zz", "?q=[1]"])
built_urls = st.builds(lambda *p: "".join(p), st.sampled_from(SCHEMES), st.sampled_from(SEPARATORS), st.sampled_from(HOSTS), st.sampled_from(PORTS), paths, tails)
good_urls = st.builds(
    lambda scheme, host, path: f"{scheme}://{host}{path}",
    st.sampled_from(["https", "HTTPS", "Https"]),
    st.sampled_from(["images.example.com", "Docs.Example.Com", "a.cdn.example.org", "b.c.cdn.example.org", "media.example.net:8443", "legacy.example.com"]),
    st.text(alphabet=string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@", max_size=16).filter(lambda s: s not in (".", "..")).map(lambda s: "/" + s),
)
SAMPLES = {"image/png": PNG, "image/jpeg": JPEG, "video/mp4": MP4, "audio/wav": WAV, "audio/flac": FLAC, "application/octet-stream": NPY, "application/pdf": PDF}
valid_data_urls = st.builds(lambda m: f"data:{m};base64,{base64.b64encode(SAMPLES[m]).decode()}", st.sampled_from(sorted(SAMPLES)))
data_urls = st.one_of(
    valid_data_urls,
    st.builds(
        lambda head, mime, sep, payload: f"{head}{mime}{sep}{payload}",
        st.sampled_from(["data:", "DATA:", "data:/", "data: "]),
        st.sampled_from(["image/png", "IMAGE/PNG", "image/svg+xml", "text/html", "", "video/mp4", "application/pdf"]),
        st.sampled_from([";base64,", ",", ";BASE64,", ";charset=x;base64,", ";base64"]),
        st.one_of(st.just(base64.b64encode(PNG).decode()), st.text(alphabet=string.ascii_letters + "+/=-_ \n%", max_size=16)),
    ),
)
urls = st.one_of(built_urls, good_urls, data_urls, st.text(max_size=30))

EXTRA_KEYS = st.sampled_from(["detail", "sampling_rate", "max_pixels", "type", "url", "data"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.text(max_size=8))


@st.composite
def media_value(draw: st.DrawFn, urls: st.SearchStrategy[str] = urls) -> Any:
    u = draw(urls)
    shape = draw(st.integers(0, 7))
    if shape == 0:
        return u
    if shape == 1:
        return {"url": u}
    if shape == 2:
        return {"data": u}
    if shape == 3:
        return {"url": draw(urls), "data": u}
    if shape == 4:
        return [u]
    if shape == 5:
        return {"url": u, draw(EXTRA_KEYS): draw(st.one_of(scalars, st.just({"url": "file:///etc/passwd"})))}
    if shape == 6:
        return draw(st.one_of(st.none(), st.integers(), st.just({})))
    return {"url": u, "detail": "high"}


KNOWN_CHAT_TYPES = [t for t in LMDEPLOY_TYPES if t != "image_data"] + ["text", "refusal"]
OTHER_CHAT_TYPES = ["image_data", "input_audio", "file", "IMAGE_URL", "input_image"]
chat_types = st.one_of(st.sampled_from(KNOWN_CHAT_TYPES), st.sampled_from(KNOWN_CHAT_TYPES), st.sampled_from(KNOWN_CHAT_TYPES), st.sampled_from(OTHER_CHAT_TYPES))


@st.composite
def chat_part(draw: st.DrawFn, urls: st.SearchStrategy[str] = urls) -> Any:
    t = draw(chat_types)
    if t == "text":
        return {"type": "text", "text": draw(urls)}
    part: dict[str, Any] = {"type": t, t: draw(media_value(urls))}
    if draw(st.booleans()) and draw(st.booleans()):
        part[draw(EXTRA_KEYS)] = draw(st.one_of(scalars, urls))
    return part


@st.composite
def anthropic_block(draw: st.DrawFn, depth: int = 0, urls: st.SearchStrategy[str] = urls) -> Any:
    kind = draw(st.sampled_from(["image", "document", "text", "tool_result", "thinking", "container_upload"]))
    if kind in ("image", "document"):
        source_type = draw(st.sampled_from(["url", "base64", "text", "content", "file", "path"]))
        if source_type == "url":
            source: dict[str, Any] = {"type": "url", "url": draw(urls)}
        elif source_type == "base64":
            mime = draw(st.sampled_from([*SAMPLES, "image/svg+xml", "IMAGE/JPEG", "image/png;base64,AAAA"]))
            data = draw(st.one_of(st.just(base64.b64encode(SAMPLES.get(mime, PNG)).decode()), st.text(max_size=12)))
            source = {"type": "base64", "media_type": mime, "data": data}
        elif source_type == "content" and depth < 2:
            source = {"type": "content", "content": draw(st.lists(anthropic_block(depth + 1, urls), max_size=2))}
        else:
            source = {"type": source_type, "media_type": "text/plain", "data": draw(urls)}
        return {"type": kind, "source": source}
    if kind == "tool_result" and depth < 2:
        return {"type": "tool_result", "tool_use_id": "t", "content": draw(st.one_of(st.text(max_size=5), st.lists(anthropic_block(depth + 1, urls), max_size=2)))}
    return {"type": kind, "text": draw(urls)}


@st.composite
def responses_part(draw: st.DrawFn, urls: st.SearchStrategy[str] = urls) -> Any:
    t = draw(st.sampled_from(["input_text", "input_image", "input_file", "input_audio"]))
    if t == "input_image":
        part: dict[str, Any] = {"type": t, "image_url": draw(st.one_of(urls, media_value(urls)))}
        if draw(st.booleans()):
            part["file_id"] = draw(st.one_of(st.none(), st.just("file-1")))
        return part
    if t == "input_file":
        field = draw(st.sampled_from(["file_url", "file_data", "file_id"]))
        return {"type": t, field: draw(urls)}
    return {"type": t, "text": draw(urls)}


def image_data(urls: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return st.one_of(urls, media_value(urls), st.lists(st.one_of(urls, media_value(urls)), max_size=3))


@st.composite
def request(draw: st.DrawFn, urls: st.SearchStrategy[str] = urls) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(["chat", "messages", "count_tokens", "responses", "completions"]))
    body: dict[str, Any] = {"model": "test-model"}
    if route == "chat":
        body["messages"] = [
            {"role": draw(st.sampled_from(["user", "assistant", "tool", "system"])), "content": draw(st.one_of(st.text(max_size=5), st.lists(chat_part(urls), max_size=4)))}
            for _ in range(draw(st.integers(1, 3)))
        ]
    elif route in ("messages", "count_tokens"):
        body["messages"] = [{"role": "user", "content": draw(st.one_of(st.text(max_size=5), st.lists(anthropic_block(0, urls), max_size=4)))}]
        if draw(st.booleans()):
            body["system"] = draw(st.lists(anthropic_block(0, urls), max_size=2))
    elif route == "responses":
        item_type = draw(st.sampled_from(["message", "function_call_output"]))
        field = "content" if item_type == "message" else "output"
        body["input"] = [{"type": item_type, "role": "user", "call_id": "c", field: draw(st.lists(responses_part(urls), max_size=4))}]
    else:
        body["prompt"] = "x"
    if draw(st.integers(0, 3)) == 0:
        body["image_data"] = draw(image_data(urls))
    return route, body


# -- properties ----------------------------------------------------------------------------------------------------


# Mostly well-formed media, so that many bodies are accepted and their contents get checked.
friendly_urls = st.one_of(good_urls, good_urls, valid_data_urls, built_urls)


@settings(PROFILE, max_examples=1000)
@given(st.one_of(request(), request(friendly_urls)))
def test_everything_forwarded_satisfies_the_policy(req: tuple[str, dict[str, Any]]):
    route, body = req
    forwarded = copy.deepcopy(body)
    refusal = policy_for("main").check_body(context(route, forwarded))
    if refusal is not None:
        event(f"refused: {refusal.reason}")
        assert refusal.status == 400 and refusal.param
        return
    items = fetched(route, forwarded)
    event("accepted with media" if items else "accepted without media")
    for kind, src, params in items:
        why = violation(src, kind)
        assert why is None, f"forwarded {src!r} as {kind}: {why}"
        assert set(params) <= PARAMS[kind], f"forwarded processor params {params}"
        assert all(v is None or isinstance(v, (str, int, float, bool)) for v in params.values())


@PROFILE
@given(urls)
def test_every_url_accepted_in_a_slot_is_read_alike_by_three_parsers(url: str):
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    refusal = policy_for("main").check_body(context("chat", body))
    if refusal is None:
        forwarded = body["messages"][0]["content"][0]["image_url"]["url"]
        assert violation(forwarded, "image") is None, forwarded
        event("accepted")
        if not url.lower().startswith("data:"):
            # only the case of scheme and host may change
            assert forwarded.lower() == url.lower() and forwarded.split("/", 3)[3:] == url.split("/", 3)[3:]
    else:
        event(refusal.reason)


@PROFILE
@given(good_urls)
def test_well_formed_urls_on_allowed_domains_are_accepted(url: str):
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": url}]}]}
    assert policy_for("main").check_body(context("chat", body)) is None
    forwarded = body["messages"][0]["content"][0]["image_url"]
    scheme, rest = forwarded.split("://", 1)
    authority = rest.split("/", 1)[0]
    assert scheme == "https" and authority == authority.lower()


@settings(max_examples=600, deadline=None)
@given(st.text(max_size=80))
def test_parser_only_ever_refuses_with_a_reason(text: str):
    try:
        u = parse_media_url(text)
    except MediaRefused as exc:
        assert exc.reason.startswith("url_")
        return
    assert u.scheme in ("http", "https") and u.canonical.lower() == text.lower()


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10), urls),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.sampled_from(["type", "url", "data", "image_url", "source", "content", "messages", "input", "image_data", "media_type", "text", "output", "system", "file_id"]), children, max_size=4),
    ),
    max_leaves=20,
)


@pytest.mark.parametrize("route", ["chat", "messages", "count_tokens", "responses", "completions"])
@settings(max_examples=150, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["messages", "input", "system", "image_data", "prompt"]), json_values, max_size=4))
def test_arbitrary_json_never_crashes_the_policy(route: str, body: dict[str, Any]):
    forwarded = copy.deepcopy(body)
    refusal = policy_for("main").check_body(context(route, forwarded))
    if refusal is None:
        for kind, src, params in fetched(route, forwarded):
            assert violation(src, kind) is None, src


# -- only known keys of each part type are forwarded (issue 8.5) ----------------------------------------------------------

# An independent reading of the APIs' part shapes (OpenAI chat and Responses, Anthropic Messages).
PART_KEYS = {
    "chat": {"text": {"type", "text"}, "refusal": {"type", "refusal"}},
    "anthropic": {
        "text": {"type", "text", "cache_control", "citations"},
        "thinking": {"type", "thinking", "signature"},
        "redacted_thinking": {"type", "data"},
        "tool_use": {"type", "id", "name", "input", "cache_control"},
        "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
        "image": {"type", "source", "cache_control"},
        "document": {"type", "source", "cache_control", "title", "context", "citations"},
    },
    "responses": {
        "input_text": {"type", "text"},
        "output_text": {"type", "text", "annotations", "logprobs"},
        "text": {"type", "text"},
        "refusal": {"type", "refusal"},
        "input_image": {"type", "image_url", "file_id", "detail"},
        "input_file": {"type", "file_data", "file_url", "file_id", "filename"},
    },
}
STRAY = st.sampled_from(["image_url", "url", "source", "image", "video_url", "data", "file_url", "x"])


def parts_of(route: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(family, part) for every content part the backend would read, nested ones included."""
    out: list[tuple[str, dict[str, Any]]] = []

    def walk(family: str, parts: Any) -> None:
        for p in parts if isinstance(parts, list) else []:
            if isinstance(p, dict):
                out.append((family, p))
                if family == "anthropic":
                    walk(family, p.get("content"))
                    src = p.get("source")
                    if isinstance(src, dict):
                        walk(family, src.get("content"))

    family = {"chat": "chat", "messages": "anthropic", "count_tokens": "anthropic", "responses": "responses"}.get(route)
    if family == "responses":
        for item in body.get("input") or []:
            if isinstance(item, dict):
                walk(family, item.get("content"))
                walk(family, item.get("output"))
    elif family is not None:
        walk(family, body.get("system"))
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                walk(family, m.get("content"))
    return out


@st.composite
def request_with_stray_keys(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    route, body = draw(request(friendly_urls))
    for _, part in parts_of(route, body):
        if draw(st.integers(0, 3)) == 0:
            part[draw(STRAY)] = draw(st.one_of(friendly_urls, st.just({"url": "file:///etc/passwd"})))
    return route, body


@settings(PROFILE, max_examples=500)
@given(request_with_stray_keys(), st.sampled_from(["main", "lenient"]))
def test_only_known_part_keys_are_forwarded(req: tuple[str, dict[str, Any]], config: str):
    route, body = req
    forwarded = copy.deepcopy(body)
    refusal = policy_for(config).check_body(context(route, forwarded))
    if refusal is not None:
        event(f"{config} refused: {refusal.reason}")
        return
    event(f"{config} accepted")
    for family, part in parts_of(route, forwarded):
        known = PART_KEYS[family].get(part.get("type"))
        if known is not None:
            assert set(part) <= known, f"forwarded {sorted(set(part) - known)} in a {family} {part.get('type')} part"
        elif family == "chat" and part.get("type") in LMDEPLOY_TYPES:
            t = part["type"]
            extra = set(part) - {"type", t}
            assert not extra or (isinstance(part[t], str) and extra <= PARAMS[LMDEPLOY_TYPES[t]]), part
