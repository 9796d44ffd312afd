"""openrl.observe.metrics.BusyClock: seconds with at least one job running (overlaps count once)."""

from openrl.observe import metrics


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_busy_clock_counts_the_union_of_job_intervals():
    now = FakeClock()
    c = metrics.BusyClock(clock=now)
    assert c.seconds() == 0.0
    c.enter()                # job A from 100
    now.t = 101.0
    c.enter()                # job B from 101 (overlaps A)
    now.t = 102.0
    assert c.seconds() == 2.0  # the open interval is included
    c.exit()                 # A ends at 102
    now.t = 103.0
    c.exit()                 # B ends at 103: busy 100..103
    assert c.seconds() == 3.0
    now.t = 110.0            # idle 103..110 does not count
    with c.job():
        now.t = 110.5
    assert c.seconds() == 3.5
    c.exit()                 # an unmatched exit is ignored
    assert c.seconds() == 3.5


def test_busy_clock_job_ends_on_exception():
    now = FakeClock()
    c = metrics.BusyClock(clock=now)
    try:
        with c.job():
            now.t += 1.0
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    now.t += 5.0
    assert c.seconds() == 1.0


def test_busy_seconds_exported_per_function():
    clock = metrics.busy_clock("test_busy_fn")
    assert metrics.busy_clock("test_busy_fn") is clock
    with clock.job():
        pass
    body = metrics.exposition()[0].decode()
    lines = [ln for ln in body.splitlines() if ln.startswith('openrl_busy_seconds_total{function="test_busy_fn"}')]
    assert len(lines) == 1 and float(lines[0].rsplit(" ", 1)[1]) >= 0.0
    del metrics.BUSY_COLLECTOR.clocks["test_busy_fn"]
