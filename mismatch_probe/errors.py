"""The one exception type the library raises for bad input.

The CLI turns a ``ProbeError`` into a single line on stderr and exit code 2, in one place
(``mismatch_probe.cli.main``). Library code never prints or exits.
"""


class ProbeError(Exception):
    """Bad input or an unsupported request, explained in one line."""


# Control characters that must never reach a terminal or a report raw: C0 and C1 controls, DEL,
# and the bidirectional overrides and isolates that reorder what a reader sees.
_BIDI = {*range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def _is_control(ch: str) -> bool:
    code = ord(ch)
    return code < 0x20 or 0x7F <= code < 0xA0 or code in _BIDI


def printable(text: str, keep: str = "") -> str:
    """``text`` with every control character (but those in ``keep``) written as an escape,
    ``\\x1b`` or ``\\u202e``: model text or a file name can neither colour the screen, move the
    cursor, nor reorder a line."""
    if not any(_is_control(ch) and ch not in keep for ch in text):
        return text
    return "".join(
        (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        if _is_control(ch) and ch not in keep
        else ch
        for ch in text
    )
