"""The policies by name (``RammerConfig(policy=...)``): ``POLICIES`` and ``get_policy``."""
from __future__ import annotations

from typing import Callable

from ...config import POLICIES as POLICY_NAMES
from . import ios, opara, rammer

__all__ = ["POLICIES", "Policy", "get_policy"]

Policy = Callable[..., list]

POLICIES: dict[str, Policy] = {
    "rammer": rammer.schedule,
    "ios": ios.schedule,
    "opara": opara.schedule,
}
assert tuple(POLICIES) == POLICY_NAMES, "RammerConfig's POLICIES and the registry name the same policies"


def get_policy(name: str) -> Policy:
    """The policy registered as ``name``; ValueError naming the valid ones otherwise."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]
