"""Config settings that name features this version does not run yet, in one place.

Two kinds, because `python -m server plan` treats them differently:
- *plannable*: `plan` computes the rig and lists them under "needs"; serving refuses them. FP8 / MXFP4
  weights kept as stored were one until issue 8 built them; speculative decoding (vLLM's
  --speculative-config) is one now: its plan is the rig's without the draft (the MTP layer's weights and
  the verification steps are not counted).
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
    if config.runtime.speculative_config:  # vLLM's --speculative-config; {} or null asks for nothing
        method = config.runtime.speculative_config.get("method", "a draft method")
        found.append(Unbuilt("runtime.speculative_config (--speculative-config)",
                             f"{method!r}: speculative decoding is not built yet (a later issue); leave it out", True))
    return found
