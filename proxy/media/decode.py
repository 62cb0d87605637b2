"""Image bytes -> an RGB picture and its content hash, or a 400 naming the image's part.

Rules:

- Formats: PNG, JPEG (with MPO, the multi-picture JPEG of phone cameras), WebP and GIF, recognised from
  the bytes (the declared media type is not trusted); anything else (SVG, TIFF, BMP, a non-image) is
  a 400. An animated GIF or WebP gives its first frame.
- Decompression bombs: the pixel count in the header is checked against ``max_pixels`` before any
  pixel is decoded (Pillow's own bomb warning and error are a 400 too).
- Colour: RGBA, LA and palette images with transparency are composited onto white (as vLLM's
  ``rgba_to_rgb``); every other mode (grayscale, CMYK, palette) goes through Pillow's ``convert("RGB")``.
- Content hash: SHA-256 of the RGB picture's size and pixels, so the same picture sent as PNG or as a
  data URL or fetched from a URL has one hash (what the prefix and encoder caches key image spans by).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from proxy.errors import InvalidRequestError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""Pillow's names of the formats accepted."""
MAX_IMAGE_PIXELS = 40_000_000
"""Most pixels (width x height) of one image: above a 24-megapixel photo, below Pillow's own bomb
warning (89 million)."""
_WHITE = (255, 255, 255)


@dataclass(frozen=True, eq=False)
class LoadedImage:
    """One decoded image of a request.

    Attributes:
        param: the part it came from (``messages[0].content[1]``).
        image: the picture, mode ``RGB``.
        content_hash: SHA-256 hex digest of its size and RGB pixels.
    """

    param: str
    image: Image.Image
    content_hash: str

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)`` in pixels."""
        return self.image.size


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}': {message}", param=param)


def _rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    transparent = image.mode == "P" and "transparency" in image.info
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or transparent:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, _WHITE)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def decode_image(data: bytes, param: str, max_pixels: int = MAX_IMAGE_PIXELS) -> LoadedImage:
    """Decode ``data`` (the module docstring's rules); CPU work of up to a few hundred ms for a large
    photo, so callers run it off the event loop.

    Raises:
        InvalidRequestError: not an image of an accepted format, more than ``max_pixels`` pixels,
            corrupt or truncated (``param`` names the part).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
            width, height = image.size
            if width * height > max_pixels:
                raise _bad(param, f"the image is {width} x {height} = {width * height} pixels, more than "
                           f"the limit of {max_pixels}; send a smaller image.")
            image.seek(0)
            image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise _bad(param, f"the image has more than the limit of {max_pixels} pixels; send a smaller "
                   "image.") from None
    except UnidentifiedImageError:
        raise _bad(param, "the data is not an image in a supported format (PNG, JPEG, WebP or "
                   "GIF).") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise _bad(param, f"the image could not be decoded (corrupt or truncated: {exc}).") from None
    rgb = _rgb(image)
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return LoadedImage(param, rgb, digest.hexdigest())
