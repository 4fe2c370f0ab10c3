"""An image's bytes → one RGB picture, within the deployment's limits, or the reason its line fails.

PNG, JPEG, WebP and GIF (its first frame) are read with Pillow; any other format (SVG, which Pillow cannot read
and which would run a renderer, BMP, TIFF, ...) is refused by name with `image_format_unsupported`. The size is read
from the header before a single pixel is decoded, so a decompression bomb (a small file of a huge picture) or a
1 x 100000 strip costs nothing and fails with `image_too_large`; a truncated or corrupt file fails with
`image_unreadable`. Whatever Pillow raises while reading one image, only that image's line fails. The picture is
turned as its EXIF orientation says and converted to RGB, as transformers' `load_image` does.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from jobs.images.inputs import ImageLimits, ImageRejected

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's names


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    if len(data) > limits.max_bytes:
        raise ImageRejected("image_too_large", f"the image is {len(data)} bytes, over the limit of {limits.max_bytes}")
    with warnings.catch_warnings():
        # Pillow warns (and past twice its own limit raises) about bombs; our own pixel limit below is the rule.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as bomb:
            raise ImageRejected("image_too_large", f"the image is too large to decode: {bomb}") from None
        except UnidentifiedImageError:
            raise _unidentified(data) from None
        except (OSError, SyntaxError, ValueError) as broken:  # a header Pillow recognised, then could not read
            raise ImageRejected("image_unreadable", f"the image cannot be read: {broken}") from None
        if image.format not in SUPPORTED_FORMATS:
            raise ImageRejected(
                "image_format_unsupported",
                f"{image.format} images are not supported; send PNG, JPEG, WebP or GIF",
            )
        _check_size(image.width, image.height, limits)
        try:
            image.seek(0)  # a GIF's (or an animated WebP's) first frame
            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")
        except (OSError, SyntaxError, ValueError, EOFError) as broken:  # truncated data, a corrupt stream
            raise ImageRejected("image_unreadable", f"the {image.format} image cannot be decoded: {broken}") from None


def _check_size(width: int, height: int, limits: ImageLimits) -> None:
    if width < 1 or height < 1:
        raise ImageRejected("image_unreadable", f"the image has no pixels ({width} x {height})")
    if width * height > limits.max_pixels:
        raise ImageRejected(
            "image_too_large",
            f"the image is {width} x {height} pixels, over the limit of {limits.max_pixels} pixels",
        )
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise ImageRejected(
            "image_too_large",
            f"the image is {width} x {height} pixels, an aspect ratio of {ratio:.0f}, over the limit of "
            f"{limits.max_aspect_ratio:g}",
        )


def _unidentified(data: bytes) -> ImageRejected:
    head = data[:1024].lstrip().lower()
    if head.startswith((b"<svg", b"<?xml")) or b"<svg" in head:
        return ImageRejected("image_format_unsupported", "SVG images are not supported; send PNG, JPEG, WebP or GIF")
    return ImageRejected("image_unreadable", "the data is not an image in a format that can be read")
