"""The one exception type the library raises for bad input.

The CLI turns a ``ProbeError`` into a single line on stderr and exit code 2, in one place
(``mismatch_probe.cli.main``). Library code never prints or exits.
"""


class ProbeError(Exception):
    """Bad input or an unsupported request, explained in one line."""
