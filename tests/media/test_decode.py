"""proxy.media.decode: accepted formats, colour conversion, content hash, and every bad input a 400
naming the part."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from proxy.errors import InvalidRequestError
from proxy.media.decode import decode_image

from .images import encode, picture, png_header

P = "messages[0].content[1]"


def pixels(image: Image.Image) -> list[tuple[int, ...]]:
    return [image.getpixel((x, y)) for y in range(image.height) for x in range(image.width)]


@pytest.mark.parametrize(("fmt", "kw"), [("PNG", {}), ("WEBP", {"lossless": True}), ("GIF", {}),
                                         ("JPEG", {"quality": 100, "subsampling": 0})])
def test_formats_decode_to_the_same_rgb_picture(fmt: str, kw: dict[str, object]) -> None:
    original = picture((16, 12))
    loaded = decode_image(encode(original, fmt, **kw), P)
    assert loaded.param == P and loaded.image.mode == "RGB" and loaded.size == (16, 12)
    if fmt == "JPEG":  # lossy: every pixel within a small distance
        assert max(abs(a - b) for p, q in zip(pixels(loaded.image), pixels(original), strict=True)
                   for a, b in zip(p, q, strict=True)) <= 8
    else:
        assert pixels(loaded.image) == pixels(original)


def test_gif_gives_its_first_frame() -> None:
    first, second = picture(seed=0), picture(seed=1)
    data = encode(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    assert pixels(decode_image(data, P).image) == pixels(first)


def test_transparency_is_composited_onto_white() -> None:
    rgba = Image.new("RGBA", (3, 1))
    rgba.putpixel((0, 0), (255, 0, 0, 255))
    rgba.putpixel((1, 0), (255, 0, 0, 0))
    rgba.putpixel((2, 0), (0, 0, 0, 128))
    assert pixels(decode_image(encode(rgba), P).image) == [(255, 0, 0), (255, 255, 255), (127, 127, 127)]
    la = Image.new("LA", (1, 1), (0, 0))
    assert pixels(decode_image(encode(la), P).image) == [(255, 255, 255)]


def test_grayscale_and_palette_become_rgb() -> None:
    gray = Image.new("L", (2, 1))
    gray.putpixel((1, 0), 200)
    assert pixels(decode_image(encode(gray), P).image) == [(0, 0, 0), (200, 200, 200)]
    palette = picture().quantize(4)
    assert pixels(decode_image(encode(palette), P).image) == pixels(picture())


def test_content_hash_is_of_the_pixels_not_the_encoding() -> None:
    a = decode_image(encode(picture()), P)
    b = decode_image(encode(picture(), "WEBP", lossless=True), "input[0].content[0]")
    c = decode_image(encode(picture(seed=1)), P)
    d = decode_image(encode(picture((6, 8))), P)
    assert a.content_hash == b.content_hash and len(a.content_hash) == 64
    assert len({a.content_hash, c.content_hash, d.content_hash}) == 3


def _truncated() -> bytes:
    data = encode(picture((64, 64)))
    return data[: len(data) // 2]


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"><rect width="4" height="4"/></svg>'
BAD = [  # (name, data, words of the message)
    ("truncated png", _truncated(), "could not be decoded (corrupt or truncated"),
    ("corrupt", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "not an image in a supported format"),
    ("text", b"hello, this is not an image", "not an image in a supported format"),
    ("empty", b"", "not an image in a supported format"),
    ("svg", SVG, "not an image in a supported format"),
    ("tiff", encode(picture(), "TIFF"), "not an image in a supported format"),
    ("bmp", encode(picture(), "BMP"), "not an image in a supported format"),
    ("bomb, past Pillow's limit", png_header(100_000, 100_000), "more than the limit of 40000000 pixels"),
    ("bomb, past ours", png_header(8000, 6000), "8000 x 6000 = 48000000 pixels, more than the limit"),
]


@pytest.mark.parametrize(("data", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_images_are_a_400_naming_the_part(data: bytes, words: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        decode_image(data, P)
    assert err.value.param == P and err.value.status == 400
    assert err.value.message.startswith(f"'{P}': ") and words in err.value.message, err.value.message


def test_pixel_limit_is_a_parameter() -> None:
    data = encode(picture((20, 20)))
    assert decode_image(data, P, max_pixels=400).size == (20, 20)
    with pytest.raises(InvalidRequestError, match="20 x 20 = 400 pixels, more than the limit of 399"):
        decode_image(data, P, max_pixels=399)
