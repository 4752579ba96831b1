"""The vocabulary of a turn's outcome: path, decision and reason names, all from the proto enums.

``kvloop.v1.TurnPath`` and ``kvloop.v1.DecisionReason`` are defined once, in
``proto/kvloop/v1/directory.proto``; spans, logs, metrics labels, the connector's returned
``kv_transfer_params``, the proxy's ``x-kvloop-*`` headers, the CLI and the benchmarks all use the
short lower-case names derived here (``TURN_PATH_TRANSFER`` -> ``"transfer"``,
``DECISION_REASON_BELOW_THRESHOLD`` -> ``"below_threshold"``). There is no second table to keep in
step: a value added to the proto is named everywhere at once.
"""

from __future__ import annotations

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from kvloop.v1 import directory_pb2 as pb


def _names(enum: EnumTypeWrapper, prefix: str) -> dict[int, str]:
    # Built once: every Lookup names its decision, reason and path (the daemon's hot path).
    return {value: name.removeprefix(prefix).lower() for name, value in enum.items()}


_PATHS = _names(pb.TurnPath, "TURN_PATH_")
_REASONS = _names(pb.DecisionReason, "DECISION_REASON_")
_DECISIONS = _names(pb.Decision, "DECISION_")
_TIERS = _names(pb.BlockTier, "BLOCK_TIER_")


def _short(names: dict[int, str], value: int) -> str:
    name = names.get(value)
    return name if name is not None else str(value)  # a value from a newer protocol: keep it visible


def path_name(path: int) -> str:
    """``pb.TURN_PATH_TRANSFER`` -> ``"transfer"``."""
    return _short(_PATHS, path)


def reason_name(reason: int) -> str:
    """``pb.DECISION_REASON_MISS`` -> ``"miss"``."""
    return _short(_REASONS, reason)


def decision_name(decision: int) -> str:
    """``pb.DECISION_TRANSFER`` -> ``"transfer"``."""
    return _short(_DECISIONS, decision)


def tier_name(tier: int) -> str:
    """``pb.BLOCK_TIER_HOST`` -> ``"host"``; UNSPECIFIED is ``"device"`` (a run announced without a
    tier is a device run)."""
    return _short(_TIERS, tier or pb.BLOCK_TIER_DEVICE)


def tier_value(name: str) -> int:
    """``"host"`` -> ``pb.BLOCK_TIER_HOST`` (a connector event's tier, for the protocol); ValueError
    for a name the protocol has no tier for."""
    for value, known in _TIERS.items():
        if value and known == name:
            return value
    raise ValueError(f"unknown block tier {name!r} (known: {', '.join(TIER_NAMES)})")


PATH_NAMES: tuple[str, ...] = tuple(path_name(v) for v in pb.TurnPath.values() if v)
REASON_NAMES: tuple[str, ...] = tuple(reason_name(v) for v in pb.DecisionReason.values() if v)
TIER_NAMES: tuple[str, ...] = tuple(tier_name(v) for v in pb.BlockTier.values() if v)
