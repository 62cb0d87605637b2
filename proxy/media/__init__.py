"""Media inputs: the images of a request fetched (``fetch``: data URLs, http(s) with limits,
``file://`` under an allowed folder) and decoded (``decode``: PNG, JPEG, WebP, GIF's first frame, as
RGB, with a content hash). Every error is a 400 naming the image's part."""

from __future__ import annotations

from .decode import IMAGE_FORMATS, MAX_IMAGE_PIXELS, LoadedImage, decode_image
from .fetch import MAX_IMAGE_BYTES, MediaPolicy, image_bytes, load_images

__all__ = ["IMAGE_FORMATS", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "LoadedImage", "MediaPolicy",
           "decode_image", "image_bytes", "load_images"]
