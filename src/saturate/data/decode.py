"""One image file -> a uint8 (C, size, size) tensor, by the fastest decoder measured here.

JPEG goes through simplejpeg (libjpeg-turbo's TurboJPEG API); anything else, and any JPEG it
refuses, through PIL. Both scale a JPEG down in the DCT domain (by 1/2, 1/4 or 1/8) when it
is at least twice the size asked for: four to sixty-four times fewer pixels to decode. Not
by less (5/8, 3/4, ...): that saves nothing measurable at 500x375 -> 224 and changes pixels.
The resize is an antialiased bilinear one on the uint8 tensor (torch's port of PIL's filter,
the one torchvision's `resize(antialias=True)` uses): below a 2x downscale, the same pixels
as PIL's decode + `resize(BILINEAR)`. Measured in docs/benchmarks.md (image folders).
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

try:
    import simplejpeg
except ImportError:  # an optional speed-up: PIL decodes everything without it
    simplejpeg = None

JPEG_MAGIC = b"\xff\xd8\xff"


def _pil(data: bytes, size: int, channels: int) -> np.ndarray:
    mode = "L" if channels == 1 else "RGB"
    with Image.open(io.BytesIO(data)) as img:
        img.draft(mode, (size, size))  # JPEG: libjpeg's own downscale by 1/2, 1/4, 1/8 when that stays >= size
        if img.mode != mode:
            try:
                img = img.convert(mode)
            except ValueError:  # no direct conversion (CMYK to L): through RGB
                img = img.convert("RGB").convert(mode)
        return np.array(img, dtype=np.uint8)


def decode_into(data: bytes, out: torch.Tensor) -> None:
    """Encoded image bytes -> `out`, a uint8 (size, size, channels) tensor (a slot of a
    channels-last batch). A JPEG whose decoded size is already `size` is decoded straight
    into it. Raises on a file that is not a readable image (OSError, ValueError,
    Image.DecompressionBombError)."""
    size, channels = out.shape[0], out.shape[2]
    array = None
    if simplejpeg is not None and data[:3] == JPEG_MAGIC:
        colorspace = "GRAY" if channels == 1 else "RGB"
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data, min_height=size, min_width=size, min_factor=2)
            if (height, width) == (size, size):
                simplejpeg.decode_jpeg(data, colorspace=colorspace, min_height=size, min_width=size, min_factor=2, buffer=out.numpy())
                return
            array = simplejpeg.decode_jpeg(data, colorspace=colorspace, min_height=size, min_width=size, min_factor=2)
        except ValueError:  # what libjpeg-turbo refuses (CMYK to grey, corrupt data): PIL decides
            array = None
    if array is None:
        array = _pil(data, size, channels)
    height, width = array.shape[:2]
    image = torch.from_numpy(array).view(height, width, channels)
    if (height, width) != (size, size):  # on the channels-last view: torch's fast uint8 path
        image = F.interpolate(image.permute(2, 0, 1).unsqueeze(0), size=(size, size), mode="bilinear", antialias=True,
                              align_corners=False).squeeze(0).permute(1, 2, 0)  # fmt: skip
    out.copy_(image)


def decode(data: bytes, size: int, channels: int) -> torch.Tensor:
    """Encoded image bytes -> uint8 (channels, size, size)."""
    out = torch.empty((size, size, channels), dtype=torch.uint8)
    decode_into(data, out)
    return out.permute(2, 0, 1).contiguous()


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def decode_file(path: str, size: int, channels: int) -> torch.Tensor:
    return decode(read(path), size, channels)
