"""The table of backend verbs: each verb's name, arguments and which side runs it, declared once.

The table is the :class:`~ringtune.gateway.backend.Backend` protocol itself: every method carries a
:func:`verb` declaration (the worker command every rank executes for it, or none when the backend object answers
on its own; which argument names the run or sampling session it addresses; whether it creates or frees that
addressee), and :func:`verbs_of` reads the declarations and the methods' signatures into :class:`Verb` records.
Everything that stands in front of a backend (the observer, the supervisor's proxy, rank 0's command
publisher) is derived from that table with :func:`forward_verbs` instead of repeating the signatures.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

Lifecycle = Literal["create", "free"] | None


@dataclass(frozen=True)
class Verb:
    """One backend verb.

    Attributes:
        name: the method name (``forward_backward``).
        command: the :class:`~ringtune.worker.commands.Command` op every rank executes for it
            (``export_hf`` for ``export_for_sampler``), or None for a verb the backend object answers alone
            (``info``, ``health``, ``close``).
        addressee: the argument naming the training run (``run_id``, ``run_ids``) or the sampling session
            (``sampler_id``) it acts on, or None.
        lifecycle: ``"create"`` / ``"free"`` for the verbs that make or drop their addressee, else None.
        signature: the method's signature, ``self`` first (annotations as strings).
        doc: the method's docstring (its contract).
    """

    name: str
    command: str | None
    addressee: str | None
    lifecycle: Lifecycle
    signature: inspect.Signature
    doc: str

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults filled in, without ``self``; TypeError like a call
        with the wrong arguments would raise."""
        bound = self.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(self.signature.parameters)))
        return arguments


F = TypeVar("F", bound=Callable[..., Any])


def verb(command: str | None = None, *, addressee: str | None = None, lifecycle: Lifecycle = None) -> Callable[[F], F]:
    """Declare a protocol method a verb (see :class:`Verb` for the fields); returns the method unchanged, marked."""

    def mark(method: F) -> F:
        method.__verb__ = {"command": command, "addressee": addressee, "lifecycle": lifecycle}  # type: ignore[attr-defined]
        return method

    return mark


def verbs_of(protocol: type) -> dict[str, Verb]:
    """The :class:`Verb` of every :func:`verb`-marked method of ``protocol``, in declaration order, by name."""
    table = {}
    for name, method in vars(protocol).items():
        declared = getattr(method, "__verb__", None)
        if declared is not None:
            table[name] = Verb(name=name, signature=inspect.signature(method), doc=method.__doc__ or "", **declared)
    return table


C = TypeVar("C", bound=type)


def forward_verbs(table: Mapping[str, Verb]) -> Callable[[C], C]:
    """Class decorator: every verb of ``table`` the class does not define itself becomes a method with the verb's
    signature and docstring that calls ``self.call_verb(verb, arguments)`` (arguments by name, defaults filled
    in) and returns its result. The class defines ``call_verb``; a verb it defines by hand stays its own."""

    def install(cls: C) -> C:
        if not callable(getattr(cls, "call_verb", None)):
            raise TypeError(f"{cls.__name__} needs a call_verb(verb, arguments) method to forward verbs")
        for name, one in table.items():
            if name not in vars(cls):
                setattr(cls, name, _forwarding_method(cls, one))
        return cls

    return install


def _forwarding_method(cls: type, one: Verb) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.call_verb(one, one.bind(args, kwargs))

    method.__name__, method.__qualname__ = one.name, f"{cls.__qualname__}.{one.name}"
    method.__doc__, method.__signature__ = one.doc, one.signature  # type: ignore[attr-defined]
    method.__module__ = cls.__module__
    return method
