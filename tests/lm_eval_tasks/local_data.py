"""Datasets of the local lm-eval test tasks: JSONL files beside this module, read without the Hugging Face Hub.

A task YAML names its file with ``dataset_kwargs: {data_file: NAME.jsonl}`` and ``custom_dataset: !function
local_data.load``; lm-eval calls ``load(**metadata, **dataset_kwargs)``.
"""

import json
from pathlib import Path

import datasets


def load(data_file: str, **_) -> datasets.DatasetDict:
    """The rows of ``data/<data_file>`` as the ``test`` split."""
    lines = (Path(__file__).parent / "data" / data_file).read_text(encoding="utf-8").splitlines()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line])})
