"""A progress bar while a model's weights load: per Ray worker, drawn by the driver.

In a Ray actor the bar is Ray's ``tqdm_ray``: the worker prints its state as log lines that
Ray forwards, and the driver (the server, or a ``ray job``'s entry point) draws one bar per
worker process. In-process (``LLMEngine``) it is a plain ``tqdm`` bar on a terminal, nothing
otherwise.
"""

from __future__ import annotations

import tqdm

from fusedserve.worker.model.loader import Progress


def weight_progress(desc: str, in_ray_worker: bool) -> tuple[Progress, object]:
    """``(progress, bar)``: pass ``progress`` to the loader; ``bar.close()`` when loading ends."""
    if in_ray_worker:
        from ray.experimental.tqdm_ray import tqdm as ray_tqdm

        bar = ray_tqdm(desc=desc, unit="layer", flush_interval_s=0.5)
    else:
        bar = tqdm.tqdm(desc=desc, unit="layer", disable=None, leave=False)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    return progress, bar
