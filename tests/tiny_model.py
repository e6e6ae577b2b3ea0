"""The tests' tiny models: prl.trainer.tiny_model (which `model.build_tiny` runs), under the name the tests
import. `python tests/tiny_model.py DIR [--moe | --family F | --vlm]` still builds one."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prl.trainer.tiny_model import (HYBRID_FAMILIES, IMAGE_TOKEN, MOE_FAMILIES, VLM_IMAGE_TOKENS,  # noqa: E402
                                    build_tiny_model, build_tiny_moe, build_tiny_teacher, build_tiny_vlm,
                                    build_tokenizer, main, tiny_moe_config)

__all__ = ["HYBRID_FAMILIES", "IMAGE_TOKEN", "MOE_FAMILIES", "VLM_IMAGE_TOKENS", "build_tiny_model", "build_tiny_moe",
           "build_tiny_teacher", "build_tiny_vlm", "build_tokenizer", "tiny_moe_config"]

if __name__ == "__main__":
    main()
