"""The server's engine worker: the model is loaded and run on one thread, and a failure to load it is the
caller's error."""

import asyncio
import threading

import pytest

from quickdraft.api import LLM
from quickdraft.config import EngineConfig, SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.server.metrics import Metrics
from quickdraft.server.worker import Done, EngineWorker, Job
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_model

CONFIG = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=64)


def test_worker_runs_the_engine_on_the_thread_that_made_it(tmp_path):
    path = save_hf_dir(tiny_hf_model("llama"), tmp_path / "tiny")
    threads = {}

    def make_llm():
        threads["made"] = threading.current_thread()
        llm = LLM(load_model(str(path), CONFIG, progress=False), CONFIG)
        start = llm.engine.start

        def recorded(*args, **kw):
            threads["ran"] = threading.current_thread()
            return start(*args, **kw)

        llm.engine.start = recorded
        return llm

    worker = EngineWorker(make_llm, 4, Metrics())

    async def one_request():
        job = Job([5, 17, 250, 3], SamplingParams(max_tokens=6, stop_at_eos=False), None, [],
                  asyncio.get_running_loop())
        worker.submit(job)
        while not isinstance(item := await asyncio.wait_for(job.events.get(), 60), Done):
            pass
        return item

    done = asyncio.run(one_request())
    worker.stop()
    assert done.completion_n == 6
    assert threads["ran"] is threads["made"] is not threading.current_thread()
    assert not worker.thread.is_alive()


def test_building_raises_what_loading_raised():
    def make_llm():
        raise QuickdraftError("model 'x' not found")

    with pytest.raises(QuickdraftError, match="not found"):
        EngineWorker(make_llm, 4, Metrics())


def test_places_in_the_queue_are_held_from_admission_and_freed_by_leaving(tmp_path):
    """A request holds its place from admission (once its constraint has compiled) until the engine takes it; a
    request whose client left frees it at once, not when the running request ends."""
    import queue as queues

    from quickdraft.server.worker import QueueFull

    path = save_hf_dir(tiny_hf_model("llama"), tmp_path / "tiny")
    worker = EngineWorker(lambda: LLM(load_model(str(path), CONFIG, progress=False), CONFIG), 2, Metrics())
    engine_queue = worker.pending
    try:
        worker.pending = queues.Queue()  # nobody takes jobs from this one: they stay waiting
        first, second = worker.admit(), worker.admit()
        with pytest.raises(QueueFull):
            worker.admit()
        loop = asyncio.new_event_loop()
        job = Job([1, 2, 3], SamplingParams(max_tokens=2), None, [], loop, ticket=first)
        worker.submit(job)
        with pytest.raises(QueueFull):
            worker.admit()
        job.cancel()  # its client left while it waited
        third = worker.admit()
        second.release(), second.release()  # given up before submitting (a constraint that did not compile)
        assert worker.held == 1 and third is not None
        loop.close()
    finally:
        worker.pending = engine_queue
        worker.stop()
