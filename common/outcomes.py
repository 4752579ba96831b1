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


def _short(enum: EnumTypeWrapper, prefix: str, value: int) -> str:
    try:
        return enum.Name(value).removeprefix(prefix).lower()
    except ValueError:  # a value from a newer protocol: keep it visible as a number
        return str(value)


def path_name(path: int) -> str:
    """``pb.TURN_PATH_TRANSFER`` -> ``"transfer"``."""
    return _short(pb.TurnPath, "TURN_PATH_", path)


def reason_name(reason: int) -> str:
    """``pb.DECISION_REASON_MISS`` -> ``"miss"``."""
    return _short(pb.DecisionReason, "DECISION_REASON_", reason)


def decision_name(decision: int) -> str:
    """``pb.DECISION_TRANSFER`` -> ``"transfer"``."""
    return _short(pb.Decision, "DECISION_", decision)


PATH_NAMES: tuple[str, ...] = tuple(path_name(v) for v in pb.TurnPath.values() if v)
REASON_NAMES: tuple[str, ...] = tuple(reason_name(v) for v in pb.DecisionReason.values() if v)
