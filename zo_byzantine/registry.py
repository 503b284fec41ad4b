"""Name -> class registries for estimators, aggregators, pre-aggregation steps and attacks."""

from __future__ import annotations

import inspect
from collections.abc import Callable


class Registry:
    """A mapping from names to factories; unknown names fail with the list of known ones.

    Registering a name that exists raises unless ``exist_ok=True`` (transformers' convention).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Callable] = {}

    def register(self, name: str, exist_ok: bool = False) -> Callable:
        """Decorator: ``@REGISTRY.register("name")`` on a class or factory."""

        def decorate(factory: Callable) -> Callable:
            if name in self._entries and not exist_ok:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({self._entries[name].__name__}); "
                    "pass exist_ok=True to replace it."
                )
            self._entries[name] = factory
            return factory

        return decorate

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests remove what they register)."""
        self.get(name)
        del self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def build(self, name: str, argument: str, **kwargs):
        """``factory(**kwargs)`` for ``name``; unknown or missing keywords fail naming ``argument`` (the
        setting that carried them) and the accepted parameters."""
        factory = self.get(name)
        try:
            inspect.signature(factory).bind(**kwargs)
        except TypeError as err:
            accepted = [p for p in inspect.signature(factory).parameters if p not in ("self", "args", "kwargs")]
            raise ValueError(
                f"{argument}: {self.kind} {name!r} does not take {sorted(kwargs)} ({err}); "
                f"accepted: {', '.join(accepted) or 'no parameters'}."
            ) from err
        return factory(**kwargs)

    def get(self, name: str) -> Callable:
        if name not in self._entries:
            raise ValueError(f"Unknown {self.kind} {name!r}; known: {', '.join(self.names())}.")
        return self._entries[name]
