"""What ``model`` may name: the base model, an adapter's alias (resolved to its serving version when the
request arrives), or one version as ``name@version``. Visibility follows the caller's key: an adapter the
caller may not use answers exactly like one that does not exist, so keys cannot probe other tenants' names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplane.engine.api import adapter_key
from loraplane.http.auth import Principal
from loraplane.http.errors import NOT_FOUND, PERMISSION, APIError
from loraplane.http.protocol import ModelCard, now

USABLE_STATES = frozenset({"loaded", "warm"})


@dataclass(frozen=True, slots=True)
class Target:
    """Where one request goes: the base (adapter None) or one adapter version, fixed at arrival."""

    adapter: str | None = None  # the adapter's name (what keys, logs and metrics speak of)
    key: str | None = None  # "name@version" (what the engine runs)

    @property
    def version(self) -> str | None:
        return self.key.partition("@")[2] if self.key else None


BASE = Target()


def model_not_found(name: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist.", param="model", type=NOT_FOUND, code="model_not_found"
    )


@dataclass(slots=True)
class ServedModels:
    base_name: str
    created: int = field(default_factory=now)

    def resolve(self, engine, name: str, principal: Principal) -> Target:
        if name == self.base_name:
            if not principal.may_use(None):
                raise APIError(403, f"this API key may not use the base model `{name}`; name an adapter",
                               param="model", type=PERMISSION, code="model_not_allowed")  # fmt: skip
            return BASE
        adapter, at, version = name.partition("@")
        if not adapter or not principal.may_use(adapter):
            raise model_not_found(name)
        if at:
            key = adapter_key(adapter, version)
            usable = any(a.key == key and a.state in USABLE_STATES for a in engine.adapters(adapter))
            key = key if usable else None
        else:
            key = engine.resolve(adapter)
        if key is None:
            raise model_not_found(name)
        return Target(adapter, key)

    def cards(self, engine, principal: Principal) -> list[ModelCard]:
        cards = []
        if principal.may_use(None):
            cards.append(ModelCard(id=self.base_name, created=self.created, root=self.base_name))
        for info in sorted(engine.adapters(), key=lambda a: (a.name, a.version)):
            if info.serving and info.state in USABLE_STATES and principal.may_use(info.name):
                cards.append(
                    ModelCard(
                        id=info.name,
                        created=self.created,
                        root=self.base_name,
                        parent=self.base_name,
                        version=info.version,
                    )  # fmt: skip
                )
        return cards
