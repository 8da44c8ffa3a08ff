"""``report.html`` / ``compare.html``: one self-contained file, rendered from the Markdown report.

The HTML is the report's Markdown (``report.md``, ``compare.md``) rendered by markdown-it-py
(CommonMark + GFM tables), so every section of the Markdown, including one added later, is in the
HTML with no second renderer to keep in step. What this module adds:

* each ``![title](plots/x.png)`` becomes an ``<img>`` whose ``src`` is the PNG as a base64
  ``data:`` URI (only the PNGs the report wrote, handed over in memory, inside the report's
  directory; anything else is shown as a "plot missing" note, never fetched or read);
* raw HTML in the Markdown passes only when it is one of ``ALLOWED_TAGS`` (``<b>``,
  ``<details>``, ``<summary>`` and a few more plain tags, no attributes); any other tag is shown
  as text (a section that needs another tag adds it there). Model text is already
  entity-escaped by ``markdown.escape``: this is a second fence;
* control characters (C0/C1 except newline and tab) and bidi overrides that reach the HTML are
  shown as visible symbols (``sections.visible``), so they can neither break the file nor reorder
  what is displayed;
* inline CSS (screen and print), no JavaScript, no font or stylesheet to fetch, and a
  Content-Security-Policy that forbids every request but ``data:`` images.
"""

from __future__ import annotations

import base64
import html
import re
import struct
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.report.sections import visible

ALLOWED_TAGS = frozenset(
    f"<{slash}{tag}>"
    for tag in ("b", "i", "code", "sub", "sup", "details", "summary")
    for slash in ("", "/")
) | {"<br>"}
CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; "
    "form-action 'none'"
)
_TAG_OR_ENTITY = re.compile(
    r"<[^<>]*>|&(?:#[0-9]{1,7}|#x[0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});"
)
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

STYLE = """
:root { color-scheme: light; --line: #d0d7de; --muted: #57606a; --bg2: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0 auto; padding: 1.2rem 1.5rem 3rem; max-width: 1200px; color: #1f2328;
  font: 15px/1.5 -apple-system, "Segoe UI", "Noto Sans", "DejaVu Sans", Helvetica, Arial,
  sans-serif; background: #fff; }
h1 { font-size: 1.6rem; border-bottom: 1px solid var(--line); padding-bottom: .3rem; }
h2 { font-size: 1.3rem; margin-top: 2rem; border-bottom: 1px solid var(--line);
  padding-bottom: .2rem; }
h3 { font-size: 1.1rem; margin-top: 1.4rem; }
table { border-collapse: collapse; margin: .6rem 0 1rem; max-width: 100%; display: block;
  overflow-x: auto; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid var(--line); padding: .25rem .6rem; vertical-align: top; }
th { background: var(--bg2); text-align: left; }
tr:nth-child(2n) td { background: #fafbfc; }
td { overflow-wrap: break-word; }
td[style*="right"] { white-space: nowrap; }
code { font: .88em/1.4 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace;
  background: var(--bg2); padding: .1em .3em; border-radius: 4px; }
pre { background: var(--bg2); padding: .8rem; overflow-x: auto; border-radius: 6px; }
pre code { padding: 0; background: none; }
blockquote { margin: .6rem 0; padding: .3rem 1rem; border-left: 4px solid #d4a72c;
  background: #fff8c5; }
img { max-width: 100%; height: auto; border: 1px solid var(--line); border-radius: 4px; }
p:has(> img) { display: inline-block; margin: 0 .6rem .6rem 0; vertical-align: top;
  max-width: 100%; }
@media (min-width: 1100px) { p:has(> img) { width: 49%; margin-right: .5%; } }
.missing { color: #cf222e; font-style: italic; }
th code, td code { white-space: nowrap; overflow-wrap: normal; }
.verdict { font-weight: 700; padding: 0 .3em; border-radius: 3px; white-space: nowrap; }
.verdict.pass { color: #1a7f37; background: #dafbe1; }
.verdict.fail { color: #cf222e; background: #ffebe9; }
.verdict.na { color: var(--muted); }
details { margin: .6rem 0 1rem; }
summary { cursor: pointer; font-weight: 600; }
@media print {
  body { max-width: none; padding: 0; font-size: 11pt; }
  h2, h3 { break-after: avoid; }
  img, tr, pre, blockquote { break-inside: avoid; }
  table { display: table; overflow: visible; }
  details > *, details::details-content { display: block; content-visibility: visible; }
  summary { list-style: none; }
}
"""


def _sanitize_raw_html(raw: str) -> str:
    """Raw HTML from the Markdown: allowed tags and character references pass, everything else
    is escaped (``<img onerror=...>`` becomes visible text)."""
    out, last = [], 0
    for match in _TAG_OR_ENTITY.finditer(raw):
        out.append(html.escape(raw[last : match.start()], quote=False))
        piece = match.group(0)
        keep = piece.startswith("&") or piece.lower() in ALLOWED_TAGS
        out.append(piece if keep else html.escape(piece, quote=False))
        last = match.end()
    out.append(html.escape(raw[last:], quote=False))
    return "".join(out)


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk, None if ``data`` is not a PNG."""
    if len(data) < 24 or not data.startswith(_PNG_MAGIC):
        return None
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def data_uri(
    base: Path, src: str, images: Mapping[Path, bytes]
) -> tuple[str, tuple[int, int]] | None:
    """The PNG ``base/src`` of ``images`` (``{resolved path: bytes}``, the plots the report
    wrote) as ``(data: URI, size)``; None unless ``src`` is a relative path inside ``base`` to
    one of them that is a PNG."""
    if not src or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", src) or src.startswith(("/", "\\")):
        return None
    root = base.resolve()
    path = (root / src).resolve()
    data = images.get(path)
    if not path.is_relative_to(root) or data is None:
        return None
    size = png_size(data)
    if size is None:
        return None
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii"), size


def _render_image(
    base: Path, images: Mapping[Path, bytes], tokens: list, idx: int, options: Any, env: Any
) -> str:
    token = tokens[idx]
    alt = html.escape(token.content or "")
    found = data_uri(base, token.attrGet("src") or "", images)
    if found is None:
        return f'<span class="missing">[plot missing: {alt}]</span>'
    uri, (width, height) = found
    return f'<img src="{uri}" alt="{alt}" title="{alt}" width="{width}" height="{height}">'


def _markdown_parser(base: Path, images: Mapping[Path, bytes]) -> Any:
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": True, "linkify": False, "typographer": False})
    md.enable(["table", "strikethrough"])
    rules: dict[str, Any] = md.renderer.rules  # type: ignore[attr-defined]  # RendererHTML
    rules["image"] = partial(_render_image, base, images)
    rules["html_inline"] = rules["html_block"] = _render_raw_html
    return md


def _render_raw_html(tokens: list, idx: int, options: Any, env: Any) -> str:
    return _sanitize_raw_html(tokens[idx].content)


def _visible_controls(text: str) -> str:
    """Control characters in rendered HTML shown as symbols, line by line (``visible`` would
    also fold the newlines and tabs, which HTML needs)."""
    return "\n".join(
        "\t".join(visible(part) for part in line.split("\t")) for line in text.split("\n")
    )


# The Markdown's verdict marks (``markdown.VERDICT_MARK``) -> words with a class and a colour:
# a browser without an emoji font shows the emoji as empty boxes, the words read everywhere.
VERDICT_HTML = {
    "✅ PASS": '<span class="verdict pass">PASS</span>',
    "❌ FAIL": '<span class="verdict fail">FAIL</span>',
    "➖ n/a": '<span class="verdict na">n/a</span>',
}


def _verdict_words(body: str) -> str:
    for mark, span in VERDICT_HTML.items():
        body = body.replace(mark, span)
    return body


def render_html(
    markdown: str, base: Path, title: str, images: Mapping[Path, bytes] | None = None
) -> str:
    """The whole HTML document of ``markdown``; images are resolved against ``base`` and
    embedded from ``images`` (``report.png.kept``: the PNGs the report wrote)."""
    body = _verdict_words(_markdown_parser(Path(base), images or {}).render(markdown))
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<meta name="referrer" content="no-referrer">\n'
        f"<title>{html.escape(visible(title))}</title>\n"
        f"<style>{STYLE}</style>\n</head>\n<body>\n"
        f"{_visible_controls(body)}"
        "</body>\n</html>\n"
    )


def write_html(
    markdown: str, markdown_path: Path, title: str, images: Mapping[Path, bytes]
) -> Path:
    """Write the HTML of ``markdown`` beside its Markdown file (``report.md`` ->
    ``report.html``), images resolved against that file's directory; returns the path."""
    path = markdown_path.with_suffix(".html")
    store.write_text(path, render_html(markdown, markdown_path.parent, title, images))
    return path
