"""Config settings that name features this version does not run yet, in one place.

Two kinds, because `python -m server plan` treats them differently:
- *plannable*: `plan` computes the rig and lists them under "needs"; serving refuses them. FP8 / MXFP4
  weights kept as stored were one until issue 8 built them, DSpark drafting (--speculative-config's
  method dspark) until issue 27 did.
- *unplannable*: expert offload to NVMe (offload.experts: disk), whose split is not designed yet. Nothing
  can be planned with it, so `plan` refuses it (saying whether the rig fits without it), and so does
  serving. offload.experts: host is plannable (engine/expert_placement.py) and serves on the CPU.
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
    if config.offload.experts == "host" and config.runtime.device != "cpu":
        found.append(Unbuilt("offload.experts", "'host': the plan places the experts; serving them on a GPU (the"
                             " expert cache's device path) is not validated yet (issue 28; it serves on the CPU)",
                             True))
    elif config.offload.experts == "disk":
        found.append(Unbuilt("offload.experts",
                             f"{config.offload.experts!r}: expert offload to NVMe is not built yet (issue 28)", False))
    return found
