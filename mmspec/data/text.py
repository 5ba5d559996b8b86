"""Captions and question/answer pairs of world scenes: deterministic English templates.

Every scene has one caption ("a large red circle in the upper left on a dark gray background") and a fixed
list of questions. Each question has a short answer (one or two words, e.g. "red") and a long answer: two or
three full sentences (20-60 words) that restate the answer and describe the scene. Long answers matter for
speculative decoding benchmarks: a one-word answer hides any speed-up.

Single-object questions, in order: color, shape, size, position, count, background. Two-object scenes refer to
each object by its position ("What color is the object in the upper left?") and add a count and a background
question, and a position question when the two objects differ in colour or shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mmspec.data.world import BACKGROUNDS, COLORS, POSITION_PHRASES, POSITIONS, SHAPES, SIZES, SceneParams

SHAPE_FACTS: dict[str, str] = {
    "circle": "A circle is perfectly round, with no corners and no straight edges",
    "square": "A square has four straight sides of equal length and four right-angled corners",
    "triangle": "This triangle points upward, with a flat base at the bottom and three sharp corners",
    "cross": "A cross is made of two straight bars of equal length that meet in the middle like a plus sign",
}
SIZE_FACTS: dict[str, str] = {
    "small": "small, covering only a little of the picture",
    "medium": "of medium size, neither tiny nor filling the frame",
    "large": "large, filling a big part of the picture",
}
COUNT_WORDS: tuple[str, ...] = ("zero", "one", "two")


@dataclass(frozen=True)
class QA:
    """One question about a scene with its short and long answers; `kind` is color/shape/size/position/..."""

    kind: str
    question: str
    short: str
    long: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class ObjectText:
    """Names of one object's attributes."""

    shape: str
    color: str
    size: str
    position: str  # short form, e.g. "upper left"
    where: str  # phrase, e.g. "in the upper left"

    @property
    def noun(self) -> str:
        """e.g. "large red circle"."""
        return f"{self.size} {self.color} {self.shape}"


def _cap(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


def _article(noun_phrase: str) -> str:
    return ("an " if noun_phrase[0] in "aeiou" else "a ") + noun_phrase


def scene_objects(p: SceneParams, row: int) -> tuple[list[ObjectText], str]:
    """The objects (first one first) and background name of scene `row`."""
    objects = []
    for k in range(int(p.n_objects[row])):
        cell = int(p.cell[row, k])
        objects.append(
            ObjectText(
                shape=SHAPES[int(p.shape[row, k])],
                color=COLORS[int(p.color[row, k])],
                size=SIZES[int(p.size[row, k])],
                position=POSITIONS[cell],
                where=POSITION_PHRASES[cell],
            )
        )
    return objects, BACKGROUNDS[int(p.background[row])]


def caption(objects: list[ObjectText], background: str) -> str:
    """e.g. "a large red circle in the upper left on a dark gray background"."""
    parts = " and ".join(f"{_article(o.noun)} {o.where}" for o in objects)
    return f"{parts} on {_article(background)} background"


def _single_qa(o: ObjectText, bg: str) -> list[QA]:
    scene = f"{_article(o.noun)} {o.where} of the image, on a plain {bg} background"
    return [
        QA(
            "color",
            "What color is the object?",
            o.color,
            f"The object is {o.color}. It is {scene}. There is only one object in the picture, "
            f"so {o.color} is the only color used for a shape here.",
        ),
        QA(
            "shape",
            "What shape is the object?",
            o.shape,
            f"The object is {_article(o.shape)}. {SHAPE_FACTS[o.shape]}. It is {o.size} and {o.color}, "
            f"and it sits {o.where} of the image on a {bg} background.",
        ),
        QA(
            "size",
            "How big is the object?",
            o.size,
            f"The object is {o.size}. Compared with the whole image, the {o.color} {o.shape} is "
            f"{SIZE_FACTS[o.size]}. It is placed {o.where} of the picture, on a {bg} background.",
        ),
        QA(
            "position",
            "Where is the object?",
            o.position,
            f"The object is {o.where} of the image. The {o.noun} sits there on a {bg} background, "
            "and the rest "
            "of the picture around it is empty, with nothing else drawn on it.",
        ),
        QA(
            "count",
            "How many objects are there?",
            "one",
            f"There is one object in the image. It is {scene}, and apart from this single shape the picture "
            "contains only the background.",
        ),
        QA(
            "background",
            "What color is the background?",
            bg,
            f"The background is {bg}. It fills the whole picture behind the {o.noun}, which sits "
            f"{o.where} of the "
            "image. The background has no pattern, only a gentle change in brightness at most.",
        ),
    ]


def _pair_qa(a: ObjectText, b: ObjectText, bg: str) -> list[QA]:
    both = f"{_article(a.noun)} {a.where} and {_article(b.noun)} {b.where}"
    qa: list[QA] = []
    for o, other, which in ((a, b, "second"), (b, a, "first")):
        qa.append(
            QA(
                "color",
                f"What color is the object {o.where}?",
                o.color,
                f"The object {o.where} is {o.color}. It is {_article(o.noun)}, and the other "
                "object in the picture, "
                f"the {which} one, is {_article(other.noun)} {other.where}. "
                f"Both sit on a {bg} background.",
            )
        )
        qa.append(
            QA(
                "shape",
                f"What shape is the object {o.where}?",
                o.shape,
                f"The object {o.where} is {_article(o.shape)}. {SHAPE_FACTS[o.shape]}. It is "
                f"{o.size} and {o.color}, "
                f"and it shares the {bg} background with {_article(other.noun)} {other.where}.",
            )
        )
    if (a.color, a.shape) != (b.color, b.shape):
        qa.append(
            QA(
                "position",
                f"Where is the {a.color} {a.shape}?",
                a.position,
                f"The {a.color} {a.shape} is {a.where} of the image. It is {a.size}, and the other object, "
                f"{_article(b.noun)}, is {b.where}. The two shapes sit apart on a {bg} background.",
            )
        )
    qa.append(
        QA(
            "count",
            "How many objects are there?",
            "two",
            f"There are two objects in the image: {both}. They do not touch each other, and the rest of the "
            f"picture is a plain {bg} background.",
        )
    )
    qa.append(
        QA(
            "background",
            "What color is the background?",
            bg,
            f"The background is {bg}. It fills the whole picture behind the two objects, {both}. "
            "The background has no pattern, only a gentle change in brightness at most.",
        )
    )
    return qa


def questions_and_answers(objects: list[ObjectText], background: str) -> list[QA]:
    """The scene's question/answer pairs (see the module docstring for the list)."""
    if len(objects) == 1:
        return _single_qa(objects[0], background)
    return _pair_qa(objects[0], objects[1], background)


def scene_text(p: SceneParams, row: int) -> tuple[str, list[QA]]:
    """(caption, question/answer pairs) of scene `row`."""
    objects, bg = scene_objects(p, row)
    return caption(objects, bg), questions_and_answers(objects, bg)
