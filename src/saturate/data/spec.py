"""DataSpec: what a run knows about its data, learnt from one look at it (base.describe)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DataSpec:
    """What the run knows about its data, learnt from one sample (and the targets)."""

    name: str
    input_shape: tuple[int, ...]  # one sample's, e.g. (C, H, W) or (T, F)
    input_dtype: torch.dtype
    target_shape: tuple[int, ...]  # () for a class index or a single value
    classes: bool  # targets are integer class indices
    num_classes: int | None  # when `classes`
    mean: tuple[float, ...] | None = None  # images: per channel, [0, 1] units; None: not normalised
    std: tuple[float, ...] | None = None
    stats_images: int | None = None  # the images mean/std were measured on; None: the data's own mean/std
    synthetic: bool = False
    in_memory: bool = False  # one in-memory tensor (no per-sample decoding)
    has_val: bool = True
    notes: dict = field(default_factory=dict)
    has_test: bool = False
    structure: str = "pair"  # pair: (input, target); dict: the input and target under input_key and target_key
    input_key: str | list[str] = "input"  # several: the inputs the model gets, in order
    target_key: str = "target"
    # float (C, H, W) in [0, 1] (the ToTensor() convention): augmented as images; normalised with the data's mean/std
    float_image: bool = False
    fixed: bool = True  # every sample has the same shapes (variable-length samples need a collate; no resident loader)
    collate: bool = False  # the data brings its own collate function
    sample_s: float | None = None  # seconds to read one sample in this process (the num_workers=auto rule)
    input_shapes: tuple[tuple[int, ...], ...] = ()  # every input tensor's shape (several inputs: a tuple or dict)
    target_dtype: torch.dtype | None = None
    host_keys: tuple[str, ...] = ()  # dict entries the loaders leave on the host: the task reads them there

    @property
    def image(self) -> bool:
        """uint8 (C, H, W): copied as uint8, normalised (and augmented) on the device; or a
        float (C, H, W) image in [0, 1], augmented, normalised when the data gives mean/std."""
        single = len(self.input_shapes) <= 1
        return single and ((self.input_dtype == torch.uint8 and len(self.input_shape) == 3) or self.float_image)

    @property
    def mask_target(self) -> bool:
        """The targets are masks of the images (integer (H, W), the images' height and width):
        a geometric augmentation moves them with the image."""
        integer = self.target_dtype is not None and not self.target_dtype.is_floating_point
        return self.image and integer and tuple(self.target_shape) == tuple(self.input_shape[-2:])

    @property
    def target_entry(self):
        """Where the target is in a batch: 1 of a pair, the target key of a dict."""
        return 1 if self.structure == "pair" else self.target_key

    @property
    def image_entry(self):
        """Where the image is in a batch: 0 of a pair, the input key of a dict."""
        return 0 if self.structure == "pair" else self.input_key

    @property
    def num_outputs(self) -> int:
        """Values the model predicts per sample: classes, or the target's size."""
        if self.classes:
            assert self.num_classes is not None, "describe() counts the classes of class targets"
            return self.num_classes
        return int(np.prod(self.target_shape, dtype=np.int64))

    @property
    def normalisation(self) -> str:
        """What the inputs go through before the model, as the run's `data:` line says it."""
        if not self.image:
            return "inputs as the data gives them"
        if self.mean is None or self.std is None:
            return "not normalised (float images without mean/std)"
        if self.stats_images is not None:
            return f"normalised on the device with statistics of {self.stats_images} images"
        shown = "/".join("(" + ", ".join(f"{v:.3g}" for v in values) + ")" for values in (self.mean, self.std))
        return f"normalised on the device with the data's mean/std {shown}"

    def describe(self) -> str:
        if len(self.input_shapes) > 1:
            shown = ", ".join("x".join(map(str, s)) or "scalar" for s in self.input_shapes)
            kind = (
                f"{self.num_classes} classes" if self.classes else f"real targets of shape {tuple(self.target_shape)}"
            )
            return f"{len(self.input_shapes)} inputs ({shown}), {kind}"
        shape = "x".join(map(str, self.input_shape)) or "scalar"
        kind = f"{self.num_classes} classes" if self.classes else f"real targets of shape {tuple(self.target_shape)}"
        return (
            f"{shape} {str(self.input_dtype).removeprefix('torch.')} inputs{' (images)' if self.image else ''}, {kind}"
        )
