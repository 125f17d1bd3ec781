"""Request bodies sent compressed: `Content-Encoding: gzip` or `deflate` (what HTTP clients and proxies
that compress requests send) is decoded before the body is read as JSON, bounded by the same size limit
as an uncompressed body, so a small compressed body cannot inflate past it. Any other encoding is refused
415, naming the ones accepted (as Akka HTTP's decodeRequest and Spring's do)."""
from __future__ import annotations

import zlib

from app.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType

# zlib's window bits: gzip's header and trailer; deflate is the zlib format (RFC 9110), though some clients
# send raw deflate without its header, which is tried next.
_WBITS = {"gzip": (31,), "x-gzip": (31,), "deflate": (15, -15)}
ACCEPTED = ("gzip", "deflate")


def decoded(body: bytes, content_encoding: str, limit: int) -> bytes:
    """`body` with the encodings of a Content-Encoding header undone (the last applied is undone first);
    PayloadTooLarge past `limit` bytes decoded, InvalidInput when a body is not in its encoding,
    UnsupportedMediaType for an encoding other than identity, gzip and deflate."""
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in codings:
        if coding != "identity" and coding not in _WBITS:
            raise UnsupportedMediaType(f"Content-Encoding {coding} is not accepted: send the body uncompressed, or "
                                       f"with {' or '.join(ACCEPTED)}")
    for coding in reversed(codings):
        if coding != "identity":
            body = _inflated(body, coding, limit)
    return body


def _inflated(body: bytes, coding: str, limit: int) -> bytes:
    for wbits in _WBITS[coding]:
        try:
            return _members(body, wbits, limit)
        except zlib.error as e:
            error = e
    raise InvalidInput(f"the body is not valid {coding} ({error}) though Content-Encoding says it is")


def _members(body: bytes, wbits: int, limit: int) -> bytes:
    """The decoded body; gzip allows several members end to end, each decoded in turn."""
    out, rest, size = [], body, 0
    while True:
        inflater = zlib.decompressobj(wbits)
        part = inflater.decompress(rest, limit - size + 1)
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(f"the request body decompresses to more than {limit} bytes; the server accepts "
                                  f"at most {limit}")
        if not inflater.eof:
            raise zlib.error("it ends before its end")
        out.append(part)
        rest = inflater.unused_data
        if not rest:
            return b"".join(out)
        if wbits != 31:  # only gzip has members end to end
            raise zlib.error(f"{len(rest)} bytes follow its end")
