"""The chat page's routes and files, without a browser: ``GET /``, ``/ui/<file>``, the CSP, ``--no-ui``,
package data, and that the page's script and markup agree on element ids."""

from __future__ import annotations

import asyncio
import re
from fnmatch import fnmatch
from pathlib import Path

import httpx
import pytest

from proxy.api import ui
from proxy.api.app import create_app
from proxy.cli import build_parser, settings_from
from proxy.settings import Settings

UI_DIR = Path(ui.__file__).parent
REPO = Path(__file__).resolve().parents[2]


def get(path: str, **settings: object) -> httpx.Response:
    async def main() -> httpx.Response:
        app = create_app(Settings(**settings))  # static routes: no model is loaded (no lifespan)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as client:
            return await client.get(path)

    return asyncio.run(main())


@pytest.mark.parametrize(("path", "media_type", "name"), [
    ("/", "text/html; charset=utf-8", "index.html"),
    ("/ui/chat.js", "text/javascript; charset=utf-8", "chat.js"),
    ("/ui/chat.css", "text/css; charset=utf-8", "chat.css"),
])
def test_page_files_are_served_with_a_strict_csp(path: str, media_type: str, name: str) -> None:
    r = get(path)
    assert r.status_code == 200
    assert r.headers["content-type"] == media_type
    assert r.content == (UI_DIR / name).read_bytes()
    assert r.headers["content-security-policy"] == (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"


@pytest.mark.parametrize(
    "path", ["/ui/__init__.py", "/ui/index.htm", "/ui/..%2F__init__.py", "/ui/", "/index.html"]
)
def test_other_paths_are_404_error_objects(path: str) -> None:
    r = get(path)
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/", "/ui/chat.js"])
def test_no_ui_turns_the_page_off(path: str) -> None:
    r = get(path, ui=False)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == f"No route for GET {path}."


def test_cli_flag_and_environment() -> None:
    def parse(argv: list[str], env: dict[str, str] | None = None) -> Settings:
        return settings_from(build_parser().parse_args(["serve", *argv]), env or {})

    assert parse([]).ui is True
    assert parse(["--no-ui"]).ui is False
    assert parse([], {"STREAMPROXY_UI": "0"}).ui is False
    assert parse(["--ui"], {"STREAMPROXY_UI": "false"}).ui is True  # the command line wins


def test_the_page_is_self_contained() -> None:
    html = (UI_DIR / "index.html").read_text(encoding="utf-8")
    # no inline script or style (the CSP would block them), only our own files
    assert re.findall(r"<script[^>]*>", html) == ['<script src="/ui/chat.js" defer>']
    assert "<style" not in html and not re.search(r"\s(style|on[a-z]+)\s*=", html)
    for name in ui.MEDIA_TYPES:
        text = (UI_DIR / name).read_text(encoding="utf-8")
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/|@import|\burl\(", text), name
    js = (UI_DIR / "chat.js").read_text(encoding="utf-8")
    for unsafe in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert unsafe not in js, unsafe


def test_every_element_id_the_script_uses_is_in_the_page() -> None:
    html = (UI_DIR / "index.html").read_text(encoding="utf-8")
    js = (UI_DIR / "chat.js").read_text(encoding="utf-8")
    used = set(re.findall(r"\$\(\"([a-z-]+)\"\)", js))
    assert used and used <= set(re.findall(r'\bid="([a-z-]+)"', html)), used


def test_package_data_ships_every_page_file() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    globs = re.findall(
        r'"([^"]+)"', re.search(r'^"proxy\.api\.ui" = \[(.*)\]$', section, re.MULTILINE).group(1)
    )
    files = {p.name for p in UI_DIR.iterdir() if p.is_file() and p.suffix != ".py"}
    assert files == set(ui.MEDIA_TYPES)
    assert all(any(fnmatch(f, g) for g in globs) for f in files)
