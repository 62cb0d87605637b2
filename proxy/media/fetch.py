"""An image part's URL -> its bytes, under the server's media policy (vLLM's options and limits).

- ``data:<media type>;base64,<data>``: the media type must be ``image/*``; the data strict base64
  (whitespace ignored).
- ``http(s)://``: fetched with httpx, at most ``max_bytes`` (the ``Content-Length`` checked first,
  then the body as it arrives), within ``timeout_s`` for the whole exchange (vLLM's
  ``VLLM_IMAGE_FETCH_TIMEOUT``, 5 s by default); redirects followed up to 5, each hop's host checked
  again; with ``--allowed-media-domains`` only those host names (vLLM's option; exact match); any
  status other than 2xx is a 400.
- ``file://``: only with ``--allowed-local-media-path`` (vLLM's option) and only for a file inside
  that folder once symlinks are resolved.

Every failure is a 400 naming the part (:attr:`proxy.protocol.images.ImagePart.param`); the server's
own state never depends on a fetched byte.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from proxy.errors import InvalidRequestError
from proxy.protocol.images import ImagePart
from proxy.settings import Settings

from .decode import MAX_IMAGE_PIXELS, LoadedImage, decode_image

MAX_IMAGE_BYTES = 20 * 1024 * 1024
"""Largest encoded image, in bytes (OpenAI's limit per image)."""
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how big they may be.

    Attributes:
        allowed_domains: host names http(s) images may be fetched from; empty: any.
        allowed_local_path: the folder ``file://`` images may be read from; "": none.
        timeout_s: the most seconds one fetch may take.
        max_bytes: the largest encoded image.
        max_pixels: the most pixels of one decoded image.
    """

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str = ""
    timeout_s: float = 5.0
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS

    @classmethod
    def from_settings(cls, settings: Settings) -> MediaPolicy:
        """The policy of ``--allowed-media-domains``, ``--allowed-local-media-path`` and
        ``--media-fetch-timeout-s``."""
        return cls(settings.allowed_media_domains, settings.allowed_local_media_path,
                   settings.media_fetch_timeout_s)


def _bad(part: ImagePart, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{part.param}': {message}", param=part.param)


def _data_url(part: ImagePart, policy: MediaPolicy) -> bytes:
    head, comma, payload = part.url.partition(",")
    media_type, _, encoding = head[5:].partition(";")
    if not comma or encoding.lower() != "base64":
        raise _bad(part, "a data URL must have the form 'data:image/<type>;base64,<data>'.")
    if not media_type.lower().startswith("image/"):
        raise _bad(part, f"the data URL's media type {media_type!r} is not an image type.")
    if len(payload) > policy.max_bytes * 4 // 3 + 4:
        raise _bad(part, f"the image is larger than the limit of {policy.max_bytes} bytes.")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _bad(part, "the data URL's data is not valid base64.") from None


def _file(part: ImagePart, policy: MediaPolicy) -> bytes:
    if not policy.allowed_local_path:
        raise _bad(part, "file:// URLs are not allowed: the server was started without "
                   "--allowed-local-media-path.")
    url = urlsplit(part.url)
    if url.netloc not in ("", "localhost"):
        raise _bad(part, f"a file:// URL must name a local file, not one on host {url.netloc!r}.")
    root = Path(policy.allowed_local_path).resolve()
    path = Path(unquote(url.path)).resolve()
    if root not in path.parents:
        raise _bad(part, "the file is outside the folder --allowed-local-media-path allows.")
    try:
        if path.stat().st_size > policy.max_bytes:
            raise _bad(part, f"the image is larger than the limit of {policy.max_bytes} bytes.")
        return path.read_bytes()
    except OSError:
        raise _bad(part, "the file cannot be read.") from None


def _check_host(part: ImagePart, url: str, policy: MediaPolicy) -> None:
    host = urlsplit(url).hostname or ""
    if policy.allowed_domains and host not in policy.allowed_domains:
        raise _bad(part, f"the host {host!r} is not one of --allowed-media-domains.")


async def _http(part: ImagePart, policy: MediaPolicy) -> bytes:
    url = part.url
    async with httpx.AsyncClient(follow_redirects=False, timeout=policy.timeout_s) as client:
        for _ in range(MAX_REDIRECTS + 1):
            _check_host(part, url, policy)
            async with client.stream("GET", url) as response:
                if response.is_redirect and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    if not url.lower().startswith(("http://", "https://")):
                        raise _bad(part, "the image URL redirects to a URL that is not http(s).")
                    continue
                if not response.is_success:
                    raise _bad(part, f"fetching the image failed: HTTP {response.status_code}.")
                length = response.headers.get("content-length", "")
                if length.isdigit() and int(length) > policy.max_bytes:
                    raise _bad(part, f"the image is larger than the limit of {policy.max_bytes} bytes.")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > policy.max_bytes:
                        raise _bad(part, f"the image is larger than the limit of {policy.max_bytes} bytes.")
                return bytes(body)
    raise _bad(part, f"the image URL redirects more than {MAX_REDIRECTS} times.")


async def image_bytes(part: ImagePart, policy: MediaPolicy) -> bytes:
    """The encoded bytes of ``part`` (the module docstring's rules).

    Raises:
        InvalidRequestError: a malformed data URL, a URL that is not allowed, fails, times out or
            is too large (``param`` names the part).
    """
    scheme = part.url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url(part, policy)
    if scheme == "file":
        return await asyncio.to_thread(_file, part, policy)
    try:
        return await asyncio.wait_for(_http(part, policy), policy.timeout_s)
    except TimeoutError:
        raise _bad(part, f"fetching the image took longer than {policy.timeout_s:g} s.") from None
    except httpx.HTTPError as exc:
        raise _bad(part, f"fetching the image failed ({type(exc).__name__}).") from None


async def load_images(parts: tuple[ImagePart, ...], policy: MediaPolicy) -> tuple[LoadedImage, ...]:
    """Fetch and decode every image of a request (fetches concurrently, decoding in a worker thread).

    Raises:
        InvalidRequestError: the first failing part in order, named.
    """
    data = await asyncio.gather(*(image_bytes(part, policy) for part in parts), return_exceptions=True)
    for raw in data:
        if isinstance(raw, BaseException):
            raise raw
    return tuple([await asyncio.to_thread(decode_image, raw, part.param, policy.max_pixels)
                  for part, raw in zip(parts, data, strict=True) if isinstance(raw, bytes)])
