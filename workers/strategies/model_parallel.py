"""The seed article's ModelPart1 → ModelPart2: the model cut into stages on several ranks.

It is the degenerate pipeline: its layout has one micro-batch, so only one stage works at a
time and the schedule is plain GPipe.
"""

from workers.strategies.base import register
from workers.strategies.pipeline import PipelineStrategy


@register
class ModelParallel(PipelineStrategy):
    name = "model_parallel"
