"""The one set of byte units: fmt_bytes and memory strings read back by as_bytes."""

import pytest

from foundation.units import GiB, KiB, MiB, TiB, as_bytes, fmt_bytes, fmt_spans


def test_constants():
    assert (KiB, MiB, GiB, TiB) == (1024, 1024**2, 1024**3, 1024**4)


@pytest.mark.parametrize(
    "nbytes, digits, text",
    [
        (0, 2, "0 B"),
        (7, 2, "7 B"),
        (1023, 2, "1023 B"),
        (1024, 2, "1.00 KiB"),
        (412 * KiB, 2, "412.00 KiB"),
        (3.38 * GiB, 2, "3.38 GiB"),
        (24 * GiB, 1, "24.0 GiB"),
        (512 * MiB, 1, "512.0 MiB"),
        (1.5 * TiB, 2, "1.50 TiB"),
    ],
)
def test_fmt_bytes(nbytes, digits, text):
    assert fmt_bytes(nbytes, digits) == text


@pytest.mark.parametrize(
    "value, nbytes",
    [
        (25769803776, 25769803776),
        (0, 0),
        ("24GiB", 24 * GiB),
        ("24 GB", 24 * 10**9),
        ("1.5tib", 3 * 2**39),
        ("512 MiB", 2**29),
        ("0.1GB", 10**8),
        ("7B", 7),
        (" 2 kib ", 2048),
    ],
)
def test_as_bytes(value, nbytes):
    assert as_bytes(value) == nbytes


@pytest.mark.parametrize(
    "value, expected",
    [
        ("24", "bytes: an integer >= 0"),
        ("24 GiBs", "units B, KB"),
        (-3, "an integer >= 0"),
        (2.5, "bytes"),
        (True, "bytes"),
        (None, "bytes"),
        ("1.5B", "a whole number of bytes (1.5B is 1.5 bytes)"),
    ],
)
def test_as_bytes_rejects_with_what_was_expected(value, expected):
    with pytest.raises(ValueError) as info:
        as_bytes(value)
    assert expected in str(info.value)


def test_numbers_as_runs_in_order_each_once():
    assert fmt_spans([]) == ""
    assert fmt_spans([8, 0, 2, 1, 5, 7, 2]) == "0-2, 5, 7-8"
    assert fmt_spans(range(4), ",") == "0-3"
