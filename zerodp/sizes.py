"""Byte sizes and counts, read from the command line and written for people: the one place for both.

    parse_size("5GB") == 5_000_000_000         parse_size("5GiB") == 5 * 2**30
    parse_count("7B") == 7_000_000_000         parse_count("abc") is None
    format_bytes(1536) == "1.50 KiB"           decimal_size(12_890_000) == "12.89 MB"
    format_count(3_400_000) == "3.4M"          format_megabytes(1_234_567) == "1.23"

Two conventions, each where its users meet it:
- powers of 1024 (KiB, MiB, GiB): `format_bytes`, for the memory ledger and the step line, since an
  allocator's blocks and a device's memory come in them;
- powers of 1000 (kB, MB, GB): `decimal_size` and `format_megabytes`, as the ZeRO paper, `zerodp
  estimate`, `zerodp plan` and `zerodp compare` give bytes; `parse_size` reads both spellings
  (5GB = 5 * 10**9, 5GiB = 5 * 2**30), as Hugging Face's max_shard_size does.
A count (parameters, ranks, tokens) is not a size: `parse_count` reads 7B as seven billion, not
seven bytes. Parsing is exact decimal arithmetic: "1.001GB" is 1_001_000_000 bytes, not the
1_000_999_999 a float would give. Nothing here imports the rest of zerodp (the floor layer).
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal, InvalidOperation

_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
               "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_LARGEST_COUNT = 10**18  # past any parameter, rank or token count; keeps int() of a typo like 1e400 cheap
_LARGEST_SIZE = 2**80  # a yottabyte: past any memory or disk, below what a typo like 1e400GB asks for


def _decimal(text: str) -> Decimal | None:
    """`text` as an exact finite decimal number, or None when it is not one ("abc", "inf", "nan")."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def parse_size(text: str, what: str = "--max-shard-size") -> int:
    """A byte size as Hugging Face and DeepSpeed write them: "5GB" and "5G" (10**9 bytes each),
    "5GiB" (2**30), "500MB", "1.5GB", or a plain number of bytes; units are case-insensitive and a
    fraction of a byte is dropped. `what` (default "--max-shard-size") names the flag or variable
    the text came from in the ValueError raised for anything else: a non-positive size, an unknown
    unit, or one past 2**80 bytes."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].upper()
    value = _decimal(number)
    if unit not in _SIZE_UNITS or value is None or not 0 < value * _SIZE_UNITS[unit] <= _LARGEST_SIZE:
        raise ValueError(f"{what} {text!r}: expected a size such as 5GB, 5G, 5GiB, 500MB or a number "
                         "of bytes (KB/MB/GB = powers of 1000, KiB/MiB/GiB = powers of 1024, as in Hugging Face)")
    return int(value * _SIZE_UNITS[unit])


def parse_count(text: str) -> int | None:
    """A whole count of parameters, ranks, samples or tokens: "7.5e9", "7B", "350M", "1.3b", "2k",
    "125000000" (K, M, B, T: powers of 1000, case-insensitive), in exact decimal. None when the text
    is not a whole number from 1 to 10**18: the caller names its flag in the message."""
    body, suffix = (text[:-1], text[-1].upper()) if text[-1:].upper() in ("K", "M", "B", "T") else (text, "")
    value = _decimal(body)
    if value is None:
        return None
    value *= _COUNT_SUFFIXES[suffix]
    return int(value) if 1 <= value < _LARGEST_COUNT and value == value.to_integral_value() else None


def _scaled(n: float, base: int, units: tuple[str, ...], decimals: Callable[[float], int]) -> str:
    # Round first, then decide the unit: 1023.999 KiB must print as "1.00 MiB", not "1024.0 KiB".
    sign = "-" if n < 0 else ""
    value = abs(n)
    for power, unit in enumerate(units):
        scaled = value / base**power
        places = decimals(scaled)
        if round(scaled, places) < base or power == len(units) - 1:
            return f"{sign}{scaled:.{places}f}{unit}"
    raise AssertionError(f"unreachable: no unit for {n}")


def format_bytes(n: int) -> str:
    """A byte count for people: "512 B", "1.50 KiB", "12.3 MiB", "2.00 GiB" (powers of 1024).

    Below 10 units two decimals are shown, above one; beyond GiB the unit is TiB.
    """
    if abs(n) < 1024:
        return f"{int(n)} B"
    units = ("", " KiB", " MiB", " GiB", " TiB")
    return _scaled(n, 1024, units, lambda scaled: 2 if round(scaled, 2) < 10 else 1)


def format_count(n: int) -> str:
    """A count for people, one decimal, powers of 1000: 999 -> "999", 1234 -> "1.2K",
    3_400_000 -> "3.4M", 5.6e9 -> "5.6B", then "T". Used for parameter and token counts."""
    if abs(n) < 1000:
        return str(int(n))
    return _scaled(n, 1000, ("", "K", "M", "B", "T"), lambda scaled: 1)


def decimal_size(num_bytes: int) -> str:
    """Bytes in powers of 1000, as the ZeRO paper and `zerodp estimate` give them: "12.89 MB", "16.64 GB";
    below 1000, the number itself: "999 B"."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def format_megabytes(num_bytes: float | None, places: int = 2) -> str:
    """Bytes as a number of megabytes (10**6) for a table whose header names the unit: "12.35" with
    the default two decimal `places`; "-" for None (not measured)."""
    return "-" if num_bytes is None else f"{num_bytes / 1e6:.{places}f}"
