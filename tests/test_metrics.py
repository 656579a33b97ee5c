"""The step-line formatter, human-readable sizes, the progress bar and throughput arithmetic."""

from __future__ import annotations

import io

import pytest
import torch

from zerodp.metrics import (
    STEP_METRIC_KEYS,
    ProgressBar,
    Throughput,
    flops_per_token,
    format_bytes,
    format_count,
    format_step,
)

FULL = {
    "step": 12,
    "total_steps": 200,
    "loss": 3.14159,
    "grad_norm": 1.234,
    "lr": 3e-3,
    "loss_scale": 65536.0,
    "model_state_bytes": int(12.3 * 2**20),
    "tokens_per_s": 12345.4,
    "tflops": 0.0123,
}


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_format_step_full_line_is_pinned() -> None:
    assert format_step(FULL) == (
        "step  12/200 | loss 3.1416 | grad_norm  1.23 | lr 3.0e-03 | loss_scale 65536"
        " | model states  12.3 MiB | tok/s  12,345 | TFLOPS  0.01"
    )
    assert list(FULL) == list(STEP_METRIC_KEYS)


def test_format_step_other_values_are_pinned() -> None:
    line = format_step(
        {"step": 7, "loss": float("nan"), "grad_norm": float("inf"), "loss_scale": 0.5,
         "lr": 1e-4, "tokens_per_s": 999.6}
    )
    assert line == (
        "step      7 | loss    nan | grad_norm   inf | lr 1.0e-04 | loss_scale   0.5"
        " | tok/s   1,000"
    )


def test_missing_and_none_fields_are_omitted_and_unknown_keys_ignored() -> None:
    assert format_step({"loss": 1.0, "grad_norm": None, "epoch": 3}) == "loss 1.0000"
    assert format_step({"lr": 1e-3, "model_state_bytes": 2048}) == "lr 1.0e-03 | model states  2.00 KiB"
    assert format_step({}) == ""


def test_format_step_accepts_zero_dim_tensors() -> None:
    assert format_step({"loss": torch.tensor(0.5), "grad_norm": torch.tensor(2.0)}) == (
        "loss 0.5000 | grad_norm  2.00"
    )


def test_lines_align_across_typical_values() -> None:
    other = {**FULL, "step": 3, "loss": 0.01, "grad_norm": 12.5, "lr": 1e-5,
             "loss_scale": 1024, "model_state_bytes": 900 * 2**20, "tokens_per_s": 850.0, "tflops": 12.3}
    first, second = format_step(FULL), format_step(other)
    assert len(first) == len(second)
    assert [i for i, ch in enumerate(first) if ch == "|"] == [
        i for i, ch in enumerate(second) if ch == "|"
    ]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (10 * 1024 - 1, "10.0 KiB"),  # rounds to 10.00, so shown with one decimal
        (2**20 - 1, "1.00 MiB"),  # not "1024.0 KiB"
        (int(12.3 * 2**20), "12.3 MiB"),
        (3 * 2**30, "3.00 GiB"),
        (5 * 2**40, "5.00 TiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0"),
        (999, "999"),
        (1000, "1.0K"),
        (1234, "1.2K"),
        (999_949, "999.9K"),
        (999_950, "1.0M"),  # not "1000.0K"
        (805_632, "805.6K"),
        (3_400_000, "3.4M"),
        (5_600_000_000, "5.6B"),
        (7 * 10**12, "7.0T"),
    ],
)
def test_format_count(n: int, text: str) -> None:
    assert format_count(n) == text


def test_progress_bar_off_a_tty_writes_every_tenth_and_the_last_step() -> None:
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(25, stream, clock=clock)  # every max(1, 25 // 10) = 2 steps
    for step in range(1, 26):
        clock.now += 0.5
        bar.update(step, {"loss": 4.0 / step})
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [*range(2, 25, 2), 25]
    assert lines[0] == "step  2/25 | loss 2.0000 | elapsed 00:01 | eta 00:11"
    assert lines[-1] == "step 25/25 | loss 0.1600 | elapsed 00:12 | eta 00:00"
    assert "\r" not in stream.getvalue()


def test_progress_bar_off_a_tty_logs_where_an_early_stop_ended() -> None:
    stream = io.StringIO()
    with ProgressBar(200, stream, clock=FakeClock()) as bar:
        for step in range(1, 38):
            bar.update(step, {"loss": 1.0})
    lines = stream.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step  20/200", "step  37/200"]


def test_progress_bar_on_a_tty_redraws_one_line() -> None:
    stream, clock = FakeTTY(), FakeClock()
    bar = ProgressBar(10, stream, width=10, clock=clock)
    clock.now += 2.0
    bar.update(5, {"loss": 1.5, "lr": 1e-3})
    assert stream.getvalue() == "\r[#####-----]  5/10 00:02<00:02 | loss 1.5000 | lr 1.0e-03"
    clock.now += 2.0
    bar.update(10, {})
    bar.close()
    bar.close()  # idempotent
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.count("\n") == 1 and text.endswith("\n")
    last = text.split("\r")[-1]
    # The shorter second line blanks out what is left of the first one.
    assert last == "[##########] 10/10 00:04<00:00".ljust(57) + "\n"


def test_progress_bar_rejects_an_empty_total() -> None:
    with pytest.raises(ValueError, match=r"ProgressBar total=0 must be >= 1"):
        ProgressBar(0, io.StringIO())


def test_flops_per_token_by_hand() -> None:
    # 6 * 1000 + 12 * layers(2) * seq(8) * d_model(4) = 6000 + 768
    assert flops_per_token(1000, n_layer=2, seq_len=8, d_model=4) == 6768
    # The demo model without its position embedding: 6 * 801,536 + 12 * 4 * 32 * 128
    assert flops_per_token(801_536, 4, 32, 128) == 4_809_216 + 196_608
    with pytest.raises(ValueError, match=r"seq_len=-1 must be >= 0"):
        flops_per_token(10, 1, -1, 4)


def test_throughput_averages_over_its_window() -> None:
    throughput = Throughput(tokens_per_step=1000, flops_per_token=6e9, window=2)
    assert throughput.metrics() == {"tokens_per_s": None, "tflops": None}
    throughput.update(1.0)
    assert throughput.update(0.25) == {"tokens_per_s": 1600.0, "tflops": pytest.approx(9.6)}
    throughput.update(0.25)  # the 1.0 s step has left the window
    assert throughput.tokens_per_s == 4000.0
    assert Throughput(1000).update(0.5) == {"tokens_per_s": 2000.0, "tflops": None}
    with pytest.raises(ValueError, match=r"step_time_s=0 must be > 0"):
        throughput.update(0)
