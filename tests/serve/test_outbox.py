"""Engine events reach the event loop in order, with one wake-up per batch of events."""

from __future__ import annotations

import asyncio
import threading

from moebit.serve.api import _Bridge, _Outbox
from moebit.serve.engine import Event


def test_a_batch_of_events_wakes_the_loop_once_and_keeps_each_requests_order() -> None:
    async def main() -> tuple[list[list[str]], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counted(*args):  # noqa: ANN002 - the loop's own signature
            nonlocal wakeups
            wakeups += 1
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        outbox = _Outbox(loop)
        bridges = [_Bridge(outbox) for _ in range(3)]

        def engine_step() -> None:  # one step: three tokens for each of three requests
            for t in range(3):
                for i, b in enumerate(bridges):
                    b(Event(f"{i}{t}", "length" if t == 2 else None))

        th = threading.Thread(target=engine_step)
        th.start()
        th.join()
        got = []
        for b in bridges:
            evs = [await asyncio.wait_for(b.queue.get(), 5) for _ in range(3)]
            got.append([e.text for e in evs])
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert got == [["00", "01", "02"], ["10", "11", "12"], ["20", "21", "22"]]
    assert wakeups == 1
