"""What a worker's `/health` says of its models is bounded, and so is the work of choosing it."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.worker.health import NAMES_PER_TURN, first_by_name
from tests.helpers import LoopTurns


@dataclass
class _Card:
    display_name: str


class _Counted:
    """An attached model whose card counts, per turn of the event loop, the looks at it."""

    def __init__(self, name: str, turns: LoopTurns) -> None:
        self._card = _Card(name)
        self._turns = turns

    @property
    def card(self) -> _Card:
        self._turns.note()
        return self._card


async def test_choosing_the_models_shown_looks_at_a_slice_of_them_per_turn_of_the_loop() -> None:
    """With 60,000 adapters, a pass over all of them in one turn (a sort, or even a pass
    taking the smallest names) held the worker's loop for tens of ms per probe."""
    turns = LoopTurns()
    count = 3 * NAMES_PER_TURN + 7
    models: dict[str | None, _Counted] = {
        f"s{i}": _Counted(f"name-{i:06d}", turns) for i in reversed(range(count))
    }
    models[None] = _Counted("the-base", turns)
    shown = await first_by_name(models, 4)
    assert turns.on_loop == count  # (each adapter looked at once; the base is first anyway)
    assert turns.most_per_turn <= NAMES_PER_TURN, f"{turns.most_per_turn} in one turn"
    assert shown == [None, "s0", "s1", "s2"]
    assert await first_by_name({k: v for k, v in models.items() if k}, 2) == ["s0", "s1"]
