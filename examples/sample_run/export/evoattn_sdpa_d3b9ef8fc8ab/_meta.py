"""The export's facts (kernel.json), the op spec its problem selects, and the package's logger."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from . import problems

META: dict[str, Any] = json.loads((Path(__file__).resolve().parent / "kernel.json").read_text())
NAMESPACE: str = META["namespace"]
SPEC = problems.spec_for(META)
log = logging.getLogger(META["package"])
