"""The cost of the worker's hook point: processing with an empty observer against none.

    python benchmarks/observers.py [--quick] [--url URL]

:func:`bench_observers` has the signature of ``benchmarks/run.py``'s benchmarks and uses
the table and process runner of ``benchmarks/harness.py`` (``run_processing``): preloaded jobs, a no-op handler, the
real ``Worker`` in a fresh process, timed until no job is pending or running. The sides
differ in one argument: no observer; ``observers=[Finished()]``, overriding ``finished``
with nothing (what a metrics observer overrides: one event per job); and
``observers=[Empty()]``, overriding every method with nothing (three events per job, the
most an observer can cost). The runs rotate and the medians are compared; the target is
at most 3 % slower.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

import harness as bench
from sqlalchemy import URL, Engine, create_engine, make_url

#: Throughput with the empty observer against none: at least this ratio.
TARGET = 0.97


def _observed_child(
    kind: str, url_text: str, concurrency: int, batch: int, ready: Any, go: Any, stop: Any
) -> None:
    """The harness's ``_processing_child`` for the Worker, with or without the empty observer."""
    from sqla_queue import JobEvent, Worker, WorkerObserver

    class Finished(WorkerObserver):  # what a metrics observer overrides
        def finished(self, event: JobEvent) -> None:
            pass

    class Empty(Finished):  # every method: every claim, start and end makes its event
        def claimed(self, event: JobEvent) -> None:
            pass

        def started(self, event: JobEvent) -> None:
            pass

    engine = create_engine(make_url(url_text), pool_size=concurrency + 3)
    options: dict[str, Any] = {"batch_size": batch} if batch else {}
    if kind == "observed":
        options["observers"] = [Empty()]
    elif kind == "finished":
        options["observers"] = [Finished()]
    worker = Worker(engine, bench.BenchJob, bench.noop, concurrency=concurrency, **options)
    engine.connect().close()
    ready.put(os.getpid())
    go.wait()
    cpu = bench.cpu_seconds()
    worker.start()
    stop.wait()
    cpu = bench.cpu_seconds() - cpu
    worker.stop(grace=10)
    engine.dispose()
    ready.put(cpu)


def bench_observers(engine: Engine, url: URL, plan: bench.Plan) -> list[bench.Row]:
    rows = []
    for cfg in plan.processing[:3]:  # 1, 4 and 16 threads at default batch sizes
        kinds = ["plain", "finished", "observed"]
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        cpus: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(plan.processing_rounds):
            for kind in kinds[r % 3:] + kinds[:r % 3]:
                rate, cpu = bench.run_processing(url, engine, kind, cfg, child=_observed_child)
                rates[kind].append(rate)
                cpus[kind].append(cpu)
        for kind, what in (("finished", "an empty finished()"), ("observed", "every method empty")):
            row = bench.throughput_row(f"processing, observer with {what}, {cfg.label}", rates[kind],
                                       rates["plain"], "jobs/s", TARGET)
            row.target = f">= {TARGET:.2f}x"
            row.ours += f" ({statistics.median(cpus[kind]):,.0f} µs CPU/job)"
            row.base += f" ({statistics.median(cpus['plain']):,.0f} µs CPU/job)"
            rows.append(row)
            bench.say(f"  {row.cells()[:4]}  rates {kind}={rates[kind]} plain={rates['plain']}")
    bench.reset(engine)
    return rows


if __name__ == "__main__":
    sys.exit(bench.run_alone(bench_observers, __doc__, sys.argv[1:]))
