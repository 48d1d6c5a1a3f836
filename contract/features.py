"""Config settings that name features this version does not run yet, in one place.

Two kinds, because `python -m server plan` treats them differently:
- *plannable*: the memory arithmetic is known even though the engine does not run it yet (none now:
  FP8 / MXFP4 weights kept as stored were the last, until issue 8 built them).
  `plan` computes the rig with them and lists them under "needs"; serving refuses them.
- *unplannable*: offload, whose split between GPU, host RAM and NVMe is not designed yet. Nothing can
  be planned with it, so `plan` refuses it (saying whether the rig fits without it), and so does serving.
Each entry names the YAML key, so the message says what to change. The issues that bring a feature
delete its entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.config import ServeConfig


@dataclass(frozen=True)
class Unbuilt:
    key: str  # the YAML key that asks for it
    what: str  # what it asks for, and which issue brings it
    plannable: bool

    def __str__(self) -> str:
        return f"{self.key}: {self.what}"


def unbuilt_features(config: ServeConfig) -> list[Unbuilt]:
    """The settings of `config` that this version cannot serve."""
    found = []
    if config.offload.experts != "none":
        found.append(Unbuilt("offload.experts",
                             f"{config.offload.experts!r}: expert offload is not built yet (a later issue)", False))
    return found
