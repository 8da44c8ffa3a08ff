"""The one exception type the library raises for bad input.

The CLI turns a ``ProbeError`` into a single line on stderr and exit code 2, in one place
(``mismatch_probe.cli.main``). Library code never prints or exits.
"""

import re


class ProbeError(Exception):
    """Bad input or an unsupported request, explained in one line."""


# Control characters that must never reach a terminal or a report raw: C0 and C1 controls, DEL,
# and the bidirectional overrides and isolates that reorder what a reader sees.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(ch: str) -> str:
    return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"


def printable(text: str, keep: str = "") -> str:
    """``text`` with every control character (but those in ``keep``) written as an escape,
    ``\\x1b`` or ``\\u202e``: model text or a file name can neither colour the screen, move the
    cursor, nor reorder a line."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: m.group() if m.group() in keep else _escape(m.group()), text)
