"""``Content-Encoding`` of request bodies: identity or zstd (the SDK's ``proto_compress_fwdbwd``).
The one place a body is decompressed: the gateway (capped at its body limit), the protobuf
decoder (capped at :data:`MAX_DECOMPRESSED_BYTES`) and :func:`decompress_head` all use it."""

from __future__ import annotations

import io

from openrl.errors import UserError

#: Upper bound, in bytes, on a zstd-decompressed request body.
MAX_DECOMPRESSED_BYTES = 1 << 30

_CHUNK = 1 << 20


def decompress(body: bytes, content_encoding: str | None, *, limit: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """The body as sent (``None`` / ``identity``) or zstd-decompressed (``zstd``).

    A zstd body is read in 1 MiB chunks and reading stops once more than ``limit`` bytes came
    out, so a small "zstd bomb" never expands without bound: a result longer than ``limit``
    means the body is over it (the caller decides the error, e.g. 413). An identity body is
    returned whole.

    Raises:
        UserError: ``Content-Encoding`` neither identity nor zstd; ``body`` not valid zstd.
    """
    enc = (content_encoding or "").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc != "zstd":
        raise UserError("Content-Encoding", f"unsupported encoding {content_encoding!r}; use zstd")
    import zstandard

    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
        while chunk := reader.read(min(_CHUNK, limit + 1 - len(out))):
            out += chunk
            if len(out) > limit:
                break
    except zstandard.ZstdError as exc:
        raise UserError("body", f"invalid zstd data: {exc}") from None
    return bytes(out)


def decompress_head(head: bytes, content_encoding: str | None) -> bytes | None:
    """As much of a (possibly truncated) body's start as decompresses: ``head`` itself unless
    ``content_encoding`` is zstd; None when it is not zstd data at all. Never raises."""
    if (content_encoding or "").strip().lower() != "zstd":
        return head
    try:
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(head)
    except Exception:  # noqa: BLE001 - not zstd at all
        return None
