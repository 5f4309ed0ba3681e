"""One image file -> a uint8 (C, size, size) tensor, by the fastest decoder at hand.

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
import os
from collections.abc import Callable

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
    with Image.open(io.BytesIO(data)) as opened:
        opened.draft(mode, (size, size))  # JPEG: libjpeg's own downscale by 1/2, 1/4, 1/8 when that stays >= size
        img: Image.Image = opened
        if img.mode != mode:
            try:
                img = img.convert(mode)
            except ValueError:  # no direct conversion (CMYK to L): through RGB
                img = img.convert("RGB").convert(mode)
        return np.array(img, dtype=np.uint8)


def needs_resize(data: bytes, size: int) -> bool:
    """Whether the image is stored at another size than `size` x `size` (from its header)."""
    try:
        if simplejpeg is not None and data[:3] == JPEG_MAGIC:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data, min_height=size, min_width=size, min_factor=2)
        else:
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
    except Exception:  # noqa: BLE001 (unreadable: decode_into says why)
        return False
    return (height, width) != (size, size)


def batch_tensor(count: int, size: int, channels: int, first: bytes) -> torch.Tensor:
    """An uninitialised uint8 batch (count, channels, size, size) laid out for what decoding
    writes: channels last when the first image needs no resize (a JPEG is then decoded
    straight into its slot), contiguous when it does (the resize writes channels first; the
    other layout would cost a transpose per image, a sizeable share of the decode)."""
    if needs_resize(first, size):
        return torch.empty((count, channels, size, size), dtype=torch.uint8)
    return torch.empty((count, size, size, channels), dtype=torch.uint8).permute(0, 3, 1, 2)


def decode_into(data: bytes, out: torch.Tensor) -> None:
    """Encoded image bytes -> `out`, a uint8 (channels, size, size) tensor (a slot of a
    batch, in either layout). A JPEG already at `size` is decoded straight into a
    channels-last slot. Raises on a file that is not a readable image (OSError, ValueError,
    Image.DecompressionBombError)."""
    channels, size = out.shape[0], out.shape[1]
    hwc = out.permute(1, 2, 0)
    array = None
    if simplejpeg is not None and data[:3] == JPEG_MAGIC:
        colorspace = "GRAY" if channels == 1 else "RGB"
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data, min_height=size, min_width=size, min_factor=2)
            if (height, width) == (size, size) and hwc.is_contiguous():
                simplejpeg.decode_jpeg(
                    data, colorspace=colorspace, min_height=size, min_width=size, min_factor=2, buffer=hwc.numpy()
                )
                return
            array = simplejpeg.decode_jpeg(data, colorspace=colorspace, min_height=size, min_width=size, min_factor=2)
        except ValueError:  # what libjpeg-turbo refuses (CMYK to grey, corrupt data): PIL decides
            array = None
    if array is None:
        array = _pil(data, size, channels)
    height, width = array.shape[:2]
    image = torch.from_numpy(array).view(height, width, channels).permute(2, 0, 1)
    if (height, width) != (size, size):  # torch's uint8 kernel; writes (C, H, W) contiguous
        image = F.interpolate(
            image.unsqueeze(0), size=(size, size), mode="bilinear", antialias=True, align_corners=False
        ).squeeze(0)
    out.copy_(image)


UNREADABLE = (OSError, ValueError, Image.DecompressionBombError)  # what decoding a broken file raises


def decode_batch(
    encoded: list[bytes], size: int, channels: int, failure: Callable[[int, Exception], Exception] | None = None
) -> torch.Tensor:
    """Encoded images -> one uint8 batch (N, channels, size, size) in the layout of
    batch_tensor. `failure(j, error)` gives the exception to raise when image j does not
    decode (default: the decoder's own)."""
    batch = batch_tensor(len(encoded), size, channels, encoded[0])
    for j, data in enumerate(encoded):
        try:
            decode_into(data, batch[j])
        except UNREADABLE as e:
            if failure is None:
                raise
            raise failure(j, e) from None
    return batch


def decode(data: bytes, size: int, channels: int) -> torch.Tensor:
    """Encoded image bytes -> uint8 (channels, size, size), contiguous."""
    return decode_batch([data], size, channels)[0].contiguous()


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _announce(fd: int) -> None:
    """Tell the kernel the file behind `fd` is about to be read whole (posix_fadvise
    WILLNEED), so that files not in the page cache are fetched with many requests in flight
    rather than one at a time as each is read. Nothing where the system has no such advice."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:  # a file system without read-ahead advice: read as it comes
            pass


def will_read(paths) -> None:
    """Announce files that will be read soon: the kernel starts reading them ahead, so that
    files not yet in the page cache (a folder's first start) arrive while others decode."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # the read says why
            continue
        try:
            _announce(fd)
        finally:
            os.close(fd)


def read_many(paths: list[str], window: int = 64) -> list[bytes | OSError]:
    """Each file's bytes, or the error that reading it raised. Files are opened `window` at a
    time and announced to the kernel (posix_fadvise WILLNEED) before any is read, so files
    not in the page cache are fetched with many requests in flight rather than one by one
    (files already in the page cache gain nothing, and lose nothing)."""
    out: list[bytes | OSError] = [b""] * len(paths)
    for start in range(0, len(paths), window):
        opened = []
        for i in range(start, min(start + window, len(paths))):
            try:
                fd = os.open(paths[i], os.O_RDONLY)
            except OSError as e:
                out[i] = e
                continue
            opened.append((i, fd))
            _announce(fd)
        for i, fd in opened:
            try:
                f = os.fdopen(fd, "rb")
            except OSError as e:
                os.close(fd)
                out[i] = e
                continue
            try:
                with f:
                    out[i] = f.read()
            except OSError as e:
                out[i] = e
    return out


def decode_file(path: str, size: int, channels: int) -> torch.Tensor:
    return decode(read(path), size, channels)
