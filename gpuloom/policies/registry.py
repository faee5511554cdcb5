"""One registry shape for every family of policies (placement, tokens, MIG): a name finds a
factory, and an unknown name gets one error that lists the known ones.

A name may take an argument after a colon ("fixpart:4,2,1"); the registry is told which names
do (and what their argument looks like, for the error message), and their factory receives the
text after the colon, or None when there is none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import TypeVar

T = TypeVar("T")


class UnknownPolicyError(ValueError):
    """No policy of a family has that name, or its argument is malformed."""

    def __init__(self, message: str, *, kind: str, known: tuple[str, ...]) -> None:
        super().__init__(message)
        self.kind = kind
        self.known = known


class Registry(Mapping[str, Callable[..., T]]):
    """Policies of one family by name. `factories` make a policy with no argument;
    `with_argument` maps names to factories of one argument (`str | None`) and `arguments`
    names what that argument is ("SIZES"), shown with the known names."""

    def __init__(
        self,
        kind: str,
        factories: Mapping[str, Callable[[], T]],
        with_argument: Mapping[str, Callable[[str | None], T]] | None = None,
        arguments: Mapping[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self._plain = MappingProxyType(dict(factories))
        self._with_argument = MappingProxyType(dict(with_argument or {}))
        self._arguments = MappingProxyType(dict(arguments or {}))

    def __getitem__(self, name: str) -> Callable[..., T]:
        return self._plain[name] if name in self._plain else self._with_argument[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted({*self._plain, *self._with_argument}))

    def __len__(self) -> int:
        return len(self._plain) + len(self._with_argument)

    @property
    def known(self) -> str:
        """The known names, sorted, comma-separated, with the argument each takes if any."""
        names = ", ".join(self)
        usage = ", ".join(f"{name}:{what}" for name, what in sorted(self._arguments.items()))
        return f"{names} ({usage})" if usage else names

    def create(self, spec: str) -> T:
        """A new policy for "name" or, for a name that takes one, "name:argument" (surrounding
        blanks ignored). Raises UnknownPolicyError naming the known policies."""
        text = spec.strip() if isinstance(spec, str) else ""
        make = self._plain.get(text)
        if make is not None:
            return make()
        name, colon, argument = text.partition(":")
        build = self._with_argument.get(name)
        if build is None:
            # Only a family with arguments reads "name:..." as a name and an argument.
            if colon and name in self._plain and self._with_argument:
                raise self._error(f"policy {spec!r}: this policy takes no ':' argument")
            raise self._error(f"unknown {self.kind} policy {spec!r}; known: {self.known}")
        try:
            return build(argument if colon else None)
        except ValueError as error:
            raise self._error(f"policy {spec!r}: {error}") from None

    def _error(self, message: str) -> UnknownPolicyError:
        return UnknownPolicyError(message, kind=self.kind, known=tuple(self))
