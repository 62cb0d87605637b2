"""proxy.media.fetch: data URLs, http(s) fetches under the policy (size, time, domains, redirects),
``file://`` only under the allowed folder; every failure a 400 naming the part."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from proxy.errors import InvalidRequestError
from proxy.media.fetch import MediaPolicy, image_bytes, load_images
from proxy.protocol.images import ImagePart
from proxy.settings import Settings

from .images import data_url, encode, picture

P = "messages[0].content[0]"
PNG = encode(picture())
RELEASE = threading.Event()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {"Content-Length": str(len(body))}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        match self.path:
            case "/img.png":
                self._send(200, PNG)
            case "/big":
                self._send(200, b"\0" * 2000)
            case "/big-unsized":
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                for _ in range(20):
                    self.wfile.write(b"\0" * 100)
            case "/slow":
                RELEASE.wait(10)
                self._send(200, PNG)
            case "/redirect":
                self._send(302, headers={"Location": "/img.png", "Content-Length": "0"})
            case "/redirect-host":
                away = f"http://localhost:{port}/img.png"
                self._send(302, headers={"Location": away, "Content-Length": "0"})
            case "/redirect-loop":
                self._send(302, headers={"Location": "/redirect-loop", "Content-Length": "0"})
            case "/redirect-ftp":
                self._send(302, headers={"Location": "ftp://127.0.0.1/x.png", "Content-Length": "0"})
            case _:
                self._send(404, b"no")


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        RELEASE.set()
        server.shutdown()
        server.server_close()


def fetch(url: str, policy: MediaPolicy | None = None) -> bytes:
    return asyncio.run(image_bytes(ImagePart(P, url), policy or MediaPolicy()))


def refused(url: str, policy: MediaPolicy | None = None) -> str:
    with pytest.raises(InvalidRequestError) as err:
        fetch(url, policy)
    assert err.value.param == P and err.value.message.startswith(f"'{P}': "), err.value.message
    return err.value.message


def test_data_urls() -> None:
    assert fetch(data_url(PNG)) == PNG
    assert fetch(data_url(PNG, "image/jpeg")) == PNG  # the declared type is not trusted; the bytes decide
    wrapped = data_url(PNG).replace(";base64,", ";base64,\n ")
    assert fetch(wrapped) == PNG
    assert "form 'data:image/<type>;base64,<data>'" in refused("data:image/png,rawbytes")
    assert "form 'data:image/<type>;base64,<data>'" in refused("data:image/png;base64")
    assert "media type 'text/plain' is not an image type" in refused("data:text/plain;base64,aGk=")
    assert "not valid base64" in refused("data:image/png;base64,%%%")
    assert "larger than the limit of 10 bytes" in refused(data_url(PNG), MediaPolicy(max_bytes=10))


def test_http_fetches(site: str) -> None:
    assert fetch(f"{site}/img.png") == PNG
    assert fetch(f"{site}/redirect") == PNG
    assert fetch(f"{site}/img.png", MediaPolicy(allowed_domains=("127.0.0.1",))) == PNG


@pytest.mark.parametrize(("path", "policy", "words"), [
    ("/missing", MediaPolicy(), "fetching the image failed: HTTP 404"),
    ("/big", MediaPolicy(max_bytes=1000), "larger than the limit of 1000 bytes"),
    ("/big-unsized", MediaPolicy(max_bytes=1000), "larger than the limit of 1000 bytes"),
    ("/img.png", MediaPolicy(allowed_domains=("example.com",)), "'127.0.0.1' is not one of --allowed-media"),
    ("/redirect-host", MediaPolicy(allowed_domains=("127.0.0.1",)), "host 'localhost' is not one of"),
    ("/redirect-loop", MediaPolicy(), "redirects more than 5 times"),
    ("/redirect-ftp", MediaPolicy(), "redirects to a URL that is not http(s)"),
    ("/slow", MediaPolicy(timeout_s=0.3), "took longer than 0.3 s"),
])
def test_http_failures_are_a_400(site: str, path: str, policy: MediaPolicy, words: str) -> None:
    assert words in refused(site + path, policy)


def test_unreachable_host_is_a_400() -> None:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: the connection is refused
        assert "fetching the image failed (ConnectError)" in refused(f"http://127.0.0.1:{port}/x.png")


def test_file_urls(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a b.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(allowed_local_path=str(allowed))
    assert fetch(f"file://{allowed}/a%20b.png", policy) == PNG
    assert "started without --allowed-local-media-path" in refused(f"file://{allowed}/a%20b.png")
    for outside in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png",
                    f"file://{allowed}/link.png"):
        assert "outside the folder --allowed-local-media-path allows" in refused(outside, policy)
    assert "cannot be read" in refused(f"file://{allowed}/missing.png", policy)
    assert "not one on host 'server'" in refused(f"file://server{allowed}/a%20b.png", policy)
    assert "larger than the limit of 10 bytes" in refused(
        f"file://{allowed}/a%20b.png", MediaPolicy(allowed_local_path=str(allowed), max_bytes=10))


def test_load_images_decodes_in_order_and_names_the_first_bad_part() -> None:
    parts = (ImagePart("a", data_url(PNG)), ImagePart("b", data_url(encode(picture(seed=1)))))
    loaded = asyncio.run(load_images(parts, MediaPolicy()))
    assert [im.param for im in loaded] == ["a", "b"] and loaded[0].content_hash != loaded[1].content_hash
    bad = (ImagePart("a", data_url(PNG)), ImagePart("b", "data:image/png;base64,AAAA"),
           ImagePart("c", "data:text/plain;base64,AAAA"))
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(load_images(bad, MediaPolicy()))
    assert err.value.param == "c"  # fetch errors come first (in order), then decoding ("b")
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(load_images(bad[:2], MediaPolicy()))
    assert err.value.param == "b" and "not an image in a supported format" in err.value.message


def test_policy_from_settings() -> None:
    settings = Settings(allowed_media_domains=("a.example",), allowed_local_media_path="/srv/media",
                        media_fetch_timeout_s=2.5)
    assert MediaPolicy.from_settings(settings) == MediaPolicy(("a.example",), "/srv/media", 2.5)
