"""Which vLLM engine serves a sampling session, and what each engine holds: ``serve --sampler vllm`` with several
engines (``--vllm-engines N``, ``--vllm-url`` repeated) and several base models (one engine set per ``--model``).

An :class:`EngineSet` keeps one :class:`EngineSlot` per engine, grouped by the served model whose base weights it
loaded. A session is **placed** once, when it is created, on an engine of its model and sticks to it (its adapter,
its reloaded weights and the engine's prefix cache stay useful). The placement key of a session is what it makes
the engine hold: :data:`BASE_GATE` for base and LoRA sessions (they share the base weights), its full-weights
directory@version, or ``inflight:<run>`` for a run's inflight sessions (they all follow the run's newest publish).
The engine chosen minimises, in order:

1. the other keys already placed on it (each would make it reload back and forth with this one: two runs' full
   snapshots go to two engines while there are engines, never alternate on one while another idles);
2. the sessions placed on it (load; base and LoRA sessions spread evenly over the engines);
3. its position (the first engine on ties).

An engine that gave up (down and out of restarts, or stopped) takes no new sessions; a session whose engine gave
up is placed again on its next job (it samples on another engine of its model, reloading there). While an engine
is down but restarting, its sessions' requests fail with ``category: server`` errors and the other engines keep
serving.

Each slot also records what its engine holds on its current incarnation: the gate (the base weights or one
full-weights directory) and the LoRA adapters loaded; :meth:`EngineSet.prepare` reloads or loads what a job needs
(a restarted engine holds its own model and no adapters).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

BASE_GATE = "base"
"""The weight gate of the engine's own model (base sessions and every LoRA adapter)."""


class SamplingEngine(Protocol):
    """What the sampler needs of an engine (:class:`ringtune.worker.vllm_engine.VllmEngine`). An engine may also
    have a ``gave_up`` attribute (True: it will not serve again; absent: False)."""

    incarnation: int

    @property
    def config(self) -> Any: ...  # .model (base directory), .served_name, .enable_lora

    def check_serving(self) -> int: ...

    def post(self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None) -> Any: ...

    def load_lora_adapter(self, name: str, path: str) -> None: ...

    def unload_lora_adapter(self, name: str) -> None: ...

    def reload_weights(self, path: str) -> None: ...

    def stop(self) -> None: ...


Engines = SamplingEngine | Mapping[str, Sequence[SamplingEngine]]
"""What ``serve --sampler vllm`` hands the gateway: one engine, or served model name -> its engines."""


def gave_up(engine: SamplingEngine) -> bool:
    """Whether ``engine`` will not serve again (down with its restarts used up, or stopped)."""
    return bool(getattr(engine, "gave_up", False))


@dataclass(eq=False)
class EngineSlot:
    """One engine as the sampler sees it.

    Attributes:
        engine: the engine; model: the served model's name whose base it loaded (None: the only model);
        index: its position among its model's engines.
        incarnation: the engine incarnation the held state below belongs to (-1: none yet).
        held_gate: the base weights it holds (:data:`BASE_GATE` or a full-weights directory@version).
        adapters: adapter name -> 1 when loaded on ``incarnation`` (0: known, to load).
        keys: placement key -> sessions placed here with it.
    """

    engine: SamplingEngine
    model: str | None
    index: int
    incarnation: int = -1
    held_gate: str = BASE_GATE
    adapters: dict[str, int] = field(default_factory=dict)
    keys: Counter[str] = field(default_factory=Counter)

    @property
    def label(self) -> str:
        """``<model>#<index>`` for logs and errors."""
        return f"{self.model or 'engine'}#{self.index}"

    @property
    def load(self) -> int:
        """Sessions placed here."""
        return sum(self.keys.values())

    def conflicts(self, key: str) -> int:
        """Distinct placement keys here other than ``key`` (each a reload away from it)."""
        return sum(1 for k, n in self.keys.items() if n > 0 and k != key)


class EngineSet:
    """The engines of every served model (module docstring).

    Args:
        engines: one engine (every session samples there), or served model name -> its engines (at least one
            each; the first model takes sessions of a model not listed).
    """

    def __init__(self, engines: Engines) -> None:
        groups: Mapping[str | None, Sequence[SamplingEngine]]
        groups = dict(engines) if isinstance(engines, Mapping) else {None: [engines]}
        if not groups or any(not group for group in groups.values()):
            raise ValueError(f"every served model needs at least one engine, got {dict(groups)!r}")
        self.slots: dict[str | None, list[EngineSlot]] = {
            model: [EngineSlot(engine, model, i) for i, engine in enumerate(group)] for model, group in groups.items()
        }
        self.default_model = next(iter(self.slots))

    @property
    def all_slots(self) -> list[EngineSlot]:
        """Every engine's slot, models in order."""
        return [slot for group in self.slots.values() for slot in group]

    def slots_of(self, model: str | None) -> list[EngineSlot]:
        """The slots of served model ``model`` (an unknown name or None: the first model's)."""
        return self.slots.get(model) or self.slots[self.default_model]

    def place(self, model: str | None, key: str) -> EngineSlot:
        """The engine a new session of ``model`` with placement ``key`` sticks to (module docstring), counted."""
        group = self.slots_of(model)
        candidates = [slot for slot in group if not gave_up(slot.engine)] or group
        slot = min(candidates, key=lambda s: (s.conflicts(key), s.load, s.index))
        slot.keys[key] += 1
        if len(group) > 1:
            log.info("vLLM session (%s) placed on engine %s (%d sessions there)", key, slot.label, slot.load)
        return slot

    def release(self, slot: EngineSlot, key: str) -> None:
        """Forget one session of ``key`` placed on ``slot``."""
        slot.keys[key] -= 1
        if slot.keys[key] <= 0:
            del slot.keys[key]

    def replace_if_gone(self, slot: EngineSlot, key: str) -> EngineSlot:
        """``slot`` unless its engine gave up and another engine of its model serves on; then the session
        (``key``) moves there (a new placement)."""
        if not gave_up(slot.engine) or all(gave_up(s.engine) for s in self.slots_of(slot.model)):
            return slot
        self.release(slot, key)
        moved = self.place(slot.model, key)
        log.warning("vLLM engine %s gave up; its session (%s) moves to %s", slot.label, key, moved.label)
        return moved

    def prepare(self, slot: EngineSlot, gate: str, full_path: str | None, adapter: tuple[str, str] | None) -> str:
        """Make ``slot``'s engine serve a job on its current incarnation: hold ``gate`` (reloading ``full_path``,
        or the base model when the gate is :data:`BASE_GATE`, with its prefix cache reset) and have ``adapter``
        (``(name, directory)``, a LoRA session's) loaded. The model name the completion calls use.
        EngineUnavailableError when the engine is not serving."""
        engine = slot.engine
        incarnation = engine.check_serving()
        if incarnation != slot.incarnation:  # a (re)started engine holds its own model and no adapters
            slot.incarnation, slot.held_gate = incarnation, BASE_GATE
            slot.adapters = dict.fromkeys(slot.adapters, 0)
        if gate != slot.held_gate:
            engine.reload_weights(full_path if gate != BASE_GATE and full_path else engine.config.model)
            slot.held_gate = gate
            log.info("vLLM engine %s now holds %s", slot.label, gate)
        if adapter is None:
            return engine.config.served_name
        name, path = adapter
        if not slot.adapters.get(name):
            engine.load_lora_adapter(name, path)
            slot.adapters[name] = 1
        return name

    def drop_adapter(self, slot: EngineSlot, name: str) -> None:
        """Unload adapter ``name`` from ``slot``'s engine if it is loaded on its current incarnation (a failure is
        logged: the engine may be down, and a restart drops it anyway)."""
        if slot.adapters.pop(name, 0) and slot.incarnation == slot.engine.incarnation:
            try:
                slot.engine.unload_lora_adapter(name)
            except Exception:
                log.warning("could not unload adapter %s from engine %s", name, slot.label, exc_info=True)

    def stop(self) -> None:
        """Stop every engine (each its own process group; attached ones are left running)."""
        for slot in self.all_slots:
            slot.engine.stop()
