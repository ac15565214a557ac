"""A benchmark that measured a failure says so in its exit status, not only in its figures."""

from __future__ import annotations


def test_the_chaos_benchmark_fails_when_a_request_failed_or_an_output_was_wrong():
    from benchmarks.chaos import verdict

    assert verdict({"failed_requests": 0, "wrong_outputs": 0}) == (0, "")
    assert verdict({"failed_requests": 2, "wrong_outputs": 0}) == (
        1,
        "2 request(s) failed, 0 output(s) unlike the oracle's",
    )
    assert verdict({"failed_requests": None, "wrong_outputs": 1})[0] == 1
