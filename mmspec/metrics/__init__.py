"""Quality metrics: the world judge (tiny CNN), class accuracy, world-FID, adapters for real FID / CLIP score.

    from mmspec.metrics import class_accuracy, world_fid, world_reference_stats
    acc = class_accuracy(images, labels)                    # shipped judge from assets/judge
    ref = world_reference_stats(n=5000, seed=0)             # held-out real world images
    res = world_fid(images, ref)                             # FIDResult(fid, n_generated, n_reference)

See docs/world.md for how to read the figures.
"""

from mmspec.metrics.external import ClipScoreResult, clip_score, inception_fid
from mmspec.metrics.judge import DEFAULT_JUDGE_PATH, JudgeConfig, WorldJudge, load_judge, save_judge
from mmspec.metrics.quality import (
    FIDResult,
    ReferenceStats,
    attribute_agreement,
    class_accuracy,
    frechet_distance,
    gaussian_stats,
    judge_features,
    judge_predictions,
    world_fid,
    world_reference_stats,
)

__all__ = [
    "DEFAULT_JUDGE_PATH",
    "ClipScoreResult",
    "FIDResult",
    "JudgeConfig",
    "ReferenceStats",
    "WorldJudge",
    "attribute_agreement",
    "class_accuracy",
    "clip_score",
    "frechet_distance",
    "gaussian_stats",
    "inception_fid",
    "judge_features",
    "judge_predictions",
    "load_judge",
    "save_judge",
    "world_fid",
    "world_reference_stats",
]
