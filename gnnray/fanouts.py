"""``--fanouts``: neighbors sampled per layer, and per relation on typed graphs, as one checked value.

Its own module: a value with its own text form and checks, used by the
configuration (``--fanouts``, ``--eval-fanouts``), the sampler and typed graphs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

from gnnray.errors import ConfigError


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers (``10,10,10``); ``()`` when ``text`` is not that."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        return ()


def _text(values: tuple) -> str:
    return ",".join(map(str, values))


@dataclass(frozen=True)
class Fanouts:
    """``--fanouts``: neighbors sampled per layer (input layer first), and per relation on typed graphs.

    ``layers`` is the default list; on a typed graph every relation gets that
    many per layer (as DGL's samplers do on heterographs) unless ``relations``
    gives it its own list, as ``(relation, fanouts)`` pairs. ``len`` and
    iteration give ``layers``, so it serves where a tuple of fanouts was
    expected. Its text: ``10,10;cites=5,5;rev_writes=3,3``.
    """

    layers: tuple[int, ...] = (10, 10, 10)
    relations: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self):
        # Lists as code, JSON checkpoints and dataclasses.asdict give them: stored as tuples (hashable, comparable).
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "relations", tuple((str(r), tuple(f)) for r, f in self.relations))
        problem = self._problem(self.layers, self.relations)
        if problem:
            raise ConfigError(f"--fanouts {str(self)!r}: {problem}")

    @staticmethod
    def _problem(layers: tuple, relations: tuple) -> Optional[str]:
        """What is wrong with these lists, said after the flag and its text; ``None`` if nothing."""
        values = [v for f in [layers] + [f for _, f in relations] for v in f]
        if not layers or not all(isinstance(v, numbers.Integral) and (v > 0 or v == -1) for v in values):
            return "each fanout must be a positive integer (or -1 for all neighbors)"
        names = [r for r, _ in relations]
        for r, f in relations:
            if names.count(r) > 1:
                return f"relation {r!r} is given twice; give it once"
            if len(f) != len(layers):
                return (f"relation {r!r} has {len(f)} fanouts but the default list {_text(layers)} has "
                        f"{len(layers)} layers; give one per layer")
        return None

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __str__(self) -> str:
        return ";".join([_text(self.layers)] + [f"{r}={_text(f)}" for r, f in self.relations])

    def of(self, relation: str) -> tuple[int, ...]:
        """``relation``'s fanouts, input layer first: its own list, else the default."""
        return dict(self.relations).get(relation, self.layers)

    @classmethod
    def parse(cls, text: str, flag: str = "--fanouts") -> "Fanouts":
        """``10,10`` or ``10,10;cites=5,5;rev_writes=3,3``; raises :class:`ConfigError` naming ``flag``."""
        def fanouts(t: str, what: str) -> tuple:
            values = int_list(t)
            if not values:
                raise ConfigError(f"{flag} {text!r}: {what} {t.strip()!r} is not a list of fanouts; expected "
                                  f"comma-separated integers, one per layer, e.g. 10,10 (or 10,10;cites=5,5 for "
                                  f"a relation's own)")
            return values

        first, *rest = text.split(";")
        if "=" in first:
            raise ConfigError(f"{flag} {text!r}: the default list comes first, then a relation's own after ';', "
                              f"e.g. 10,10;cites=5,5")
        relations = []
        for part in filter(str.strip, rest):
            name, eq, values = part.partition("=")
            if not eq or not name.strip():
                raise ConfigError(f"{flag} {text!r}: {part.strip()!r} is not relation=fanouts; write e.g. "
                                  f"10,10;cites=5,5")
            relations.append((name.strip(), fanouts(values, f"relation {name.strip()!r}:")))
        layers = fanouts(first, "the default list")
        problem = cls._problem(layers, tuple(relations))
        if problem:
            raise ConfigError(f"{flag} {text!r}: {problem}")
        return cls(layers, tuple(relations))

    @classmethod
    def of_value(cls, value: Any) -> "Fanouts":
        """A :class:`Fanouts` from itself, a list of ints (code, older checkpoints) or ``dataclasses.asdict``'s dict."""
        if isinstance(value, Fanouts):
            return value
        return cls(**value) if isinstance(value, dict) else cls(tuple(value))
