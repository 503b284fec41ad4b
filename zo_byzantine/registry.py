"""Name -> class registries for estimators, aggregators and attacks."""

from __future__ import annotations

from collections.abc import Callable


class Registry:
    """A mapping from names to factories; unknown names fail with the list of known ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Callable] = {}

    def register(self, name: str) -> Callable:
        """Decorator: ``@REGISTRY.register("name")`` on a class or factory."""

        def decorate(factory: Callable) -> Callable:
            self._entries[name] = factory
            return factory

        return decorate

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable:
        if name not in self._entries:
            raise ValueError(f"Unknown {self.kind} {name!r}; known: {', '.join(self.names())}.")
        return self._entries[name]
