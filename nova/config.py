"""Nova's settings: one typed object, read from the environment once.

  NOVA_VERIFY_EACH_STAGE=1   run the IR verifier after every pipeline stage
                             (the final IR is always verified); tests turn it on
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    verify_each_stage: bool = False

    @staticmethod
    def from_env() -> "Settings":
        return Settings(verify_each_stage=os.environ.get("NOVA_VERIFY_EACH_STAGE", "0") not in ("", "0"))


SETTINGS = Settings.from_env()
