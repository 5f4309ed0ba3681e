"""One augmentation policy, two placements.

A `Policy` says what to do: horizontal flip probability, rotation degrees, brightness and
contrast strength, translation (the random crop with zero padding of the usual recipe) and
random erasing. The same policy runs

- batched on the training device (`BatchAugment`, Kornia's AugmentationSequential), on the
  whole batch after the host-to-device copy, without autograd, before normalisation; or
- per sample in the DataLoader workers (`SampleAugment`), with plain torch ops that follow
  Kornia's parameter sampling and transforms exactly (tests compare the two on the same
  parameters), because Kornia's modules cost milliseconds per call and would make a
  strawman of the per-sample baseline.

Randomness is keyed, not streamed: a sample's parameters come from (seed, epoch, index) and
a batch's from (seed, epoch, batch), so results do not depend on which worker ran a sample,
and a run resumed mid-epoch draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from saturate.config.policy import POLICY_FIELDS, PRESETS, Policy
from saturate.data.samples import length

__all__ = ["POLICY_FIELDS", "PRESETS", "BatchAugment", "Policy", "Preview", "SampleAugment", "Schedule", "Transforms"]

ERASE_SCALE = (0.02, 0.33)  # erased area, as a share of the image
ERASE_RATIO = (0.3, 3.3)  # erased rectangle's aspect ratio


class Schedule:
    """The policy of each epoch: stages (from_epoch, policy) sorted by epoch, first at 0."""

    def __init__(self, stages: list[tuple[int, Policy]]):
        self.stages = stages

    @classmethod
    def from_config(cls, cfg: Any) -> Schedule:
        """From an AugmentationConfig: its `schedule` stages (or its single `preset`), with
        any field set on the node (e.g. `augmentation.rotation=30`) applied to every stage."""
        overrides = {f: getattr(cfg, f) for f in POLICY_FIELDS if getattr(cfg, f) is not None}
        stages = [(s.from_epoch, s.preset) for s in cfg.schedule] or [(0, cfg.preset)]
        return cls([(epoch, replace(PRESETS[name], **overrides)) for epoch, name in stages])

    def policy(self, epoch: int) -> Policy:
        return [p for start, p in self.stages if start <= epoch][-1]


def _key(*parts: int) -> int:
    """One integer seed from several non-negative integers (stable across processes)."""
    key = 0
    for part in parts:
        key = key * 1_000_003 + part
    return key


# --- batched, on the device -----------------------------------------------------------------


def kornia_pipeline(policy: Policy, masks: bool = False) -> torch.nn.Module | None:
    """The policy as a Kornia AugmentationSequential over (B, C, H, W) floats in [0, 1]; with
    `masks`, over (images, masks) too: Kornia moves a mask with its image's geometric
    transforms (nearest, for class indices) and leaves it out of the colour ones."""
    import kornia.augmentation as K

    ops: list[K.AugmentationBase2D] = []
    if policy.hflip:
        ops.append(K.RandomHorizontalFlip(p=policy.hflip))
    if policy.rotation or policy.translate:
        t = policy.translate
        ops.append(K.RandomAffine(degrees=policy.rotation, translate=(t, t) if t else None, p=1.0))
    if policy.brightness:
        ops.append(K.RandomBrightness(brightness=(1 - policy.brightness, 1 + policy.brightness), p=1.0))
    if policy.contrast:
        ops.append(K.RandomContrast(contrast=(1 - policy.contrast, 1 + policy.contrast), p=1.0))
    if policy.erasing:
        ops.append(K.RandomErasing(scale=ERASE_SCALE, ratio=ERASE_RATIO, value=0.0, p=policy.erasing))
    if masks:
        return K.AugmentationSequential(*ops, data_keys=["input", "mask"]) if ops else None
    return K.AugmentationSequential(*ops) if ops else torch.nn.Identity()


class Transforms:
    """The user's own augmentation (augmentation.transforms): Kornia modules run in order
    on float images (B, C, H, W) in [0, 1], the same whatever the epoch."""

    name = "transforms"

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules
        self.pipeline = torch.nn.Sequential(*modules)
        self._with_masks: torch.nn.Module | None = None

    def with_masks(self) -> torch.nn.Module:
        """The same modules over (images, masks): Kornia's augmentations only, which know
        which of them move a mask."""
        import kornia.augmentation as K

        foreign = [type(m).__name__ for m in self.modules if not type(m).__module__.startswith("kornia")]
        if foreign:
            from saturate.errors import UserError

            raise UserError(
                f"augmentation.transforms: {', '.join(foreign)} cannot move the masks with the images; with mask "
                "targets use kornia.augmentation modules (they know which transforms are geometric)"
            )
        if self._with_masks is None:
            kornias: list[Any] = self.modules  # each one Kornia's (checked above); which kind, Kornia checks
            self._with_masks = K.AugmentationSequential(*kornias, data_keys=["input", "mask"])
        return self._with_masks

    def policy(self, epoch: int):
        return self

    def is_identity(self) -> bool:
        return False


def build_transforms(nodes: list) -> Transforms | None:
    """augmentation.transforms: the user's `_target_` nodes built into modules (Kornia's
    augmentations, or any module taking and returning (B, C, H, W) floats in [0, 1])."""
    if not nodes:
        return None
    from hydra.utils import instantiate

    from saturate.errors import ConfigError, Problem, UserError

    modules = []
    for i, node in enumerate(nodes):
        try:
            module = instantiate(node)
        except Exception as e:  # noqa: BLE001 (the user's node: its message, one line)
            cause = e.__cause__ or e
            why = " ".join(str(cause).split())[:200]
            raise UserError(f"augmentation.transforms[{i}]: cannot build {node.get('_target_')}: {why}") from None
        if not isinstance(module, torch.nn.Module):
            allowed = "a torch.nn.Module taking images (B, C, H, W) in [0, 1], e.g. kornia.augmentation.RandomAffine"
            raise ConfigError([Problem(f"augmentation.transforms[{i}]", node.get("_target_"), allowed)])
        modules.append(module)
    return Transforms(modules)


def check_transforms(transforms: Transforms | None, image_shape: tuple[int, ...]) -> None:
    """The user's transforms, tried at start-up on two images of the data's shape, one module
    after the other: one that changes the size (the run would train on another shape than it
    validates on), the dtype, or makes NaN from finite images is named now, not found mid-run
    or never. The global generator is forked: a run with the check augments as one without."""
    if transforms is None:
        return
    from saturate.errors import UserError

    x = torch.rand(2, *image_shape, generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for i, module in enumerate(transforms.modules):
            name, shape, dtype = f"augmentation.transforms[{i}]: {type(module).__name__}", tuple(x.shape), x.dtype
            try:
                y = module(x)
            except Exception as e:  # noqa: BLE001 (the user's module: one line)
                why = " ".join(str(e).split())[:200]
                raise UserError(f"{name} fails on images {shape} ({type(e).__name__}: {why})") from None
            if not isinstance(y, torch.Tensor):
                raise UserError(f"{name} returns a {type(y).__name__}; a transform returns the images (B, C, H, W)")
            if tuple(y.shape) != shape:
                raise UserError(
                    f"{name} turns images {shape} into {tuple(y.shape)}; a transform must keep their size (the "
                    "model and the validation images have the data's): crop or resize back to it"
                )
            if not y.is_floating_point():
                raise UserError(
                    f"{name} turns {str(dtype).removeprefix('torch.')} images into "
                    f"{str(y.dtype).removeprefix('torch.')}; a transform must return floats in [0, 1]"
                )
            if not bool(torch.isfinite(y).all()):
                raise UserError(f"{name} turns finite images into NaN or inf")
            x = y.to(dtype)


def _on_device(pipeline: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The user's transforms with their tensors on `device` and Kornia's parameter samplers
    kept on the CPU, as the presets' are. Moving a Kornia module moves its samplers too: on a
    GPU they would draw from the CUDA generator, which the per-batch seeding does not fork
    (a resumed run would augment differently, and dropout's stream would shift)."""
    pipeline = pipeline.to(device)
    for module in pipeline.modules():
        keep_on_cpu = getattr(module, "set_rng_device_and_dtype", None)
        if callable(keep_on_cpu):
            keep_on_cpu(torch.device("cpu"), getattr(module, "dtype", torch.get_default_dtype()))
    return pipeline


class BatchAugment:
    """The device placement: `augment(x, epoch, batch)` for a batch already on the device,
    floats in [0, 1]: the epoch's policy as Kornia modules, or the user's transforms. With
    `masks` (B, H, W) of class indices, `(x, masks)` moved together."""

    def __init__(self, schedule: Schedule | Transforms, seed: int):
        self.schedule, self.seed = schedule, seed
        self._pipelines: dict = {}

    def _pipeline(self, policy, device: torch.device, masks: bool):
        if (policy, masks) not in self._pipelines:
            pipeline: torch.nn.Module | None
            if isinstance(policy, Transforms):
                pipeline = policy.with_masks() if masks else policy.pipeline
            else:
                pipeline = kornia_pipeline(policy, masks)
            self._pipelines[(policy, masks)] = _on_device(pipeline, device) if pipeline is not None else None
        return self._pipelines[(policy, masks)]

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, epoch: int, batch: int, masks: torch.Tensor | None = None):
        policy = self.schedule.policy(epoch)
        pipeline = self._pipeline(policy, x.device, masks is not None)
        # Kornia draws its parameters from the global CPU generator: seed it for this batch
        # inside a fork, so no other user of the global generator sees a difference.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(_key(self.seed, epoch, batch))
            if masks is None:
                return pipeline(x)
            if pipeline is None:
                return x, masks
            x, moved = pipeline(x, masks[:, None].float())
            return x, moved[:, 0].round().to(masks.dtype)


# --- per sample, in DataLoader workers -------------------------------------------------------


def _affine_theta(angle: float, tx: float, ty: float, h: int, w: int) -> list[list[float]]:
    """affine_grid's theta (output -> input, normalised, align_corners=False) for Kornia's
    RandomAffine: a rotation by `angle` degrees (clockwise as displayed) about the image
    centre, then a shift by (tx, ty) pixels."""
    a = math.radians(-angle)  # Kornia: get_rotation_matrix2d(center, -angle)
    c, s = math.cos(a), math.sin(a)
    cx, cy = w / 2 - 0.5, h / 2 - 0.5
    m0, m1 = (1 - c) * cx - s * cy + tx, s * cx + (1 - c) * cy + ty  # forward: [[c, s, m0], [-s, c, m1]]
    i02, i12 = -(c * m0 - s * m1), -(s * m0 + c * m1)  # inverse: [[c, -s, i02], [s, c, i12]]
    # conjugate with pixel <-> normalised coordinates: x = w/2 * xn + (w - 1)/2
    a02 = c * (w - 1) / 2 - s * (h - 1) / 2 + i02
    a12 = s * (w - 1) / 2 + c * (h - 1) / 2 + i12
    return [[c, -s * h / w, 2 / w * a02 + 1 / w - 1], [s * w / h, c, 2 / h * a12 + 1 / h - 1]]


@functools.cache
def _base_grid(h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
    """Homogeneous normalised pixel-centre coordinates (H*W, 3), as affine_grid builds them."""
    xy = F.affine_grid(torch.eye(2, 3, dtype=dtype)[None], [1, 1, h, w], align_corners=False).view(h * w, 2)
    return torch.cat([xy, torch.ones(h * w, 1, dtype=dtype)], dim=1)


@dataclass
class SampleParams:
    """One sample's draw: the same quantities Kornia draws per sample."""

    flip: bool = False
    angle: float = 0.0  # degrees
    shift: tuple[float, float] = (0.0, 0.0)  # pixels (x, y)
    brightness: float = 0.0  # added
    contrast: float = 1.0  # multiplied
    erase: tuple[int, int, int, int] | None = None  # top, left, height, width


def draw_params(policy: Policy, rng: random.Random, h: int, w: int) -> SampleParams:
    """Draw one sample's parameters from the distributions Kornia draws them from."""
    p = SampleParams()
    if policy.hflip:
        p.flip = rng.random() < policy.hflip
    if policy.rotation:
        p.angle = rng.uniform(-policy.rotation, policy.rotation)
    if policy.translate:
        t = policy.translate
        p.shift = (rng.uniform(-t, t) * w, rng.uniform(-t, t) * h)
    if policy.brightness:
        p.brightness = rng.uniform(-policy.brightness, policy.brightness)
    if policy.contrast:
        p.contrast = rng.uniform(1 - policy.contrast, 1 + policy.contrast)
    if policy.erasing and rng.random() < policy.erasing:
        area = rng.uniform(*ERASE_SCALE) * h * w
        ratio = rng.uniform(ERASE_RATIO[0], 1.0) if rng.random() < 0.5 else rng.uniform(1.0, ERASE_RATIO[1])
        eh = int(min(max(round(math.sqrt(area * ratio)), 1), h))
        ew = int(min(max(round(math.sqrt(area / ratio)), 1), w))
        p.erase = (math.floor(rng.random() * (h - eh + 1)), math.floor(rng.random() * (w - ew + 1)), eh, ew)
    return p


def apply_params(x: torch.Tensor, policy: Policy, p: SampleParams, mask: torch.Tensor | None = None):
    """Transform one float image (C, H, W) in [0, 1] as Kornia does, in Kornia's order; with
    `mask` (H, W) of class indices, the mask too, as Kornia moves one: the same flip, affine
    (nearest) and erasing, no colour change. Returns the image, or (image, mask)."""
    _, h, w = x.shape
    m = mask[None].float() if mask is not None else None
    if p.flip:
        x = x.flip(-1)
        m = m.flip(-1) if m is not None else None
    if policy.rotation or policy.translate:
        theta_t = torch.tensor(list(zip(*_affine_theta(p.angle, *p.shift, h, w), strict=True)), dtype=x.dtype)  # (3, 2)
        grid = _base_grid(h, w, x.dtype).mm(theta_t).view(1, h, w, 2)  # affine_grid, without its per-call set-up
        x = F.grid_sample(x[None], grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0]
        if m is not None:
            m = F.grid_sample(m[None], grid, mode="nearest", padding_mode="zeros", align_corners=False)[0]
    if policy.brightness or policy.contrast:  # brightness, then contrast, clipped after each (Kornia)
        x = x.add(p.brightness).clamp_(0, 1).mul_(p.contrast).clamp_(0, 1)
    if p.erase is not None:
        top, left, eh, ew = p.erase
        x = x.clone()
        x[:, top : top + eh, left : left + ew] = 0
        if m is not None:
            m = m.clone()
            m[:, top : top + eh, left : left + ew] = 0
    if mask is None:
        return x
    assert m is not None  # the mask's copy, made above
    return x, m[0].round().to(mask.dtype)


def augment_sample(x: torch.Tensor, policy: Policy, rng: random.Random) -> torch.Tensor:
    """Draw and apply `policy` on one float image (C, H, W) in [0, 1]."""
    return apply_params(x, policy, draw_params(policy, rng, x.shape[-2], x.shape[-1]))


class SampleAugment(Dataset):
    """The CPU placement: a dataset of images whose items are augmented one by one (in the
    DataLoader's workers). Items are asked for by (epoch, index), so each sample's parameters
    follow from (seed, epoch, index) and the epoch's policy. `entry`: where the image is in a
    sample (0 of a pair, a dict's input key); `mask_entry`: where its mask is, when the targets
    are masks of the images (moved with them). The user's transforms run on the sample as a
    batch of one, their draws keyed the same way."""

    def __init__(self, base: Dataset, schedule: Schedule | Transforms, seed: int, entry=0, mask_entry=None):
        self.base, self.schedule, self.seed, self.entry, self.mask_entry = base, schedule, seed, entry, mask_entry
        self.poll = getattr(base, "poll", None)  # the base data set's, for the loader (saturate.data.base)
        self.collate_fn = getattr(base, "collate_fn", None)

    def __len__(self) -> int:
        return length(self.base)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        sample = self.base[index]
        image = torch.as_tensor(sample[self.entry])
        policy = self.schedule.policy(epoch)
        if policy.is_identity():
            return sample
        uint8 = image.dtype == torch.uint8
        x = image.float().div_(255) if uint8 else image.float()
        mask = torch.as_tensor(sample[self.mask_entry]) if self.mask_entry is not None else None
        if isinstance(policy, Transforms):
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.default_generator.manual_seed(_key(self.seed, epoch, index))
                out = self._transformed(policy, x, mask)
        else:
            params = draw_params(policy, random.Random(_key(self.seed, epoch, index)), x.shape[-2], x.shape[-1])
            out = apply_params(x, policy, params, mask)
        out, mask = out if mask is not None else (out, None)
        # uint8 back to uint8: a quarter of the bytes through the workers' queues and the copy
        out = out.mul_(255).round_().to(torch.uint8) if uint8 else out
        replaced = {self.entry: out, **({self.mask_entry: mask} if mask is not None else {})}
        if isinstance(sample, dict):
            return {**sample, **replaced}
        items = [replaced.get(i, item) for i, item in enumerate(sample)]
        return tuple(items) if isinstance(sample, tuple) else items

    @staticmethod
    def _transformed(policy: Transforms, x: torch.Tensor, mask: torch.Tensor | None):
        if mask is None:
            return policy.pipeline(x[None])[0]
        image, moved = policy.with_masks()(x[None], mask[None, None].float())
        return image[0], moved[0, 0].round().to(mask.dtype)


class Preview:
    """Shows what the model sees: a grid of training images in TensorBoard at the first batch
    (`inputs/<preset>`, or `inputs/unaugmented`), and again whenever the epoch's policy changes
    (a schedule's next stage). Each image is framed and small ones enlarged (8x8 digits
    tiled edge to edge read as stripes)."""

    def __init__(self, show_images, schedule: Schedule | None, count: int):
        self.show_images, self.schedule, self.count = show_images, schedule, count
        self._shown: Any = ()  # the policy last shown; () before the first batch

    def __call__(self, x: torch.Tensor, epoch: int) -> None:
        policy = self.schedule.policy(epoch) if self.schedule else None
        if policy == self._shown:
            return
        self._shown = policy
        images = x[: self.count].float()
        if x.dtype == torch.uint8:
            images = images / 255
        self.show_images(f"inputs/{policy.name if policy else 'unaugmented'}", framed(images.clamp(0, 1)), epoch)


def framed(images: torch.Tensor, at_least: int = 48) -> torch.Tensor:
    """Images (N, C, H, W) enlarged by a whole factor (nearest) to `at_least` pixels on their
    shorter side, each inside a 2-pixel white frame, so that a grid shows where one ends."""
    factor = max(1, -(-at_least // min(images.shape[-2:])))
    if factor > 1:
        images = torch.nn.functional.interpolate(images, scale_factor=factor, mode="nearest")
    return torch.nn.functional.pad(images, (2, 2, 2, 2), value=1.0)
