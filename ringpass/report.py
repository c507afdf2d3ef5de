"""What one compile found and did, pass by pass: reachable from Python and logged at INFO."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("ringpass")


@dataclass
class Report:
    """Filled in by the passes; ``str(report)`` is the human summary."""

    world_size: int = 1
    layout: str = ""
    seq_len: int | None = None
    attention: list[str] = field(default_factory=list)
    positions: list[str] = field(default_factory=list)
    sharded_inputs: list[str] = field(default_factory=list)
    gathered_outputs: list[str] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"ringpass: {len(self.attention)} attention(s) over {self.world_size} rank(s), layout {self.layout or '-'}, sequence {self.seq_len}"
        sections = [
            ("attention", self.attention), ("positions", self.positions), ("inputs sharded", self.sharded_inputs),
            ("outputs gathered", self.gathered_outputs), ("collectives", self.collectives), ("warnings", self.warnings),
        ]
        lines = [head]
        for title, items in sections:
            if items:
                lines.append(f"  {title}:")
                lines += [f"    - {item}" for item in items]
        return "\n".join(lines)

    def log(self) -> None:
        logger.info("%s", self)
