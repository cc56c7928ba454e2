"""The names flags choose from, spelled here without importing what they name: ``--help`` lists them and
must answer without importing torch. ``tests/cli/test_choices.py`` checks each against its registry
(``model.PRESETS``, ``algo.configs.METHODS``, ``collective.codecs.CODECS``, ``collective.aggregate``,
``hf.DTYPES``, ``pipeline.PipelineConfig``), so a name added there fails that test until it is added here.
"""

from typing import Literal, get_args

__all__ = ["AGGREGATIONS", "CODECS", "DTYPES", "LOG_LEVELS", "METHODS", "PRESETS", "SCHEDULES", "Aggregation", "Clock",
           "Codec", "Dtype", "LogLevel", "Method", "Preset", "Schedule"]

Preset = Literal["micro", "tiny", "small", "150m", "1b"]
Method = Literal["ddp", "diloco", "streaming", "eager", "cocodc", "dilocox"]
Codec = Literal["fp32", "fp16", "bf16", "uint8", "fp8", "e3m0", "1bit", "2bit", "topk2", "topk2:0.03", "topk2g4:0.03"]
Aggregation = Literal["mean", "trimmed-mean", "centered-clip"]
Dtype = Literal["float32", "bfloat16", "float16"]
Schedule = Literal["1f1b", "gpipe"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
Clock = Literal["wall", "steps"]

PRESETS: tuple[str, ...] = get_args(Preset)
METHODS: tuple[str, ...] = get_args(Method)
CODECS: tuple[str, ...] = get_args(Codec)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
DTYPES: tuple[str, ...] = get_args(Dtype)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
