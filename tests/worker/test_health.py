"""What a worker's `/health` says of its models is bounded, and so is the work of choosing it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shoal.worker.health import NAMES_PER_TURN, first_by_name


@dataclass
class _Card:
    display_name: str


class _Counted:
    """An attached model whose card counts, per turn of the event loop, the looks at it."""

    def __init__(self, name: str, turns: _Turns) -> None:
        self._card = _Card(name)
        self._turns = turns

    @property
    def card(self) -> _Card:
        self._turns.per_turn[self._turns.turn] = self._turns.per_turn.get(self._turns.turn, 0) + 1
        return self._card


class _Turns:
    """Counts the turns of the event loop (a task counting its turns runs beside)."""

    def __init__(self) -> None:
        self.turn = 0
        self.per_turn: dict[int, int] = {}
        self._task = asyncio.create_task(self._count())

    async def _count(self) -> None:
        while True:
            self.turn += 1
            await asyncio.sleep(0)

    def stop(self) -> int:
        """The most models looked at in one turn."""
        self._task.cancel()
        return max(self.per_turn.values(), default=0)


async def test_choosing_the_models_shown_looks_at_a_slice_of_them_per_turn_of_the_loop() -> None:
    """With 60,000 adapters, a pass over all of them in one turn (a sort, or even a pass
    taking the smallest names) held the worker's loop for tens of ms per probe."""
    turns = _Turns()
    count = 3 * NAMES_PER_TURN + 7
    models: dict[str | None, _Counted] = {
        f"s{i}": _Counted(f"name-{i:06d}", turns) for i in reversed(range(count))
    }
    models[None] = _Counted("the-base", turns)
    shown = await first_by_name(models, 4)
    assert turns.stop() <= NAMES_PER_TURN
    assert shown == [None, "s0", "s1", "s2"]
    assert await first_by_name({k: v for k, v in models.items() if k}, 2) == ["s0", "s1"]
