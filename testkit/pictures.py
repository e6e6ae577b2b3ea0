"""Real picture payloads for the servers' picture routes: `png_url`, a PNG as a `data:` URL."""

from __future__ import annotations

import base64
import io


def png_url(width: int, height: int, mode: str = "1", *, truncated: bool = False) -> str:
    """A real PNG as a data URL: a blank `mode` canvas (mode "1": a 4096x4096 one is 2 KB of PNG that decodes
    to 48 MiB of RGB); `truncated` cuts its pixel data short, so only its header reads."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG")
    data = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(data[:len(data) // 2] if truncated else data).decode()
