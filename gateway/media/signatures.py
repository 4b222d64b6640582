"""Magic bytes: what the first bytes of each allowed media type look like.

The check is on by default (``media.check_magic``): a base64 item whose decoded bytes do not
start like its declared type is refused, so a backend's decoder never meets an HTML page or a
script labelled ``image/png``. Only the first ``HEAD_BYTES`` are decoded, so the cost does not
grow with the item. The inline fetcher sniffs fetched content with the same table.
"""

from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["FRAME_SEQUENCE_MIMES", "HEAD_BYTES", "SIGNATURES", "matches", "sniff"]

# Bytes a signature may look at; 24 base64 characters decode to 18 bytes, more than any needs (12).
HEAD_BYTES = 18


def _riff(form: bytes) -> Callable[[bytes], bool]:
    return lambda b: b[:4] == b"RIFF" and b[8:12] == form


def _prefix(*heads: bytes) -> Callable[[bytes], bool]:
    return lambda b: b.startswith(heads)


def _ftyp(b: bytes) -> bool:
    return b[4:8] == b"ftyp"


def _mpeg_audio(b: bytes) -> bool:
    return b.startswith(b"ID3") or (len(b) > 1 and b[0] == 0xFF and b[1] & 0xE0 == 0xE0)


# Magic-byte signatures by (kind, MIME type).
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


def matches(kind: str, mime: str, head: bytes) -> bool:
    """True when ``head`` starts like ``mime`` data; a type without a signature never matches."""
    check = SIGNATURES.get((kind, mime))
    return check is not None and check(head)


def sniff(kind: str, allowed: Iterable[str], head: bytes, declared: str | None = None) -> str | None:
    """The allowed MIME type ``head`` is, preferring the declared one when the bytes agree; else None.

    Frame sequences are a request-body convention, never a fetched file's type.
    """
    if declared is not None and declared in allowed and (kind, declared) not in FRAME_SEQUENCE_MIMES and matches(kind, declared, head):
        return declared
    for mime in allowed:
        if (kind, mime) not in FRAME_SEQUENCE_MIMES and matches(kind, mime, head):
            return mime
    return None
