"""The embedded procedural world: small RGB images of coloured shapes, class labels, captions and QA.

No weights or data sets can be downloaded, so mmspec ships its own world and trains small real models on it.
Everything is deterministic in the seed and platform-stable (integer arithmetic). See docs/world.md.

    from mmspec.data import generate_batch, WorldDataset, NUM_CLASSES, class_name
    batch = generate_batch(64, seed=0, split="train")      # uint8 images [64, 3, 32, 32], labels, text
    x = batch.float_images()                                # float32 in [0, 1]
    ds = WorldDataset("val", size=1000, seed=0)             # ds[i] == row i of a batch, as a dict
    tok = load_world_tokenizer()                             # transformers PreTrainedTokenizerFast
"""

from mmspec.data.dataset import (
    WorldBatch,
    WorldDataset,
    collate_world,
    generate_batch,
    images_to_float,
    images_to_uint8,
)
from mmspec.data.text import QA
from mmspec.data.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    SPECIAL_TOKENS,
    load_world_tokenizer,
    world_corpus,
)
from mmspec.data.world import (
    BACKGROUNDS,
    CLASS_NAMES,
    COLORS,
    IMAGE_SIZES,
    NUM_CLASSES,
    POSITIONS,
    SHAPES,
    SIZES,
    SPLITS,
    class_index,
    class_name,
    class_parts,
)

__all__ = [
    "BACKGROUNDS",
    "CLASS_NAMES",
    "COLORS",
    "DEFAULT_TOKENIZER_PATH",
    "IMAGE_SIZES",
    "NUM_CLASSES",
    "POSITIONS",
    "QA",
    "SHAPES",
    "SIZES",
    "SPECIAL_TOKENS",
    "SPLITS",
    "WorldBatch",
    "WorldDataset",
    "class_index",
    "class_name",
    "class_parts",
    "collate_world",
    "generate_batch",
    "images_to_float",
    "images_to_uint8",
    "load_world_tokenizer",
    "world_corpus",
]
