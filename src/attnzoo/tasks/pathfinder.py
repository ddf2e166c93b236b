"""Pathfinder (Linsley et al. 2018), the image-as-sequence task of the Long Range Arena (Tay et al. 2021).

A ``size`` x ``size`` greyscale image holds two target curves, short distractor curves and two markers; the
label is 1 iff both markers lie on the same curve. The image is read as a sequence of ``size * size`` pixel
values (row-major, tokens 0..255), so a model must trace a curve across distant positions of the sequence.

How an image is made (all in numpy, vectorised over a batch of candidate images):

* A curve is ``contour_length`` straight segments of ``segment_length`` pixel steps each, every step one of
  the 8 compass directions (:data:`DIRECTIONS`); consecutive segments turn by -45, 0 or +45 degrees, each
  equally likely. The first pixel and the first direction are uniform. Distractors are curves of
  ``distractor_length`` segments drawn the same way.
* Geometry that the label can be read from: two pixels of one curve that are not consecutive never touch
  (8-neighbourhood), so a curve neither crosses nor touches itself; and the pixels of different strokes never
  touch either, so that at least one background pixel lies between any two strokes. The 3 x 3 marker blob
  around each end of both target curves is reserved whether or not it is drawn, and stays apart from the
  curve's own pixels END_CLEARANCE or more steps from that end.
* Strokes are drawn one after another, the two target curves first, then the distractors, each segment by
  segment: a segment that would leave the image or break a rule above is tried with the other two turns, in
  random order (so curves bend away from obstacles); a stroke with no way on
  is drawn again from a new start (up to :data:`TRIES` times, then the whole image is dropped and another
  made).
* Pixels: background 0; every stroke of an image one grey level drawn uniformly from
  :data:`STROKE_LEVELS`; the two markers, 3 x 3 blobs centred on curve ends, :data:`MARKER_VALUE` (255, no
  stroke has it). Label 1 (``n // 2`` of a split of n, in random order): both ends of one target curve are
  marked; label 0: one end of each target curve.
* No shortcut through the markers' positions: images are drawn as candidates (strokes only) and marked in pairs,
  one label-1 and one label-0 image whose markers have the same offset (up to sign) and the same distance from
  the nearer marker to the edge (:class:`_OffsetMatcher`). Otherwise label 1's markers would sit one curve's
  end-to-end distance apart, on its segment grid, and label 0's anywhere: a threshold on their distance told
  82.8% of the 16 x 16 quick images apart, the segment grid 95.5% of the 32 x 32 ones.
  :func:`shortcut_accuracies` measures this and other cheap cues; ``scripts/pathfinder_shortcut.py`` prints them.

So the connected components (8-connectivity) of the non-zero pixels are exactly the strokes, and the label
is whether the two markers lie in one component: ``tests/tasks/test_tasks_pathfinder.py`` recomputes every label
that way from the pixels alone.

Difficulty: ``contour_length`` (LRA's Pathfinder uses 6, 9 and 14 "paddles"); the default is 9.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .._validation import check_number, check_positive_int
from .base import Split, Task, register

DIRECTIONS = np.array([(0, 1), (-1, 1), (-1, 0), (-1, -1), (0, -1), (1, -1), (1, 0), (1, 1)], dtype=np.int64)
"""(row, column) step of each direction, 45 degrees apart counter-clockwise: E, NE, N, NW, W, SW, S, SE.
A turn of one index is 45 degrees."""
NEIGHBOURHOOD = np.array([(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)], dtype=np.int64)
"""The 3 x 3 block of offsets around a pixel: its 8-neighbourhood and itself."""
MARKER_VALUE = 255
STROKE_LEVELS = (64, 224)
"""Each image's strokes share one grey level drawn uniformly from [64, 224): never 0 and never MARKER_VALUE."""
TRIES = 20
"""Draws allowed per stroke before its image is dropped."""
END_CLEARANCE = 4
"""A curve pixel this many steps or more from an end keeps a Chebyshev distance of at least 3 from it, so it
does not touch that end's marker blob."""


@dataclass(frozen=True)
class PathfinderImages:
    """Images and the geometry they were drawn from (the geometry is for checks; the task keeps the images).

    Attributes:
        images: (n, size, size) uint8 pixels.
        labels: (n,) int64, 1 iff both markers lie on the same curve.
        curves: (n, 2, contour_length * segment_length + 1, 2) int64 (row, column) of each target curve's
            pixels, in drawing order.
        directions: (n, 2, contour_length) int64 direction index (into :data:`DIRECTIONS`) of each segment.
        markers: (n, 2, 2) int64 (row, column) of the two marked curve ends.
        distractors: (n, num_distractors, distractor_length * segment_length + 1, 2) int64 pixels.
    """

    images: np.ndarray
    labels: np.ndarray
    curves: np.ndarray
    directions: np.ndarray
    markers: np.ndarray
    distractors: np.ndarray


def _grow_curves(
    rng: np.random.Generator, rows: np.ndarray, blocked: np.ndarray, size: int, segments: int,
    segment_length: int, blobs: bool,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Grow one curve in each of the images ``rows``, segment by segment.

    ``blocked`` (images, size + 2, size + 2), padded by one cell on every side, marks the cells that touch
    strokes already drawn. Each segment turns by -45, 0 or +45 degrees from the one before (the first takes a
    uniform direction), each turn equally likely; a segment that would leave the image, touch a blocked cell
    or touch the curve's own pixels two or more steps back is tried again with the other turns, in random
    order, and the curve fails when none fits. With ``blobs``, the curve also fails unless the 3 x 3 blob
    around each end is inside the image, off the blocked cells, and apart from the curve's pixels
    END_CLEARANCE or more steps from that end.

    Returns (ok (count,) bool, pixels (count, segments * segment_length + 1, 2), directions (count, segments));
    the rows of failed curves are meaningless.
    """
    count = rows.size
    points = segments * segment_length + 1
    pixels = np.zeros((count, points, 2), dtype=np.int64)
    directions = np.zeros((count, segments), dtype=np.int64)
    # own[i, r + 1, c + 1]: the lowest index of curve i's pixels whose 3 x 3 block covers (r, c), so that pixel
    # j touches an earlier pixel two or more steps back iff own[pixel j] <= j - 2.
    never = np.iinfo(np.int16).max
    own = np.full((count, size + 2, size + 2), never, dtype=np.int16)
    everyone = np.arange(count)

    def free(where: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """Which rows ``where`` have all of their (k, n, 2) ``cells`` inside the image and off blocked cells."""
        inside = ((cells >= 0) & (cells < size)).all(axis=(1, 2))
        padded = np.clip(cells, -1, size) + 1
        return inside & ~blocked[rows[where][:, None], padded[..., 0], padded[..., 1]].any(axis=1)

    def stamp(where: np.ndarray, pixel: np.ndarray, index: int) -> None:
        around = pixel[:, None, :] + NEIGHBOURHOOD + 1  # (k, 9, 2) padded coordinates
        view = own[where[:, None], around[..., 0], around[..., 1]]
        own[where[:, None], around[..., 0], around[..., 1]] = np.minimum(view, index)

    start = rng.integers(0, size, (count, 2))
    ok = free(everyone, (start[:, None, :] + NEIGHBOURHOOD) if blobs else start[:, None, :])
    pixels[:, 0] = start
    stamp(everyone, start, 0)
    heading = rng.integers(0, 8, count)  # the first segment's direction is this, turned like any other
    for segment in range(segments):
        # Each curve's three turns in random order: the first one tried is uniform (and the first segment's
        # direction, a uniform heading turned so, uniform over all eight).
        order = rng.permuted(np.tile(np.array([-1, 0, 1]), (count, 1)), axis=1)
        waiting = np.flatnonzero(ok)
        ok[:] = False
        last = segment * segment_length  # index of the last pixel drawn
        for attempt in range(3):
            if waiting.size == 0:
                break
            direction = (heading[waiting] + order[waiting, attempt]) % 8
            steps = np.arange(1, segment_length + 1)
            cells = pixels[waiting, last][:, None, :] + DIRECTIONS[direction][:, None, :] * steps[:, None]
            fits = free(waiting, cells)
            indices = last + steps  # (segment_length,) pixel indices
            padded = np.clip(cells, -1, size) + 1
            fits &= (own[waiting[:, None], padded[..., 0], padded[..., 1]] >= indices - 1).all(axis=1)
            done = waiting[fits]
            for step in range(segment_length):
                stamp(done, cells[fits, step], last + step + 1)
            pixels[done, last + 1 : last + 1 + segment_length] = cells[fits]
            directions[done, segment] = direction[fits]
            heading[done] = direction[fits]
            ok[done] = True
            waiting = waiting[~fits]
    if blobs:
        end = pixels[:, -1]
        ok &= free(everyone, end[:, None, :] + NEIGHBOURHOOD)
        clearance = ((pixels[:, :1], pixels[:, END_CLEARANCE:]), (pixels[:, -1:], pixels[:, : points - END_CLEARANCE]))
        for tip, others in clearance:
            ok &= (np.abs(others - tip).max(axis=-1) >= 3).all(axis=1)
    return ok, pixels, directions


def _footprint(pixels: np.ndarray) -> np.ndarray:
    """A target curve's pixels and the 3 x 3 blobs around both its ends: (count, P + 18, 2)."""
    ends = np.concatenate([pixels[:, :1] + NEIGHBOURHOOD, pixels[:, -1:] + NEIGHBOURHOOD], axis=1)
    return np.concatenate([pixels, ends], axis=1)


def _block(blocked: np.ndarray, rows: np.ndarray, cells: np.ndarray) -> None:
    """Mark every cell touching ``cells`` (count, k, 2) of images ``rows`` as blocked (padded coordinates)."""
    around = cells[:, :, None, :] + NEIGHBOURHOOD + 1  # (count, k, 9, 2)
    blocked[rows[:, None, None], around[..., 0], around[..., 1]] = True


def _place_strokes(
    rng: np.random.Generator, count: int, size: int, contour_length: int, segment_length: int,
    num_distractors: int, distractor_length: int,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Try to draw the strokes of ``count`` images: the two target curves, then the distractors, each drawn
    again (up to TRIES times) where it fails. Returns (kept: (count,) bool, curves, directions, distractors)
    with the arrays of :class:`PathfinderImages` (rows of images not kept are meaningless)."""
    blocked = np.zeros((count, size + 2, size + 2), dtype=bool)
    kept = np.ones(count, dtype=bool)
    curves = np.zeros((count, 2, contour_length * segment_length + 1, 2), dtype=np.int64)
    directions = np.zeros((count, 2, contour_length), dtype=np.int64)
    distractors = np.zeros((count, num_distractors, distractor_length * segment_length + 1, 2), dtype=np.int64)
    strokes = [(True, i) for i in range(2)] + [(False, i) for i in range(num_distractors)]
    for is_curve, index in strokes:
        segments = contour_length if is_curve else distractor_length
        waiting = np.flatnonzero(kept)
        for _ in range(TRIES):
            if waiting.size == 0:
                break
            ok, pixels, turns = _grow_curves(rng, waiting, blocked, size, segments, segment_length, is_curve)
            done = waiting[ok]
            _block(blocked, done, _footprint(pixels[ok]) if is_curve else pixels[ok])
            if is_curve:
                curves[done, index] = pixels[ok]
                directions[done, index] = turns[ok]
            else:
                distractors[done, index] = pixels[ok]
            waiting = waiting[~ok]
        kept[waiting] = False
    return kept, curves, directions, distractors


def _marker_options(curves: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """The six ways to mark an image's two target curves and the offset key of each.

    Options 0 and 1 mark both ends of curve 0 or curve 1 (label 1); options 2..5 one end of each curve (label
    0). Returns (markers (count, 6, 2, 2) (row, column) of both markers, keys (count, 6) int64): the key
    identifies the markers' offset up to sign (the relative position an image shows: both markers look alike)
    and the distance from the nearer marker to the nearest edge of the image.
    """
    ends = curves[:, :, [0, -1]]  # (count, curve, end, 2)
    pairs = [(ends[:, 0, 0], ends[:, 0, 1]), (ends[:, 1, 0], ends[:, 1, 1])]
    pairs += [(ends[:, 0, i], ends[:, 1, j]) for i in (0, 1) for j in (0, 1)]
    markers = np.stack([np.stack(pair, axis=1) for pair in pairs], axis=1)
    offset = markers[:, :, 1] - markers[:, :, 0]
    flip = (offset[..., 0] < 0) | ((offset[..., 0] == 0) & (offset[..., 1] < 0))
    offset = np.where(flip[..., None], -offset, offset)
    border = np.minimum(markers, size - 1 - markers).min(axis=(-2, -1))  # the nearer marker's distance to an edge
    return markers, (border * (size + 1) + offset[..., 0]) * (2 * size + 1) + offset[..., 1] + size


OPTION_LABELS = np.array([1, 1, 0, 0, 0, 0])
"""The label of each marking option of :func:`_marker_options`."""


class _OffsetMatcher:
    """Pairs label-1 and label-0 markings with equal offsets, across batches of candidate images.

    Each candidate image is offered once, with its six markings in random order: the first marking whose
    offset a waiting candidate of the other label has makes a pair with it; if none does, the candidate waits
    under all six. A candidate is used at most once. Every pair has one image of each label and one offset,
    so the offsets of the pairs' images have the same distribution for both labels, exactly.
    """

    def __init__(self) -> None:
        self.waiting: Tuple[Dict[int, List[Tuple[int, int]]], ...] = ({}, {})  # by label: key -> (candidate, option)
        self.used: set = set()
        self.pairs: List[Tuple[int, int, int, int]] = []  # (positive, its option, negative, its option)

    def offer(self, first: int, keys: np.ndarray, orders: np.ndarray, wanted: int) -> None:
        """Offer candidates ``first, first + 1, ...`` with their (count, 6) ``keys`` and option ``orders``,
        stopping once ``wanted`` pairs are made."""
        for row in range(keys.shape[0]):
            if len(self.pairs) >= wanted:
                return
            candidate = first + row
            options = [(int(option), int(keys[row, option])) for option in orders[row]]
            if not any(self._pair(candidate, option, key) for option, key in options):
                for option, key in options:
                    self.waiting[OPTION_LABELS[option]].setdefault(key, []).append((candidate, option))

    def _pair(self, candidate: int, option: int, key: int) -> bool:
        label = OPTION_LABELS[option]
        queue = self.waiting[1 - label].get(key)
        while queue and queue[-1][0] in self.used:
            queue.pop()
        if not queue:
            return False
        other, other_option = queue.pop()
        self.used.update((candidate, other))
        mine, theirs = (candidate, option), (other, other_option)
        self.pairs.append((*mine, *theirs) if label else (*theirs, *mine))
        return True


MAX_CANDIDATES_PER_IMAGE = 64
"""Candidate images drawn per image asked for (plus 65,536) before a setting is refused as one whose label-1 and
label-0 markings share too few offsets."""


def check_geometry(
    size: object, contour_length: object, segment_length: object, num_distractors: object, distractor_length: object,
) -> Tuple[int, int, int, int, int]:
    """The image options of Pathfinder, checked (a TypeError for a non-int, a ValueError out of range, naming
    the option) and returned in this order: ``size`` >= 8, ``num_distractors`` >= 0, the others >= 1."""
    return (
        check_number("size", size, integer=True, minimum=8),
        check_positive_int("contour_length", contour_length),
        check_positive_int("segment_length", segment_length),
        check_number("num_distractors", num_distractors, integer=True, minimum=0),
        check_positive_int("distractor_length", distractor_length),
    )


def generate_pathfinder(
    count: int, *, size: int, contour_length: int, segment_length: int, num_distractors: int,
    distractor_length: int, rng: np.random.Generator,
) -> PathfinderImages:
    """``count`` Pathfinder images drawn from ``rng``: ``count // 2`` of label 1, the others label 0, in random
    order. Label 1 and label 0 come in pairs of equal marker offsets (:class:`_OffsetMatcher`), so for an even
    ``count`` the markers' relative position has the same distribution for both labels, exactly. ``count`` is
    an int >= 1, the image options as :func:`check_geometry` takes them, ``rng`` a ``numpy.random.Generator``;
    anything else is refused naming the argument, before anything is drawn."""
    count = check_positive_int("count", count)
    size, contour_length, segment_length, num_distractors, distractor_length = check_geometry(
        size, contour_length, segment_length, num_distractors, distractor_length)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {rng!r} "
                        f"({type(rng).__name__})")
    wanted = (count + 1) // 2
    matcher = _OffsetMatcher()
    parts: List[Tuple[np.ndarray, ...]] = []
    candidates = 0
    batch = 2 * count + 64
    while len(matcher.pairs) < wanted:
        kept, curves, directions, distractors = _place_strokes(
            rng, batch, size, contour_length, segment_length, num_distractors, distractor_length)
        if candidates > MAX_CANDIDATES_PER_IMAGE * count + 65536 or (not kept.any() and batch >= 1024):
            raise ValueError(
                f"pathfinder could not fit two curves of contour_length={contour_length} segments of "
                f"segment_length={segment_length} and num_distractors={num_distractors} distractors of "
                f"distractor_length={distractor_length} into size={size} images with markers as far apart for "
                "both labels: make them shorter or fewer"
            )
        taken = np.flatnonzero(kept)
        markers, keys = _marker_options(curves[taken], size)
        orders = rng.permuted(np.tile(np.arange(OPTION_LABELS.size), (taken.size, 1)), axis=1)
        made = len(matcher.pairs)
        matcher.offer(candidates, keys, orders, wanted)
        parts.append((curves[taken], directions[taken], distractors[taken], markers))
        candidates += taken.size
        # Size the next batch by the pairs the last one made, with a margin; the rate grows as candidates wait.
        rate = max(len(matcher.pairs) - made, 1) / max(taken.size, 1)
        batch = int(min(1 << 15, max(1024, 1.2 * (wanted - len(matcher.pairs)) / rate)))
    curves, directions, distractors, options = (np.concatenate(arrays) for arrays in zip(*parts))

    pairs = np.array(matcher.pairs, dtype=np.int64)
    positives = pairs[: count // 2]  # an odd count drops the last pair's label-1 image
    chosen = np.concatenate([positives[:, 0], pairs[:, 2]])
    option = np.concatenate([positives[:, 1], pairs[:, 3]])
    order = rng.permutation(count)
    chosen, option = chosen[order], option[order]
    labels = OPTION_LABELS[option].astype(np.int64)
    markers = options[chosen, option]
    curves, directions, distractors = curves[chosen], directions[chosen], distractors[chosen]

    rows = np.arange(count)
    images = np.zeros((count, size, size), dtype=np.uint8)
    level = rng.integers(*STROKE_LEVELS, count).astype(np.uint8)
    strokes = np.concatenate([curves.reshape(count, -1, 2), distractors.reshape(count, -1, 2)], axis=1)
    images[rows[:, None], strokes[..., 0], strokes[..., 1]] = level[:, None]
    blobs = (markers[:, :, None, :] + NEIGHBOURHOOD).reshape(count, -1, 2)
    images[rows[:, None], blobs[..., 0], blobs[..., 1]] = MARKER_VALUE
    return PathfinderImages(images, labels, curves, directions, markers, distractors)


@register
class Pathfinder(Task):
    """Pathfinder: are the two markers on the same curve? Pixels as a sequence (Long Range Arena)."""

    name = "pathfinder"
    kind = "classify"
    metric = "accuracy"
    needs_causal = False
    summary = "are two markers on one curve? size x size greyscale pixels read row by row, as in the Long Range Arena"

    def __init__(
        self,
        *,
        seed: int = 0,
        train_size: int = 8000,
        validation_size: int = 1000,
        test_size: int = 1000,
        size: int = 32,
        contour_length: int = 9,
        segment_length: int = 3,
        num_distractors: int = 6,
        distractor_length: int = 2,
    ) -> None:
        self.seed = self._check_seed(seed)
        self._set_split_sizes(train_size, validation_size, test_size)
        self.size, self.contour_length, self.segment_length, self.num_distractors, self.distractor_length = \
            check_geometry(size, contour_length, segment_length, num_distractors, distractor_length)

        self.vocab_size = 256
        self.seq_len = self.size * self.size
        self.num_classes = 2
        self.pad_id: Optional[int] = None

        rng = np.random.default_rng(self.seed)
        splits: Dict[str, Split] = {}
        for split_name, count in (("train", self.train_size), ("validation", self.validation_size),
                                  ("test", self.test_size)):
            made = generate_pathfinder(
                count, size=self.size, contour_length=self.contour_length, segment_length=self.segment_length,
                num_distractors=self.num_distractors, distractor_length=self.distractor_length, rng=rng,
            )
            inputs = torch.from_numpy(made.images.reshape(count, -1).astype(np.int64))
            splits[split_name] = Split(inputs, torch.from_numpy(made.labels), None)
        self._set_splits(splits)

    def _describe_extra(self) -> List[str]:
        return [
            f"{self.size} x {self.size} images, rows read in order; two curves of {self.contour_length} segments "
            f"x {self.segment_length} pixels, {self.num_distractors} distractors of {self.distractor_length} "
            f"segments; markers {MARKER_VALUE}, strokes {STROKE_LEVELS[0]}..{STROKE_LEVELS[1] - 1}; seed {self.seed}",
        ]


def threshold_accuracy(feature: np.ndarray, labels: np.ndarray) -> float:
    """The best accuracy of a rule ``label = feature > t`` or ``label = feature <= t`` over every threshold
    ``t``: what a model could get from ``feature`` (n,) alone, if it were told how to use it. 0.5 on a
    balanced set: the feature says nothing that a threshold can read."""
    values, inverse = np.unique(feature, return_inverse=True)
    positives = np.bincount(inverse, weights=labels == 1, minlength=values.size)
    negatives = np.bincount(inverse, weights=labels != 1, minlength=values.size)
    # Rule "label 1 iff feature > values[i]" for i = -1 (every one) .. values.size - 1 (none).
    at_or_below = np.concatenate([[0.0], np.cumsum(negatives)]), np.concatenate([[0.0], np.cumsum(positives)])
    right = at_or_below[0] + positives.sum() - at_or_below[1]
    accuracy = right / labels.size
    return float(np.maximum(accuracy, 1 - accuracy).max())


def marker_offsets(made: PathfinderImages) -> np.ndarray:
    """(n, 2) absolute row and column offsets between the two markers."""
    return np.abs(made.markers[:, 0] - made.markers[:, 1])


def marker_distance_accuracy(made: PathfinderImages) -> float:
    """The best accuracy of a threshold on the two markers' distance (Chebyshev, in pixels), either way round:
    how much of the label a model could read without following any curve. Near 0.5 means no shortcut."""
    return threshold_accuracy(marker_offsets(made).max(axis=-1), made.labels)


def shortcut_accuracies(made: PathfinderImages) -> Dict[str, float]:
    """:func:`threshold_accuracy` of every cheap feature that could give the label away without tracing a curve:
    the markers' relative position (distances, offsets, and offsets on the segment grid, which every curve's
    ends sit on), their absolute position, and counts of pixels (all, marked, on the markers' bounding box)."""
    offset = marker_offsets(made)
    segment_length = (made.curves.shape[2] - 1) // made.directions.shape[2]
    size = made.images.shape[-1]
    count = made.labels.size
    rows = np.arange(size)
    low, high = made.markers.min(axis=1), made.markers.max(axis=1)  # (n, 2) the markers' bounding box
    inside_rows = (rows >= low[:, :1]) & (rows <= high[:, :1])
    inside_columns = (rows >= low[:, 1:]) & (rows <= high[:, 1:])
    box = inside_rows[:, :, None] & inside_columns[:, None, :]
    border = np.minimum(made.markers, size - 1 - made.markers).min(axis=(1, 2))
    pixels = made.images.reshape(count, -1)
    stroke = (made.images > 0) & (made.images < MARKER_VALUE)
    features = {
        "marker distance (Chebyshev)": offset.max(axis=-1),
        "marker distance (Euclidean)": (offset ** 2).sum(axis=-1),
        "marker distance (Manhattan)": offset.sum(axis=-1),
        "row offset": offset[:, 0],
        "column offset": offset[:, 1],
        "offset on the segment grid": (offset % segment_length == 0).all(axis=-1).astype(np.int64),
        "markers' distance to the border": border,
        "markers' mean row": made.markers[:, :, 0].sum(axis=1),
        "markers' mean column": made.markers[:, :, 1].sum(axis=1),
        "non-zero pixels": (pixels > 0).sum(axis=1),
        "marker pixels": (pixels == MARKER_VALUE).sum(axis=1),
        "stroke grey level": pixels.max(axis=1, where=pixels < MARKER_VALUE, initial=0),
        "stroke pixels in the markers' bounding box": (stroke & box).reshape(count, -1).sum(axis=1),
    }
    return {name: threshold_accuracy(feature, made.labels) for name, feature in features.items()}
