"""The compiled JSONL reader (``mismatch_probe/ingest/_lines.c``, ``jsonl.read_columns``)
against Python's ``json``, what the reference readers run: floats bit for bit (the shortest
reprs of float64 and float32 values, long and short decimals, exponents, decimals next to the
halfway points between two doubles), every line it accepts is one ``json`` accepts with the
same values (known cases and random corruptions of a line), and what it must leave to the
slower readers it leaves."""

from __future__ import annotations

import json
import math
import random
import struct
from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.ingest import jsonl

FIELDS = {"id": "int", "t": "int_list", "m": "bool_list", "x": "float_list", "s": "absent"}


def test_the_reader_is_built() -> None:
    """``make install`` compiles it (the package installs without it where no C compiler is:
    this machine has one)."""
    from mismatch_probe.ingest import _lines  # noqa: F401


def _columns(tmp: Path, text: bytes, fields: dict[str, str] = FIELDS) -> dict[str, Any] | None:
    file = tmp / "f.jsonl"
    file.write_bytes(text)
    found = jsonl.read_columns(file, fields)
    assert _same(found, jsonl.parse_columns(text, fields))
    return found


def _same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(
        a[k][0].tobytes() == b[k][0].tobytes() and (a[k][1] is None) == (b[k][1] is None) for k in a
    )


def _bits(values: Any) -> bytes:
    return np.asarray(values, np.float64).tobytes()


def _reprs(rng: random.Random, n: int) -> dict[str, list[str]]:
    def decimal() -> str:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 25)))
        cut = rng.randint(0, len(digits))
        text = str(int(digits[:cut] or "0")) + ("." + digits[cut:] if digits[cut:] else "")
        if rng.random() < 0.3:
            text += rng.choice("eE") + rng.choice(["", "+", "-"]) + str(rng.randint(0, 40))
        return rng.choice(["", "-"]) + text

    def halfway() -> str:  # a decimal cut from the exact midpoint of two adjacent doubles
        x = rng.uniform(1e-3, 100.0)
        with localcontext() as ctx:
            ctx.prec = 80
            text = format((Decimal(x) + Decimal(math.nextafter(x, math.inf))) / 2, "f")
        return text[: rng.randint(18, min(len(text), 40))]

    def near_two_53() -> str:  # mantissas about 2^53, where the fast path hands over
        digits = str(2**53 + rng.randint(-3, 3))
        cut = rng.randint(1, len(digits))
        text = digits[:cut] + ("." + digits[cut:] if digits[cut:] else "")
        return rng.choice(["", "-"]) + text

    def leading_zeros() -> str:  # 0.000ddd: up to and past the fast path's 19 digits
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 17)))
        return rng.choice(["", "-"]) + "0." + "0" * rng.randint(0, 6) + digits

    def float32() -> str:
        return repr(struct.unpack("f", struct.pack("f", rng.uniform(-30.0, 0.0)))[0])

    return {
        "float64 reprs": [repr(rng.uniform(-30.0, 0.0)) for _ in range(n)],
        "float32 reprs": [float32() for _ in range(n)],
        "magnitudes": [repr(-(10 ** rng.uniform(-30, 3))) for _ in range(n)],
        "decimals": [decimal() for _ in range(n)],
        "near halfway": [halfway() for _ in range(n)],
        "rounded": [f"{rng.uniform(-30.0, 0.0):.6f}" for _ in range(n)],
        "about 2^53": [near_two_53() for _ in range(n)],
        "leading zeros": [leading_zeros() for _ in range(n)],
    }


@pytest.mark.parametrize("kind", list(_reprs(random.Random(0), 1)))
def test_floats_are_pythons_to_the_last_bit(kind: str, tmp_path: Path) -> None:
    numbers = _reprs(random.Random(kind), 40_000)[kind]
    line = '{"id": 1, "t": [], "m": [], "x": [' + ", ".join(numbers) + "]}\n"
    found = _columns(tmp_path, line.encode())
    assert found is not None
    assert _bits(found["x"][0]) == _bits([float(v) for v in json.loads(line)["x"]])


ACCEPTED = {
    "spaces and tabs": b' \t{ "id" :1 ,"t":[ 1 ,2 ],\t"m":[true , false],"x":[ -0.5 , 1e-3 ] } \n',
    "integer minus zero": b'{"id": 0, "t": [-0], "m": [], "x": [-0, 0, -0.0, -0e3, 5, -7]}\n',
    "nulls": b'{"id": -3, "t": [], "m": [], "x": [null, -1.25, null]}\n',
    "no last newline": b'{"id": 1, "t": [2], "m": [true], "x": [0.5]}\n'
    b'{"id": 2, "t": [3], "m": [false], "x": [0.25]}',
    "skipped fields": '{"u": {"a": [1, {"b": null}], "c": "\\u00e9\\n\\"q\\"\\\\/"}, "id": 1, '
    '"t": [], "w": "ünïcødé 𝄞 ✓", "m": [], "v": [true, false, null, -1.5e+300, 0], '
    '"x": [], "z": {}}\n'.encode(),
    "non-finite": b'{"id": 1, "t": [], "m": [], "x": [NaN, Infinity, -Infinity, 1e999, -1e400], '
    b'"v": -Infinity, "w": [NaN, {"a": Infinity}]}\n',
    "an exponent past the scanner's bound": b'{"id": 1, "t": [], "m": [], "x": [0.'
    + b"0" * 99_999
    + b"1e1000000000, -0."
    + b"0" * 99_999
    + b"5e99998]}\n",  # inf, then -0.05
    "large integers": b'{"id": 999999999999999999, "t": [-999999999999999999], "m": [], '
    b'"x": [123456789012345678901234567890, 1e308]}\n',
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_what_it_reads_is_what_json_reads(case: str, tmp_path: Path) -> None:
    text = ACCEPTED[case]
    found = _columns(tmp_path, text)
    assert found is not None
    _assert_as_json(found, text)


def _assert_as_json(found: dict[str, Any], text: bytes) -> None:
    rows = [json.loads(line) for line in text.decode().split("\n") if line]
    assert found["id"][0].tolist() == [r["id"] for r in rows] and found["id"][1] is None
    for name in ("t", "m", "x"):
        values, offsets = found[name]
        assert offsets.tolist() == np.cumsum([0] + [len(r[name]) for r in rows]).tolist()
        expected = [v for r in rows for v in r[name]]
        if name == "x":
            assert _bits(values) == _bits([math.nan if v is None else float(v) for v in expected])
        else:
            assert values.tolist() == expected and values.dtype == jsonl.KINDS[
                {"t": "int_list", "m": "bool_list"}[name]][1]  # fmt: skip


LEFT = {  # what Python's json refuses, reads otherwise, or what another reader must decide
    "leading zero": b'"x": [01]',
    "two zeros": b'"x": [00]',
    "a negative leading zero": b'"x": [-01]',
    "zero and a bare point": b'"x": [0.]',
    "minus zero and a bare point": b'"x": [-0.]',
    "twenty digits": b'"x": [], "t": [12345678901234567890]',
    "bare point": b'"x": [1.]',
    "no integer part": b'"x": [.5]',
    "bare minus": b'"x": [-]',
    "bare exponent": b'"x": [1e]',
    "plus sign": b'"x": [+1]',
    "trailing comma": b'"x": [1,]',
    "a number then a letter": b'"x": [1x]',
    "an integer json's int() may refuse": b'"x": [], "v": -' + b"9" * 4301,
    "-NaN": b'"x": [-NaN]',
    "Inf": b'"x": [Inf]',
    "nan": b'"x": [nan]',
    "+Infinity": b'"x": [+Infinity]',
    "NaN in an int list": b'"x": [], "t": [NaN]',
    "Infinity in a bool list": b'"x": [], "m": [Infinity]',
    "NaN then a letter": b'"x": [NaNa]',
    "a float in an int list": b'"x": [], "t": [1.0]',
    "a number in a bool list": b'"x": [], "m": [1]',
    "null in an int list": b'"x": [], "t": [null]',
    "an int beyond int64": b'"x": [], "t": [9223372036854775808]',
    "null for a list": b'"x": null',
    "a named field twice": b'"x": [], "x": [1.0]',
    "the absent field": b'"x": [], "s": "a"',
    "an escaped key": b'"x": [], "\\u0061": 1',
    "a control character": b'"x": [], "v": "a\tb"',
    "a bad escape": b'"x": [], "v": "a\\xb"',
    "a short unicode escape": b'"x": [], "v": "\\u00e"',
    "an overlong UTF-8": b'"x": [], "v": "\xc0\x80"',
    "a UTF-8 surrogate": b'"x": [], "v": "\xed\xa0\x80"',
    "beyond U+10FFFF": b'"x": [], "v": "\xf4\x90\x80\x80"',
    "a cut UTF-8": b'"x": [], "v": "\xe2\x82"',
    "latin-1": b'"x": [], "v": "caf\xe9"',
    "an unclosed string": b'"x": [], "v": "abc',
    "deep nesting": b'"x": [], "v": ' + b"[" * 70 + b"]" * 70,
    "a single quote": b"\"x\": [], 'v': 1",
    "true misspelt": b'"x": [], "m": [tru]',
}
LINE = b'{"id": 1, "t": [1], "m": [true], %s}\n'


@pytest.mark.parametrize("case", list(LEFT))
def test_what_it_leaves_to_the_slower_readers(case: str, tmp_path: Path) -> None:
    text = LINE.replace(b'"x": [], ', b"") % LEFT[case]
    assert _columns(tmp_path, text) is None


@pytest.mark.parametrize(
    "text",
    [
        b"",  # no line
        b"\n" + LINE % b'"x": []',  # a blank line
        LINE % b'"x": []' + b"  \n",  # a line of spaces
        (LINE % b'"x": []').replace(b"\n", b"\r\n"),  # "\r"
        b"\xef\xbb\xbf" + LINE % b'"x": []',  # a byte-order mark
        (LINE % b'"x": []').replace(b"}\n", b'} {"id": 2}\n'),  # two objects on one line
        b"[1, 2]\n",  # not an object
        b'{"id": 1, "t": [1], "m": [true]}\n',  # a missing field
    ],
)
def test_lines_the_reference_reader_must_number_or_refuse(text: bytes, tmp_path: Path) -> None:
    assert _columns(tmp_path, text) is None


def test_a_corrupted_line_is_refused_or_read_as_json_reads_it(tmp_path: Path) -> None:
    """Random byte edits of a valid line: wherever the reader accepts the result, ``json``
    accepts it too and gives the same values."""
    rng = random.Random(7)
    base = (
        b'{"id": 12, "t": [1, 22, 333], "m": [true, false, true], "v": {"a": "b\\n", "c": '
        b'[null, 1.5e-3]}, "x": [-0.125, 3.0e2, -7, null], "w": "\xc3\xa9t\xc3\xa9"}'
    )
    alphabet = b' \t,:[]{}"\\-+.eE0123456789truefalsnxu\xc3\xa9\x80'
    accepted = 0
    for _ in range(20_000):
        line = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(line))
            edit = rng.choice(["drop", "insert", "replace"])
            byte = alphabet[rng.randrange(len(alphabet))]
            if edit == "drop":
                del line[at]
            elif edit == "insert":
                line.insert(at, byte)
            else:
                line[at] = byte
        text = bytes(line) + b"\n"
        found = jsonl.parse_columns(text, FIELDS)
        if found is None:
            continue
        accepted += 1
        _assert_as_json(found, text)  # json.loads raises where it refuses the line
    assert accepted > 500  # the edits that keep a line valid are read, not all refused


def test_files_parse_on_threads_at_once(tmp_path: Path) -> None:
    """The reader releases the interpreter lock: files read on threads at once give each
    file's own values (slow-path floats, which take the lock back, included)."""
    from concurrent.futures import ThreadPoolExecutor

    files = []
    for k in range(8):
        numbers = [repr(-(10 ** random.Random(k).uniform(-30, 3))) for _ in range(20_000)]
        numbers += ["1.00000000000000000000000000001", "2.5e-300"]
        file = tmp_path / f"{k}.jsonl"
        file.write_text(f'{{"id": {k}, "t": [], "m": [], "x": [{", ".join(numbers)}]}}\n')
        files.append((file, [float(v) for v in numbers]))
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda f: jsonl.read_columns(f[0], FIELDS), files))
    for columns, (_, expected) in zip(found, files, strict=True):
        assert columns is not None and _bits(columns["x"][0]) == _bits(expected)
