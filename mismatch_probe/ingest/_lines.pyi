"""Types of the compiled JSONL reader (``_lines.c``; its header says what it accepts)."""

INT: int
INT_LIST: int
BOOL_LIST: int
FLOAT_LIST: int
ABSENT: int
FLOAT: int

def columns(
    data: bytes, fields: tuple[tuple[str, int, int], ...]
) -> tuple[int, dict[str, tuple[bytes, bytes | None]]] | None: ...
