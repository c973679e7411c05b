"""The SEP-3172 `recovery` object, as a tool declares it in `annotations.recovery`.

The model is lenient where the SEP asks for forward compatibility (an unknown `strategy` is kept
so that the planner can record the step as unrecoverable with a reason instead of rejecting the
whole event) and strict where a wrong value would lead to a wrong call (the operation id and the
parameter bindings, which are parsed as runtime expressions up front).
"""

from __future__ import annotations

import re
from typing import Any

from mcp_saga.schemas.expressions import ExpressionError, parse_value
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SUPPORTED_STRATEGIES = frozenset({"compensation"})

# MCP tool names (SEP-986): 1-128 characters of letters, digits, '_', '-' and '.'.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class CompensatingOperation(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)

    operation_id: str = Field(alias="operationId")
    parameters: dict[str, Any] = Field(default_factory=dict)

    @field_validator("operation_id")
    @classmethod
    def _tool_name(cls, value: str) -> str:
        if not TOOL_NAME.fullmatch(value):  # `$` alone would let "undo\n" through
            raise ValueError(f"{value!r} is not a valid MCP tool name (1-128 of A-Z a-z 0-9 _ - .)")
        return value

    @field_validator("parameters")
    @classmethod
    def _expressions(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name, binding in value.items():
            try:
                parse_value(binding)
            except ExpressionError as exc:
                raise ValueError(f"parameter {name!r}: {exc}") from None
        return value


class Recovery(BaseModel):
    """`annotations.recovery`; dumps back to the SEP's wire form with `to_wire()`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)

    strategy: str
    compensating_operation: CompensatingOperation | None = Field(default=None, alias="compensatingOperation")

    @property
    def supported(self) -> bool:
        return self.strategy in SUPPORTED_STRATEGIES and self.compensating_operation is not None

    def unsupported_reason(self) -> str | None:
        if self.strategy not in SUPPORTED_STRATEGIES:
            return f"recovery strategy {self.strategy!r} is not supported (only 'compensation')"
        if self.compensating_operation is None:
            return "recovery strategy 'compensation' without a compensatingOperation"
        return None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class RecoveryError(ValueError):
    """A recovery declaration that does not fit the SEP; the message names the field and the value."""


def parse_recovery(data: Any, *, where: str = "recovery") -> Recovery:
    """Validate a declaration, turning pydantic's report into one line per field."""
    if isinstance(data, Recovery):
        return data
    try:
        return Recovery.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            path = ".".join(str(p) for p in (where, *err["loc"]))
            value = err.get("input")
            shown = repr(value) if not isinstance(value, dict) else "an object"
            problems.append(f"{path}: {err['msg'].removeprefix('Value error, ')} (got {shown})")
        raise RecoveryError("; ".join(problems)) from None
