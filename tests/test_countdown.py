"""mpicomp/tools/bench/_countdown.py: the benchmark's progress lines and the time left."""

import io

from mpicomp.tools.bench._countdown import Countdown


def test_bench_progress_says_the_time_left_from_what_is_done():
    now = [0.0]
    out = io.StringIO()
    c = Countdown(4, out, clock=lambda: now[0])
    c.next("a")
    now[0] = 10.0
    c.next("b")
    now[0] = 20.0
    c.next("c")
    now[0] = 400.0
    c.next("d")
    assert out.getvalue().splitlines() == [
        "bench: a (1/4)",  # nothing measured yet: no guess
        "bench: b (2/4, about 30 s left)",
        "bench: c (3/4, about 20 s left)",
        "bench: d (4/4, about 2 min left)",
    ]


def test_no_stream_says_nothing():
    c = Countdown(2, None, clock=lambda: 0.0)
    c.next("a")
    assert c.done == 0  # not even counted: nothing is printed
