"""report.html / compare.html: one self-contained file, checked as text and in headless Chromium.

The browser tests load the files from disk in Debian's ``chromium`` (``make test`` installs it
where missing) over the DevTools protocol (``tests/browser.py``): every plot must decode, no
request may leave the page, and a screenshot (and a printed PDF) stay in the run directory for a
human to look at.
"""

from __future__ import annotations

import base64
import math
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe import cli
from mismatch_probe.pipeline.publish import publish
from mismatch_probe.report.html import render_html
from mismatch_probe.report.plots import PLOTS
from mismatch_probe.rundir import load_report
from tests.browser import Browser, find_chromium
from tests.test_report_fixtures import Seq, make_run, mixed_seqs, uniform_run

# The fixture stores hold no train_entropy: no entropy plot is drawn (plots.NEEDS).
DRAWN = [name for name in PLOTS if name != "entropy"]

NO_BROWSER = (
    "chromium not found: `make test` installs Debian's chromium with apt-get "
    "(needs root and the apt mirrors); it could not be installed on this machine"
)
# A response whose worst token tries every way out of its table cell and its block.
HOSTILE = [
    "Hi",
    " <img src=x onerror=alert(1)>",
    "</details></table>",
    " ```",
    " a|b",
    "\x1b[31mred\x07",
    "\u202eevil",
]
HOSTILE_R = [0.0, 3.0, 0.01, -0.01, 0.02, -0.02, 0.01]  # the <img> token is the worst of all


def hostile_seq() -> Seq:
    lp = math.log(0.3)
    return Seq(HOSTILE, [lp] * 7, [lp + r for r in HOSTILE_R], [False] * 7)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    run = make_run(tmp_path_factory.mktemp("html") / "run", [*mixed_seqs(), hostile_seq()])
    return run, publish(*load_report(run))


class Outline(HTMLParser):
    """Headings, image sources, tags and attributes of an HTML document."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.images: list[str] = []
        self.tags: set[str] = set()
        self.attrs: set[str] = set()
        self._heading: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attrs.update(name for name, _ in attrs)
        if tag == "img":
            self.images.append(dict(attrs)["src"] or "")
        if re.fullmatch(r"h[1-6]", tag):
            self._heading = ["#" * int(tag[1]) + " "]

    def handle_endtag(self, tag: str) -> None:
        if re.fullmatch(r"h[1-6]", tag) and self._heading is not None:
            self.headings.append("".join(self._heading))
            self._heading = None

    def handle_data(self, data: str) -> None:
        if self._heading is not None:
            self._heading.append(data)


def outline(text: str) -> Outline:
    parser = Outline()
    parser.feed(text)
    return parser


def test_every_plot_is_embedded_and_nothing_is_fetched(rendered) -> None:
    run, paths = rendered
    assert paths["html"] == run / "report.html"
    text = paths["html"].read_text()
    page = outline(text)
    embedded = [base64.b64decode(src.split(",", 1)[1]) for src in page.images]
    assert all(src.startswith("data:image/png;base64,") for src in page.images)
    assert sorted(embedded) == sorted((run / "plots" / f"{n}.png").read_bytes() for n in DRAWN)
    assert "script" not in page.tags and "link" not in page.tags and "iframe" not in page.tags
    assert not {a for a in page.attrs if a.startswith("on")}  # no event handler anywhere
    assert not re.search(r"(src|href)=\"(https?:|//|file:)", text)
    assert "default-src 'none'; img-src data:" in text  # the browser refuses anything else


def test_same_sections_as_the_markdown(rendered) -> None:
    _, paths = rendered
    markdown = paths["report"].read_text()
    md_headings = [line for line in markdown.splitlines() if line.startswith("#")]
    assert outline(paths["html"].read_text()).headings == md_headings
    assert "<summary>Every metric (" in paths["html"].read_text()


def test_model_text_is_inert(rendered) -> None:
    _, paths = rendered
    text = paths["html"].read_text()
    assert "&lt;img src=x onerror=alert(1)&gt;" in text
    assert "&lt;/details&gt;&lt;/table&gt;" in text
    assert "<img src=x" not in text and "<script" not in text
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b[31mred\\x07" in text  # control characters shown as escapes
    assert text.count("</details>") == 1  # only the "every metric" block closes one


def test_raw_html_outside_the_allowed_tags_is_shown_as_text(tmp_path: Path) -> None:
    md = "a <img src=x onerror=alert(1)> <b>ok</b> &amp; &lt;\n\n<script>alert(2)</script>\n"
    text = render_html(md, tmp_path, "t")
    body = text.split("<body>")[1]
    assert "&lt;img src=x onerror=alert(1)&gt; <b>ok</b> &amp; &lt;" in body
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in body
    assert "<script" not in text and "<img" not in body


def test_only_the_pngs_handed_over_inside_the_report_directory_are_embedded(
    tmp_path: Path,
) -> None:
    """Images come from what the report wrote (handed over in memory), never from the disk: a
    PNG on disk that was not handed over is missing, as is one outside the report's directory."""
    (tmp_path / "inside").mkdir()
    png = (Path(__file__).parent.parent / "docs" / "report-probs.png").read_bytes()
    (tmp_path / "secret.png").write_bytes(png)
    (tmp_path / "inside" / "fake.png").write_text("not a png")
    (tmp_path / "inside" / "ok.png").write_bytes(png)
    (tmp_path / "inside" / "on-disk.png").write_bytes(png)
    images = {
        p.resolve(): p.read_bytes()
        for p in (tmp_path / "secret.png", tmp_path / "inside" / "fake.png")
    }
    images[(tmp_path / "inside" / "ok.png").resolve()] = png
    md = "\n\n".join(
        f"![{name}]({src})"
        for name, src in [
            ("up", "../secret.png"),
            ("abs", str(tmp_path / "secret.png")),
            ("web", "http://example.com/x.png"),
            ("gone", "missing.png"),
            ("fake", "fake.png"),
            ("disk", "on-disk.png"),
            ("ok", "ok.png"),
        ]
    )
    body = render_html(md, tmp_path / "inside", "t", images).split("<body>")[1]
    assert len(re.findall(r'class="missing"', body)) == 6
    assert body.count("<img ") == 1 and 'alt="ok"' in body
    assert "example.com" not in body and "secret" not in body


# --- in a real browser -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Any:
    binary = find_chromium()
    if binary is None:
        pytest.skip(NO_BROWSER)
    with Browser(binary) as b:
        yield b


IMAGES_JS = (
    "JSON.stringify(Array.from(document.images).map("
    "i => [i.getAttribute('alt'), i.complete, i.naturalWidth, i.naturalHeight]))"
)


def page_facts(b: Browser) -> dict[str, Any]:
    import json

    return {
        "images": json.loads(b.evaluate(IMAGES_JS)),
        "scripts": b.evaluate("document.scripts.length"),
        "h2": b.evaluate("Array.from(document.querySelectorAll('h2')).map(h => h.textContent)"),
        "text": b.evaluate("document.body.innerText"),
        "width": b.evaluate("document.documentElement.scrollWidth"),
    }


def test_report_in_chromium(rendered, browser: Browser) -> None:
    run, paths = rendered
    url = paths["html"].resolve().as_uri()
    browser.open(url)
    facts = page_facts(browser)
    assert len(facts["images"]) == len(DRAWN)
    for alt, complete, width, height in facts["images"]:
        assert complete and (width, height) == (715, 440), alt  # decoded, at natural size
    leaving = [u for u in browser.requests() if u != url and not u.startswith("data:")]
    assert leaving == []
    assert facts["scripts"] == 0
    markdown = paths["report"].read_text()
    assert facts["h2"] == [line[3:] for line in markdown.splitlines() if line.startswith("## ")]
    assert "<img src=x onerror=alert(1)>" in facts["text"]  # model text shown, as text
    assert facts["width"] <= 1366  # no horizontal scrolling on a laptop screen
    folded = "document.querySelector('details table').checkVisibility()"
    assert browser.evaluate(folded) is False  # every metric: folded on screen ...
    browser.call("Emulation.setEmulatedMedia", session=True, media="print")
    try:
        assert browser.evaluate(folded) is True  # ... and printed
    finally:
        browser.call("Emulation.setEmulatedMedia", session=True, media="")
    shot = browser.screenshot(run / "report-screenshot.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert browser.pdf(run / "report.pdf").read_bytes()[:5] == b"%PDF-"
    print(f"screenshot for a human: {shot}")


def test_the_browser_checks_can_fail(tmp_path: Path, browser: Browser) -> None:
    """A page that fetches and an image that does not decode are both caught."""
    page = tmp_path / "bad.html"
    page.write_text(
        '<img alt="net" src="http://127.0.0.1:9/x.png">'
        '<img alt="broken" src="data:image/png;base64,AAAA">'
    )
    browser.open(page.resolve().as_uri())
    assert "http://127.0.0.1:9/x.png" in browser.requests()
    assert [w for _, _, w, _ in page_facts(browser)["images"]] == [0, 0]


def test_compare_html_in_chromium(
    tmp_path: Path, browser: Browser, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    runs = [uniform_run(tmp_path / n, r, [4, 6]) for n, r in (("a", 0.01), ("b", 0.03))]
    out = tmp_path / "cmp"
    monkeypatch.setattr(sys, "argv", ["probe", "compare", *map(str, runs), "--out", str(out)])
    cli.main()
    assert "compare.html" in capsys.readouterr().out
    url = (out / "compare.html").resolve().as_uri()
    browser.open(url)
    images = page_facts(browser)["images"]
    assert len(images) == 3 and all(w > 0 for _, _, w, _ in images)
    assert [u for u in browser.requests() if u != url and not u.startswith("data:")] == []
    browser.screenshot(out / "compare-screenshot.png")
