"""lm-eval's loader of the news tasks (``custom_dataset: !function news_data.load`` in their YAMLs): the
documents ``hydrahead_jax.evaluation.news_tasks`` builds from the held-out news, as the ``test`` split."""

import datasets

from hydrahead_jax.evaluation.news_tasks import documents


def load(task: str, **_) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(documents(task))})
