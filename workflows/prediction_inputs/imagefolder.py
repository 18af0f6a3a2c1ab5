"""A folder of images: class folders (or ``train/`` and ``val/`` of them, ``predict.split``
chosen) give labels; a plain folder of images is scored without. Read by the training
source's reader (``workers/sources/imagefolder.py``)."""

from typing import Any

from workers.inference import Partition
from workers.sources import SourceError
from workers.sources.imagefolder import scan_classes
from workers.sources.images import IMAGE_SUFFIXES
from workflows.config import ConfigError
from workflows.prediction_inputs import InputPlan, InputRequest


def plan(fs: Any, path: str, url: str, request: InputRequest) -> InputPlan | None:
    if not fs.isdir(path):
        return None
    base, shown = path, url
    if fs.isdir(f"{path}/train") and fs.isdir(f"{path}/val"):
        base, shown = f"{path}/{request.split}", f"{url}/{request.split}"
    classes: list[str] | None
    try:
        items, classes = scan_classes(fs, base, shown)
        index = {name: i for i, name in enumerate(classes)}
        records = [(file, index[name]) for file, name, _ in items]
    except SourceError as error:
        if "has no class folders" not in str(error):
            raise ConfigError(str(error).replace("data.root:", "--input:")) from None
        # A plain folder of images: scored without labels.
        found = sorted(p for p in fs.find(base) if p.lower().endswith(IMAGE_SUFFIXES))
        if not found:
            raise ConfigError(
                f"--input: {url} holds no images ({', '.join(IMAGE_SUFFIXES)}), no dataset "
                "store and no CIFAR-10 test batch"
            ) from None
        records, classes = [(fs.unstrip_protocol(p), -1) for p in found], None
    prefix = fs.unstrip_protocol(base).rstrip("/") + "/"
    ids = [file.removeprefix(prefix) for file, _ in records]
    parts = [
        Partition(
            i, lo, hi, "imagefolder", shown, records=tuple(records[lo:hi]), ids=tuple(ids[lo:hi])
        )
        for i, (lo, hi) in enumerate(request.ranges(len(records)))
    ]
    return InputPlan("imagefolder", shown, parts, classes)
