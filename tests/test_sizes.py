"""zerodp/sizes.py: every byte size and count zerodp reads from a flag or writes for people (pure, fast)."""

from __future__ import annotations

import pytest

from zerodp.sizes import decimal_size, format_bytes, format_count, format_megabytes, parse_count, parse_size

SIZE_SPELLINGS = "expected a size such as 5GB, 5G, 5GiB, 500MB or a number of bytes (KB/MB/GB = powers of 1000, " \
                 "KiB/MiB/GiB = powers of 1024, as in Hugging Face)"


@pytest.mark.parametrize("text,size", [
    ("5GB", 5 * 10**9), ("5G", 5 * 10**9), ("5gb", 5 * 10**9), (" 5 GB ", 5 * 10**9),
    ("5GiB", 5 * 2**30), ("3tib", 3 * 2**40), ("7KiB", 7 * 1024), ("2K", 2000), ("1TB", 10**12),
    ("500MB", 5 * 10**8), ("1.5GB", 15 * 10**8), ("1e3MB", 10**9), ("4096", 4096), ("4096B", 4096),
    ("1.001GB", 1_001_000_000),  # exact decimal: a float would give 1_000_999_999
    ("1.5", 1),  # a fraction of a byte is dropped
])
def test_parse_size_reads_hugging_faces_spellings_in_exact_decimal(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["abc", "5 parsecs", "-5GB", "0", "0GB", "", "GB", "5XB", "5bb", "nan", "inf",
                                  "1e400GB", "1e400"])
def test_parse_size_refuses_anything_else_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_size(text)
    assert str(err.value) == f"--max-shard-size {text!r}: {SIZE_SPELLINGS}"


def test_parse_size_names_the_flag_or_variable_it_was_given() -> None:
    with pytest.raises(ValueError, match=r"^\$ZERODP_DEVICE_MEMORY_LIMIT '80 GB of RAM': expected a size such as 5GB"):
        parse_size("80 GB of RAM", what="$ZERODP_DEVICE_MEMORY_LIMIT")
    with pytest.raises(ValueError, match=r"^--gpu-memory '1e400GB': expected a size"):  # not an OverflowError
        parse_size("1e400GB", what="--gpu-memory")


@pytest.mark.parametrize("text,count", [
    ("7B", 7 * 10**9), ("7b", 7 * 10**9), ("7.5e9", 7_500_000_000), ("350M", 350 * 10**6), ("1.3b", 1_300_000_000),
    ("2k", 2000), ("1T", 10**12), ("125000000", 125_000_000), ("1", 1), ("1e18", None),
    ("999999999999999999", 10**18 - 1),
])
def test_parse_count_reads_counts_with_their_suffixes(text: str, count: int | None) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["abc", "", "B", "0", "-5", "1.5", "1.0001K", "1e400", "inf", "nan", "sNaN", "5GB"])
def test_parse_count_is_none_for_anything_but_a_whole_count_from_1(text: str) -> None:
    assert parse_count(text) is None


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (10 * 1024 - 1, "10.0 KiB"), (2**20 - 1, "1.00 MiB"),
    (3 * 2**30, "3.00 GiB"), (2**50, "1024.0 TiB"), (-2048, "-2.00 KiB"),
])
def test_format_bytes_in_powers_of_1024(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize("n,text", [(999, "999"), (999_950, "1.0M"), (5_600_000_000, "5.6B"), (-1500, "-1.5K")])
def test_format_count_in_powers_of_1000(n: int, text: str) -> None:
    assert format_count(n) == text


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (999, "999 B"), (1000, "1.00 kB"), (12_890_000, "12.89 MB"), (16_640_000_000, "16.64 GB"),
    (2 * 10**12, "2.00 TB"), (10**16, "10000.00 TB"),
])
def test_decimal_size_in_powers_of_1000(n: int, text: str) -> None:
    assert decimal_size(n) == text


def test_format_megabytes_is_a_table_cell() -> None:
    assert format_megabytes(1_234_567) == "1.23"
    assert format_megabytes(1_234_567, places=1) == "1.2"
    assert format_megabytes(0) == "0.00"
    assert format_megabytes(None) == "-"


def test_sizes_is_the_floor_it_imports_nothing_of_zerodp() -> None:
    import ast
    import inspect

    import zerodp.sizes

    tree = ast.parse(inspect.getsource(zerodp.sizes))
    imported = [n.module if isinstance(n, ast.ImportFrom) else a.name for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in getattr(n, "names", [])]
    assert not [m for m in imported if m and m.startswith("zerodp")], imported
